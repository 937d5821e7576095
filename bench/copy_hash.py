"""The floor under `load_vs_raw`: what copying out of the page cache then hashing costs, with no
Galahad code at all. A measurement behind docs/performance.md (Storage, tenth session), not a test.

    python bench/copy_hash.py [--threads 2] [--rounds 7] [--dir DIR]

Nine 31.5 MB files (the ratio line's part size and batch) are written once and read warm by
`--threads` threads, each file by one thread, into a page-aligned buffer: whole (one `preadv`,
bench/store.py's `raw read`), in slices of 512 KiB (Galahad's read size), and in slices each
hashed with xxh3-128 while it is still in the core's cache (Galahad's plain load without its
format, its Python or its frame pool), and the same with each slice hashed twice (the second
hash's cost is that of hashing from the cache: how much of the first is waiting for memory). It prints best and median GB/s per case, and the ratio of
the hashed slices to the whole read: how close any verifying load can come to `raw read` here.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import xxhash

SIZE = 31_500_000 // 4096 * 4096
FILES = 9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="galahad-copy-hash-", dir=args.dir)
    try:
        paths = [os.path.join(folder, f"f{i}") for i in range(FILES)]
        for path in paths:
            with open(path, "wb") as f:
                f.write(os.urandom(SIZE))
        bufs = [memoryview(mmap.mmap(-1, SIZE)) for _ in paths]

        def read(i: int, step: int, hashed: bool, times: int = 1) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                view, state = bufs[i], xxhash.xxh3_128() if hashed else None
                for off in range(0, SIZE, step):
                    got = os.preadv(fd, [view[off : off + step]], off)
                    for _ in range(times if state is not None else 0):
                        state.update(view[off : off + got])
            finally:
                os.close(fd)

        cases: dict[str, Callable[[int], None]] = {
            "whole": lambda i: read(i, SIZE, False),
            "slices 512 KiB": lambda i: read(i, 512 << 10, False),
            "slices 512 KiB + xxh3-128": lambda i: read(i, 512 << 10, True),
            # each slice hashed a second time: what hashing costs once the slice is in the cache
            "slices 512 KiB + xxh3-128 x2": lambda i: read(i, 512 << 10, True, 2),
        }

        def one_pass(fn: Callable[[int], None]) -> float:
            shares = [list(range(k, FILES, args.threads)) for k in range(args.threads)]
            threads = [threading.Thread(target=lambda s=s: [fn(i) for i in s]) for s in shares]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return FILES * SIZE / (time.perf_counter() - t0) / 1e9

        for fn in cases.values():  # warm-up: page cache, page faults
            one_pass(fn)
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):  # interleaved: the machine's moods fall on every case
            for name, fn in cases.items():
                rates[name].append(one_pass(fn))
        for name, xs in rates.items():
            print(f"{name:28s} best {max(xs):6.2f} median {statistics.median(xs):6.2f} GB/s")
        paired = statistics.median(h / w for h, w in zip(rates["slices 512 KiB + xxh3-128"], rates["whole"]))
        print(f"copy-hash: threads={args.threads} hashed_vs_whole={max(rates['slices 512 KiB + xxh3-128']) / max(rates['whole']):.2f} "
              f"paired={paired:.2f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
