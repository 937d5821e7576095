"""Reading a part through a mapping of its file, against `preadv`, both verifying with xxh3: the
experiment behind docs/performance.md (Storage, twenty-fifth session), not a test. Not the load
path: a mapped page that cannot be read (an I/O error, the file truncated by someone with write
access) is a SIGBUS that kills the process, where `preadv` returns an error.

    python bench/mapped_read.py [--threads 2] [--rounds 7] [--dir DIR]

Nine 31.5 MB files (bench/copy_hash.py's batch) read warm by `--threads` threads, each file by
one thread, into a buffer of its own: one `preadv` of the whole file (`whole`, the bar), `preadv`
of 512 KiB slices each hashed right after (Galahad's order), and the file mapped
(`MAP_POPULATE`) with each 512 KiB slice hashed there and then copied out (the copy then reads
the slice from the cache), or copied out and then the copy hashed (the order that is safe
against a file changed during the read). Prints best and median GB/s and best against `whole`.
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

import numpy as np
import xxhash

SIZE = 31_500_000 // 4096 * 4096
FILES = 9
SLICE = 512 << 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="galahad-mapped-read-", dir=args.dir)
    try:
        paths = [os.path.join(folder, f"f{i}") for i in range(FILES)]
        for path in paths:
            with open(path, "wb") as f:
                f.write(os.urandom(SIZE))
        bufs = [mmap.mmap(-1, SIZE) for _ in paths]
        views = [memoryview(b) for b in bufs]
        arrays = [np.frombuffer(b, dtype=np.uint8) for b in bufs]

        def pread(i: int, step: int, hashed: bool) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                view, state = views[i], xxhash.xxh3_128()
                for off in range(0, SIZE, step):
                    got = os.preadv(fd, [view[off : off + step]], off)
                    if hashed:
                        state.update(view[off : off + got])
            finally:
                os.close(fd)

        def mapped(i: int, hash_first: bool) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            src, dst, state = np.frombuffer(mm, dtype=np.uint8), arrays[i], xxhash.xxh3_128()
            for off in range(0, SIZE, SLICE):
                if hash_first:
                    state.update(memoryview(src[off : off + SLICE]))
                    np.copyto(dst[off : off + SLICE], src[off : off + SLICE])
                else:
                    np.copyto(dst[off : off + SLICE], src[off : off + SLICE])
                    state.update(views[i][off : off + SLICE])
            del src
            mm.close()

        cases: dict[str, Callable[[int], None]] = {
            "whole": lambda i: pread(i, SIZE, False),
            "preadv 512 KiB + xxh3": lambda i: pread(i, SLICE, True),
            "mapped: xxh3, then copy": lambda i: mapped(i, True),
            "mapped: copy, then xxh3": lambda i: mapped(i, False),
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
        bar = max(rates["whole"])
        for name, xs in rates.items():
            print(f"{name:26s} best {max(xs):6.2f} median {statistics.median(xs):6.2f} GB/s  vs whole {max(xs) / bar:.2f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
