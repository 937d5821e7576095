"""Where the time of a verified plain load goes (issue 3, `load_vs_raw`): the hash, the Python
around each read, and the two loading threads of `bench/store.py`. A measurement behind
docs/performance.md ("Storage"), not a test.

    python bench/load_path.py             # about 30 s here
    python bench/load_path.py --rounds 5  # quicker, noisier

It writes `--parts` (default 9) Qwen3-8B-shaped parts of 31.5 MiB through a real
`FilesystemBlockStore` (plain: XXH3-128 per 4 MiB frame, the aligned layout) with
`bench/store.py`'s own code, warms the page cache, and measures, cases interleaved round by round:

- part 0: XXH3-128 of a 512 KiB buffer already in cache, one shot and streaming (a frame's tag
  is over its 4 MiB, so the load must stream it);
- part 1: one part, one thread, CPU time of the thread (other processes do not inflate it):
  `raw`, one `os.preadv` of the whole file; `bare S`, `os.preadv` of S-byte slices straight into
  the destination, each fed to a streaming XXH3-128 right after it is read (the least a Python
  loop of this shape can cost: no header, no store); `galahad S`, `store.open_reader` and
  `codec.open_part_from` with S-byte slices, frames in the calling thread;
- part 2: `bench/store.py`'s case at 31.5 MiB and T = 2: the batch split into 2 interleaved
  shares on 2 threads, Galahad with its frame pool of 2 threads and without one; wall time, and
  the process's CPU time per batch;
- part 3: `decode_header` of a part's header, timed alone (100 back to back: its code and data
  in cache) and right after a part was read (what a load pays: the part's bytes have just gone through the caches).

Figures: GB/s of payload, best and median of the rounds, and the median same-round ratio to the
first case.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import store as storebench  # noqa: E402
from align import _medians as _rounds  # noqa: E402  (interleaved rounds by a given clock)

from galahad import codec  # noqa: E402
from galahad.codec import Expect, open_part_from  # noqa: E402

TOKENS = 224  # 31.5 MiB parts, the ratio line's size
KiB = 1 << 10
FRAME = 4 << 20


def _report(title: str, times: dict[str, list[float]], nbytes: int) -> None:
    print(title)
    base = next(iter(times.values()))
    for case, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(f"  {case:<40} best {nbytes / min(ts) / 1e9:6.2f}  median {nbytes / statistics.median(ts) / 1e9:6.2f}"
              f"  ratio {ratio:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--parts", type=int, default=9)
    ap.add_argument("--dir", default=None, help="parent of the temp store folder (default: the system temp dir)")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="galahad-load-path-", dir=args.dir)
    load_before = os.getloadavg()[0]
    try:
        batch = storebench.Batch(TOKENS, args.parts, root)
        galahad = storebench.Galahad(batch, (1, 2))
        try:
            hashes(args.rounds)
            loads(galahad, batch, args.rounds)
            header_decode(galahad, batch, args.rounds)
        finally:
            galahad.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average (1 min): {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


def hashes(rounds: int) -> None:
    piece = memoryview(bytearray(os.urandom(512 * KiB)))

    def one_shot() -> None:
        for _ in range(64):
            xxhash.xxh3_128_digest(piece, seed=12345)

    def streaming() -> None:
        for _ in range(8):
            state = xxhash.xxh3_128(seed=12345)
            for _ in range(8):
                state.update(piece)
            state.digest()

    times = _rounds({"one shot, per 512 KiB": one_shot, "streaming, 8 x 512 KiB a state": streaming}, rounds * 4,
                    time.perf_counter)  # fmt: skip
    _report("part 0: XXH3-128 of a 512 KiB buffer in cache, one thread, wall time", times, 64 * len(piece))


def loads(galahad: storebench.Galahad, batch: storebench.Batch, rounds: int) -> None:
    paths = [galahad.part_path(i) for i in range(batch.count)]
    payload_at = os.path.getsize(paths[0]) - batch.part_bytes - 16 * -(-batch.part_bytes // FRAME)

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
                for start in range(0, len(dst), FRAME):
                    state = xxhash.xxh3_128(seed=start)
                    for at in range(start, min(len(dst), start + FRAME), size):
                        piece = dst[at : min(at + size, start + FRAME)]
                        os.preadv(fd, [piece], payload_at + at)
                        state.update(piece)
                    state.digest()
            finally:
                os.close(fd)

        return load

    def product(t: int, pooled: bool, size: int = 512 * KiB) -> Callable[[int], None]:
        service = galahad.services[("load", "plain", t)]
        store, pool, lookup = service.store, service._frames if pooled else None, galahad.lookups["plain"]

        def load(i: int) -> None:
            codec._slices[:] = [size]  # the read size of the check loop (codec._slice_bytes)
            key = galahad.key("plain", i)
            expect = Expect(namespace=service.digest, chain_key=key.raw, rank=0, world=1)
            with store.open_reader(key, 0) as reader:
                open_part_from(reader, expect=expect, ciphers=lookup, pool=pool, out=batch.part(batch.dst, i))

        return load

    try:
        singles: dict[str, Callable[[int], None]] = {"raw (one preadv)": raw}
        for size in (256 * KiB, 512 * KiB, 1024 * KiB, 4096 * KiB):
            singles[f"bare {size // KiB}K slices + xxh3"] = bare(size)
        for size in (256 * KiB, 512 * KiB, 1024 * KiB):
            singles[f"galahad {size // KiB}K slices"] = product(1, pooled=False, size=size)
        times = _rounds({c: (lambda f=f: f(0)) for c, f in singles.items()}, rounds * 4, time.thread_time)
        _report("part 1: one part, one thread, CPU time of the thread", times, batch.part_bytes)

        pool = cf.ThreadPoolExecutor(2)
        shares = [list(range(k, batch.count, 2)) for k in range(2)]
        cpu: dict[str, list[float]] = {}

        def batch_case(name: str, load: Callable[[int], None]) -> Callable[[], None]:
            def go() -> None:
                c0 = time.process_time()
                for future in [pool.submit(lambda s=s: [load(i) for i in s]) for s in shares]:
                    future.result()
                cpu.setdefault(name, []).append(time.process_time() - c0)

            return go

        cases = {"raw (one preadv)": raw, "bare 512K slices + xxh3": bare(512 * KiB),
                 "galahad (pool of 2)": product(2, pooled=True),
                 "galahad (no pool)": product(2, pooled=False)}  # fmt: skip
        times = _rounds({c: batch_case(c, f) for c, f in cases.items()}, rounds, time.perf_counter)
        _report(f"part 2: bench/store.py's case: {batch.count} parts, shares of {[len(s) for s in shares]} on 2"
                " threads, wall time", times, batch.total)  # fmt: skip
        for case, seconds in cpu.items():
            print(f"  {case:<40} CPU time of the process per batch, median: {statistics.median(seconds) * 1e3:6.1f} ms")
        pool.shutdown()
    finally:
        codec._slices[:] = []  # chosen again for this machine at the next use


def header_decode(galahad: storebench.Galahad, batch: storebench.Batch, rounds: int) -> None:
    from galahad.format.v1 import decode_header

    with open(galahad.part_path(0), "rb") as handle:
        head = handle.read(64 * KiB)
    fd = os.open(galahad.part_path(1), os.O_RDONLY | os.O_CLOEXEC)
    alone, after = [], []
    try:
        for _ in range(rounds * 4):
            t0 = time.perf_counter_ns()
            for _ in range(100):  # back to back: code and data in cache
                decode_header(head)
            alone.append((time.perf_counter_ns() - t0) / 100)
            os.preadv(fd, [batch.images[1]], 0)  # a part's bytes through the caches, as a load's
            t0 = time.perf_counter_ns()
            decode_header(head)
            after.append(time.perf_counter_ns() - t0)
    finally:
        os.close(fd)
    print("part 3: decode_header of a part's header, median")
    print(f"  alone (in cache)                         {statistics.median(alone) / 1e3:7.1f} us")
    print(f"  right after a part was read              {statistics.median(after) / 1e3:7.1f} us")


if __name__ == "__main__":
    sys.exit(main())
