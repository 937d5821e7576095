"""Where the time of a verified plain load goes, case by case (issue 3, `load_vs_raw`).

A measurement behind docs/performance.md ("Storage"), not a test.

    python bench/load_path.py             # about 1 minute
    python bench/load_path.py --rounds 5  # quicker, noisier

It writes `--parts` (default 9) Qwen3-8B-shaped parts of 31.5 MiB through a real
`FilesystemBlockStore` (plain: XXH3-128 per 4 MiB frame, the aligned layout), warms the page
cache, and times, in interleaved rounds:

- part 1, one thread, CPU time of the thread per part (other processes do not inflate it):
  `raw`: one `os.preadv` of the whole file; `bare S`: `os.preadv` of S-byte slices straight into
  the destination, each hashed by a streaming XXH3-128 right after it is read (the least any
  Python loop of this shape can cost); `galahad`: `store.open_reader` + `codec.open_part_from`,
  frames in the calling thread (no pool);
- part 2, two threads loading parts continuously (each its own parts, no tail), wall time;
- part 3, the bench's own case (`bench/store.py` at 31.5 MiB with T = 2): the batch split into
  T interleaved shares on T threads, Galahad with a frame pool of T threads, wall time.

Figures: GB/s of payload, best and median of the rounds, and the median same-round ratio to
`raw`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import store as storebench  # noqa: E402

from galahad import codec  # noqa: E402
from galahad.codec import Expect, open_part_from  # noqa: E402

TOKENS = 224  # 31.5 MiB parts, the ratio line's size
KiB = 1 << 10
SLICES = (512 * KiB, 1024 * KiB, 2048 * KiB, 4096 * KiB)


def _rounds(cases: dict[str, Callable[[], None]], rounds: int, clock: Callable[[], float]) -> dict[str, list[float]]:
    for run in cases.values():
        run()  # warm-up
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(rounds):
        for case, run in cases.items():
            t0 = clock()
            run()
            times[case].append(clock() - t0)
    return times


def _report(title: str, times: dict[str, list[float]], nbytes: int) -> None:
    print(title)
    base = next(iter(times.values()))
    for case, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(f"  {case:<34} best {nbytes / min(ts) / 1e9:6.2f}  median {nbytes / statistics.median(ts) / 1e9:6.2f}"
              f"  ratio {ratio:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--parts", type=int, default=9)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="galahad-load-path-", dir=args.dir)
    load_before = os.getloadavg()[0]
    try:
        batch = storebench.Batch(TOKENS, args.parts, root)
        galahad = storebench.Galahad(batch, (1, 2))
        try:
            run(galahad, batch, args.rounds)
        finally:
            galahad.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average (1 min): {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


def run(galahad: storebench.Galahad, batch: storebench.Batch, rounds: int) -> None:
    paths = [galahad.part_path(i) for i in range(batch.count)]
    header_len = os.path.getsize(paths[0]) - batch.part_bytes - 16 * -(-batch.part_bytes // (4 << 20))
    frame = 4 << 20

    def raw(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.preadv(fd, [batch.images[i]], 0)
        finally:
            os.close(fd)

    def bare(size: int) -> Callable[[int], None]:
        def load(i: int) -> None:
            dst = batch.part(batch.dst, i)
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                for start in range(0, len(dst), frame):
                    state = xxhash.xxh3_128(seed=i)
                    for at in range(start, min(len(dst), start + frame), size):
                        piece = dst[at : min(at + size, start + frame)]
                        os.preadv(fd, [piece], header_len + at)
                        state.update(piece)
                    state.digest()
            finally:
                os.close(fd)

        return load

    def product(t: int, pooled: bool, piece: int | None = None) -> Callable[[int], None]:
        service = galahad.services[("load", "plain", t)]
        store, pool, lookup = service.store, service._frames if pooled else None, galahad.lookups["plain"]

        def load(i: int) -> None:
            if piece is not None:
                codec._SLICE = piece
            key = galahad.key("plain", i)
            with store.open_reader(key, 0) as reader:
                open_part_from(reader, expect=Expect(namespace=service.digest, chain_key=key.raw, rank=0, world=1),
                               ciphers=lookup, pool=pool, out=batch.part(batch.dst, i))  # fmt: skip

        return load

    singles: dict[str, Callable[[int], None]] = {"raw (one preadv)": raw}
    for size in (256 * KiB, 512 * KiB, 1024 * KiB, 4096 * KiB):
        singles[f"bare {size // KiB}K slices + xxh3"] = bare(size)
    for size in SLICES:
        singles[f"galahad, {size // KiB}K slices"] = product(1, pooled=False, piece=size)
    times = _rounds({c: (lambda f=f: f(0)) for c, f in singles.items()}, rounds * 4, time.thread_time)
    _report("part 1: one part, one thread, CPU time of the thread", times, batch.part_bytes)

    def both(load: Callable[[int], None]) -> Callable[[], None]:
        def go() -> None:
            gate = threading.Barrier(2)

            def worker(k: int) -> None:
                gate.wait()
                for i in range(k, 8, 2):
                    load(i)

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()

        return go

    pairs = {c: both(f) for c, f in singles.items() if c.startswith(("raw", "bare 512K"))}
    for size in SLICES:
        pairs[f"galahad, {size // KiB}K slices"] = both(product(2, pooled=False, piece=size))
    times = _rounds(pairs, rounds, time.perf_counter)
    _report("part 2: two threads, 4 parts each, no tail, wall time", times, 8 * batch.part_bytes)

    pool = cf.ThreadPoolExecutor(2)
    shares = [list(range(k, batch.count, 2)) for k in range(2)]

    def batch_case(load: Callable[[int], None]) -> Callable[[], None]:
        def go() -> None:
            for future in [pool.submit(lambda s=s: [load(i) for i in s]) for s in shares]:
                future.result()

        return go

    cases = {"raw (one preadv)": batch_case(raw), "bare 512K slices + xxh3": batch_case(bare(512 * KiB))}
    for size in SLICES:
        cases[f"galahad, {size // KiB}K slices, pool of 2"] = batch_case(product(2, pooled=True, piece=size))
    times = _rounds(cases, rounds, time.perf_counter)
    _report(f"part 3: bench/store.py's case: {batch.count} parts, shares {[len(s) for s in shares]} on 2 threads, wall time",
            times, batch.total)  # fmt: skip
    pool.shutdown()


if __name__ == "__main__":
    sys.exit(main())
