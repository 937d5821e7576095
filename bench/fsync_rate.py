"""How fast this machine's disk takes durable writes: the rate under every save, apart from
Galahad. A measurement behind docs/performance.md (GPU, twenty-first session), not a test.

    python bench/fsync_rate.py [--dir DIR] [--threads 16] [--files 1150] [--mib 9]

Writes `--files` files of `--mib` MiB (the multi-turn benchmark's round 0: 1,150 entries of
64 tokens of a Qwen3-8B-shaped model, 9.4 MB each) from `--threads` threads, as the store does
(a temp name, `pwrite`, `fsync`, a hard link to the final name, the folder `fsync`ed), then the
same files again with no `fsync` at all (what a write into the page cache costs). It prints the
GB/s of each and how long the first took.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--files", type=int, default=1150)
    ap.add_argument("--mib", type=float, default=9.0)
    args = ap.parse_args()
    size = int(args.mib * (1 << 20)) // 4096 * 4096
    data = os.urandom(size)
    root = tempfile.mkdtemp(prefix="galahad-fsync-rate-", dir=args.dir)
    try:
        for durable in (True, False):
            folder = os.path.join(root, "durable" if durable else "buffered")
            for i in range(256):
                os.makedirs(os.path.join(folder, f"{i:02x}"))

            def write(i: int, folder: str = folder, durable: bool = durable) -> None:
                where = os.path.join(folder, f"{i % 256:02x}")
                tmp, final = os.path.join(where, f".tmp-{i}"), os.path.join(where, f"f{i}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.pwrite(fd, data, 0)
                    if durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.link(tmp, final)
                os.unlink(tmp)
                if durable:
                    dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)

            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(write, range(args.files)))
            took = time.perf_counter() - t0
            total = size * args.files
            print(f"fsync-rate: {'write+fsync' if durable else 'write, no fsync'}: {args.files} files of "
                  f"{size / 1e6:.1f} MB, {args.threads} threads: {total / took / 1e9:.2f} GB/s "
                  f"({took:.2f} s for {total / 1e9:.1f} GB)", flush=True)
            if durable:
                os.sync()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
