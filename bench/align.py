"""How much the kernel's page-cache copy slows down when the file offset and the destination
address disagree modulo a cache line (64 bytes), and what the two layouts of format v1 get from
it: v1.0's flat layout (frame i at `header_len + i * (frame_size + 16)`) and v1.1's aligned one
(the payload in one piece at a multiple of 4096, the tags in a table after it). A measurement
behind docs/performance.md ("Why the layout changed"), not a test.

    python bench/align.py            # about 40 s

Part 1 reads 32 MiB of a page-cache-warm file with `os.preadv` into a page-aligned buffer, in
4 MiB calls, starting at file offsets whose distance from the buffer's alignment is 0, 8, 16, 48,
64 or 2048 bytes modulo 64. Part 2 writes one 31.5 MiB part (Qwen3-8B-shaped, 36 segments) in
each layout with `codec.seal_part` and loads it with `codec.open_part_from` through the
filesystem store's reader (`FileReader`: each frame read straight into its place, 512 KiB at a
time, each slice hashed with XXH3-128 while it is in cache, one thread), against one plain
`preadv` of the whole file, timed by the wall clock and by the thread's CPU time (the kernel's
copy included; other processes taking the core inflate the first, not the second). Part 3 reads the aligned part's payload with O_DIRECT (the page cache
bypassed: the disk) through `Medium.readv` into a page-aligned buffer, which now lands straight
in it, against the same read through the staging buffer (what every O_DIRECT read did before,
and what a flat part still needs). Rounds alternate the cases; figures are medians.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import attrs

from galahad.adapters.fs.medium import Medium
from galahad.adapters.fs.reader import FileReader
from galahad.codec import Expect, cipher_lookup, open_part_from, seal_part
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader, DType, Segment, SegmentKind

MiB = 1 << 20
FRAME = 4 * MiB
TOKENS = 224  # 31.5 MiB of KV payload
ROUNDS = 25


def _buffer(n: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, n))
    view[:] = b"\x01" * n  # faulted in
    return view


def _medians(cases: dict[str, Callable[[], None]], rounds: int, clock: Callable[[], float] = time.perf_counter
             ) -> dict[str, list[float]]:
    """Each case's times over `rounds` interleaved rounds, by `clock` (wall time, or this thread's
    CPU time, which another process taking the core does not inflate)."""
    for run in cases.values():
        run()  # warm-up: page cache, page faults
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(rounds):
        for case, run in cases.items():
            t0 = clock()
            run()
            times[case].append(clock() - t0)
    return times


def part1(folder: str) -> None:
    path = os.path.join(folder, "flat")
    with open(path, "wb") as handle:
        handle.write(os.urandom(32 * MiB + 4096))
    dst = _buffer(32 * MiB)
    fd = os.open(path, os.O_RDONLY)
    skews = (0, 8, 16, 48, 64, 2048)

    def read(skew: int) -> Callable[[], None]:
        return lambda: [os.preadv(fd, [dst[k * FRAME : (k + 1) * FRAME]], skew + k * FRAME) for k in range(8)] and None

    try:
        times = _medians({f"{s}": read(s) for s in skews}, ROUNDS * 4)
    finally:
        os.close(fd)
    print("part 1: preadv of a page-cache-warm file into an aligned buffer, 8 x 4 MiB, median GB/s")
    for skew in skews:
        print(f"  file offset = {skew:4d} (mod 64 = {skew % 64:2d}): {32 * MiB / statistics.median(times[str(skew)]) / 1e9:6.2f}")


def _parts(folder: str) -> tuple[dict[str, str], int, int]:
    """The same 31.5 MiB payload written as an aligned (v1.1) and a flat (v1.0) part file."""
    segments = [Segment(0, SegmentKind.KV, DType.BF16, layer, (2, TOKENS, 8, 128)) for layer in range(36)]
    aligned = BlockHeader(namespace=b"n" * 32, chain_key=b"k" * 32, token_start=0, token_end=TOKENS, rank=0,
                          world=1, block_size=16, segments=segments)  # fmt: skip
    payload = [os.urandom(s.nbytes) for s in segments]
    paths = {}
    for name, h in (("aligned", aligned), ("flat", attrs.evolve(aligned, minor=0, incompat_flags=0))):
        paths[name] = os.path.join(folder, f"part-{name}")
        with open(paths[name], "wb") as handle:
            for chunk in seal_part(h, payload, Xxh3FrameCheck()):
                handle.write(chunk)
    return paths, aligned.payload_len, aligned.header_len


def part2(folder: str, paths: dict[str, str], payload_len: int) -> None:
    medium = Medium(cf.ThreadPoolExecutor(1), direct=False)
    image, dst = _buffer(os.path.getsize(paths["flat"]) + 4096), _buffer(payload_len)
    lookup = cipher_lookup(Xxh3FrameCheck())

    def raw() -> None:
        fd = os.open(paths["aligned"], os.O_RDONLY)
        os.preadv(fd, [image[: os.path.getsize(paths["aligned"])]], 0)
        os.close(fd)

    def load(name: str) -> Callable[[], None]:
        def run() -> None:
            fd, size, direct = medium.open_part(paths[name], time.time_ns()) or (-1, 0, False)
            with FileReader(medium, paths[name], fd, size, direct, on_close=lambda: None) as reader:
                open_part_from(reader, expect=Expect(), ciphers=lookup, out=dst)

        return run

    cases = {"one preadv of the whole file (no check)": raw,
             "open_part_from, flat layout (v1.0)": load("flat"),
             "open_part_from, aligned layout (v1.1)": load("aligned")}  # fmt: skip
    for clock, what in ((time.perf_counter, "wall time"), (time.thread_time, "CPU time of the thread")):
        times = _medians(cases, ROUNDS, clock)
        base = times[next(iter(cases))]
        print(f"part 2: one 31.5 MiB part, one thread, page cache warm; by {what}: median GB/s of payload and"
              " median same-round ratio to the plain read")  # fmt: skip
        for case, ts in times.items():
            ratio = statistics.median(b / t for b, t in zip(base, ts))
            print(f"  {case:<42} {payload_len / statistics.median(ts) / 1e9:6.2f}  ratio {ratio:.2f}")


def part3(paths: dict[str, str], payload_len: int, header_len: int) -> None:
    medium = Medium(cf.ThreadPoolExecutor(1), direct=True)
    dst = _buffer(payload_len + 4096)

    def read(view: memoryview) -> Callable[[], None]:
        def run() -> None:
            fd, _, direct = medium.open_part(paths["aligned"], time.time_ns()) or (-1, 0, False)
            try:
                medium.readv(fd, direct, header_len, [view])
            finally:
                os.close(fd)

        return run

    if not medium.direct:
        print("part 3: skipped (no O_DIRECT here)")
        return
    cases = {"O_DIRECT, straight into the page-aligned buffer": read(dst[:payload_len]),
             "O_DIRECT, through the staging buffer (64 B off)": read(dst[64 : 64 + payload_len])}  # fmt: skip
    times = _medians(cases, ROUNDS // 5)
    print("part 3: the aligned part's payload read with O_DIRECT (the disk, not the page cache), median GB/s")
    for case, ts in times.items():
        print(f"  {case:<50} {payload_len / statistics.median(ts) / 1e9:6.2f}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="galahad-align-", dir=sys.argv[1] if len(sys.argv) > 1 else None) as folder:
        part1(folder)
        paths, payload_len, header_len = _parts(folder)
        part2(folder, paths, payload_len)
        part3(paths, payload_len, header_len)
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
