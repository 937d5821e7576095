"""How much the kernel's page-cache copy slows down when the file offset and the destination
address disagree modulo a cache line (64 bytes), and what that costs a v1 block file, whose
frames sit at `header_len + i * (frame_size + 16)`. A measurement behind docs/performance.md
("Why load_vs_raw stops near 0.7"), not a test.

    python bench/align.py            # about 30 s

Part 1 reads 32 MiB of a page-cache-warm file with `os.preadv` into a page-aligned buffer, in
4 MiB calls, starting at file offsets whose distance from the buffer's alignment is 0, 8, 16, 48,
64 or 2048 bytes modulo 64. Part 2 reads 31.5 MiB parts (Qwen3-8B-shaped, 36 segments, header
2192 bytes) the way `codec.open_part_from` does (each 4 MiB frame straight into its place, 512 KiB
at a time, each slice hashed with XXH3-128 while it is in cache), once laid out as format v1 lays
it out and once with the header and every tag padded to 64 bytes (a layout v1 does not have),
against one plain `preadv` of the whole file. Rounds alternate the cases; figures are medians.
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import tempfile
import time

import xxhash

MiB = 1 << 20
FRAME = 4 * MiB
PART = 224 * 36 * 4096  # 31.5 MiB of KV payload
ROUNDS = 25


def _buffer(n: int) -> memoryview:
    view = memoryview(mmap.mmap(-1, n))
    view[:] = b"\x01" * n  # faulted in
    return view


def part1(folder: str) -> None:
    path = os.path.join(folder, "flat")
    with open(path, "wb") as handle:
        handle.write(os.urandom(32 * MiB + 4096))
    dst = _buffer(32 * MiB)
    fd = os.open(path, os.O_RDONLY)
    skews = (0, 8, 16, 48, 64, 2048)
    times: dict[int, list[float]] = {s: [] for s in skews}
    try:
        for _ in range(ROUNDS * 4):
            for skew in skews:
                t0 = time.perf_counter()
                for k in range(8):
                    os.preadv(fd, [dst[k * FRAME : (k + 1) * FRAME]], skew + k * FRAME)
                times[skew].append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    print("part 1: preadv of a page-cache-warm file into an aligned buffer, 8 x 4 MiB, median GB/s")
    for skew, ts in times.items():
        print(f"  file offset = {skew:4d} (mod 64 = {skew % 64:2d}): {32 * MiB / statistics.median(ts) / 1e9:6.2f}")


def part2(folder: str) -> None:
    frames = -(-PART // FRAME)
    layouts = {"format v1 (header 2192, 16-byte tags)": (2192, 16), "padded (header 2240, 64-byte tag slots)": (2240, 64)}
    blob = os.urandom(2240 + PART + 64 * frames)
    paths = {}
    for name, (header, slot) in layouts.items():
        paths[name] = os.path.join(folder, f"part-{slot}")
        with open(paths[name], "wb") as handle:
            handle.write(blob[: header + PART + slot * frames])
    image, dst = _buffer(len(blob)), _buffer(PART)

    def raw() -> None:
        fd = os.open(paths[next(iter(paths))], os.O_RDONLY)
        os.preadv(fd, [image[: 2192 + PART + 16 * frames]], 0)
        os.close(fd)

    def framed(name: str) -> None:
        header, slot = layouts[name]
        fd, tag = os.open(paths[name], os.O_RDONLY), bytearray(slot)
        for i in range(frames):
            plain, at = i * FRAME, header + i * (FRAME + slot)
            length = min(FRAME, PART - plain)
            state = xxhash.xxh3_128()
            for a in range(0, length, 512 << 10):
                b = min(length, a + (512 << 10))
                os.preadv(fd, [dst[plain + a : plain + b]] + ([tag] if b == length else []), at + a)
                state.update(dst[plain + a : plain + b])
            state.digest()
        os.close(fd)

    cases = {"one preadv of the whole file (no check)": raw, **{n: (lambda n=n: framed(n)) for n in layouts}}
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(ROUNDS):
        for case, run in cases.items():
            t0 = time.perf_counter()
            run()
            times[case].append(time.perf_counter() - t0)
    base = times[next(iter(cases))]
    print("part 2: one 31.5 MiB part, one thread, median GB/s of payload and median same-round ratio to the plain read")
    for case, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(f"  {case:<42} {PART / statistics.median(ts) / 1e9:6.2f}  ratio {ratio:.2f}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="galahad-align-") as folder:
        part1(folder)
        part2(folder)
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
