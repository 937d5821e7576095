"""Checksum frames verified on the GPU: XXH3-128 of format v1's 4 MiB frames, computed from a
device copy by two Triton kernels, bit for bit what `xxhash` gives. A measurement for issue 8
(the load bandwidth target), not product code: nothing in `src/` uses it.

    TRITON_INTERPRET=1 python bench/gpu_hash.py check   # on a CPU: the kernels against xxhash
    TRITON_INTERPRET=1 python bench/gpu_hash.py check --quick   # fewer frames (the unit test)
    python bench/gpu_hash.py check                      # the same on a GPU
    python bench/gpu_hash.py speed [--gb 4.8]           # on a GPU: GB/s of frames verified
    python bench/gpu_hash.py pipeline [--gb 4.8] [--dir D]   # the load path it would give

Why (docs/performance.md, GPU, "Twenty-third session"): inside vLLM a load makes four passes
over host memory (the page cache read, the pinned buffer written, the hash reading it back, the
copy to the GPU reading it again) where the medium makes two, and reaches 0.61-0.65 of the
medium against the target's 0.8. Hashing the device copy instead takes the third pass off the
host: the H200 reads its memory at several TB/s.

How: XXH3's long-input loop (xxhash.h, `XXH3_hashLong_internal_loop`) only adds to its eight
accumulators within a 1 KiB block (16 stripes of 64 bytes); a block's additions do not depend on
the accumulators, so `_block_sums` computes every block's at once, in parallel over the whole
buffer. Between blocks the accumulators are scrambled, which is not associative: `_frame_accs`
runs that short loop (4,095 steps for a 4 MiB frame) once per frame, every frame at once, then
the last partial block and the last stripe. The host merges the eight accumulators into the
tag (`XXH3_finalizeLong_128b`, a few multiplications a frame). A seed (format v1's per-frame
hash seed) changes the secret (`XXH3_initCustomSecret`): even secret words + seed, odd - seed.
`python bench/gpu_hash.py check` compares every stage with `xxhash` on random frames.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl
import xxhash

M64 = (1 << 64) - 1
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5, MX1 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5, 0x165667919E3779F9
INIT_ACC = (P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1)
KSECRET = bytes.fromhex(  # XXH3_kSecret, xxhash.h
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
BLOCK = 1024  # bytes a block: 16 stripes of 64 (the default secret's 192 bytes)
BLOCKS_A_PROGRAM = 16


def _signed(u: int) -> int:
    """An unsigned 64-bit value as the int64 torch stores (same bits)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def secret(seed: int) -> bytes:
    """`XXH3_initCustomSecret`: the default secret, its even words + seed and odd words - seed."""
    if seed == 0:
        return KSECRET
    w = np.frombuffer(KSECRET, dtype="<u8").copy()
    w[0::2] += np.uint64(seed)
    w[1::2] -= np.uint64(seed)
    return w.tobytes()


@triton.jit
def _block_sums(data, kwords, seeds, sums, blocks_per_frame, n_blocks, BPP: tl.constexpr):
    """Per 1 KiB block b: sums[b, lane] = what its 16 stripes add to accumulator `lane`
    (`XXH3_scalarRound`): lo32 * hi32 of (data ^ key) in that lane, plus the data words of the
    lane beside it (`lane ^ 1`)."""
    # the tensors are int64 (every torch has it); the arithmetic is on the same bits as uint64
    data = data.to(tl.pointer_type(tl.uint64), bitcast=True)
    kwords = kwords.to(tl.pointer_type(tl.uint64), bitcast=True)
    seeds = seeds.to(tl.pointer_type(tl.uint64), bitcast=True)
    sums = sums.to(tl.pointer_type(tl.uint64), bitcast=True)
    pid = tl.program_id(0)
    b = (pid * BPP + tl.arange(0, BPP)).to(tl.int64)  # blocks of this program
    s = tl.arange(0, 16)  # stripe in the block
    lane = tl.arange(0, 8)
    ok = b < n_blocks
    words = b[:, None, None] * 128 + s[None, :, None] * 8 + lane[None, None, :]
    d = tl.load(data + words, mask=ok[:, None, None], other=0)
    seed = tl.load(seeds + b // blocks_per_frame, mask=ok, other=0)
    k_index = s[:, None] + lane[None, :]  # stripe s reads secret words s..s+7
    k = tl.load(kwords + k_index)
    even = (k_index % 2) == 0
    key = tl.where(even[None, :, :], k[None, :, :] + seed[:, None, None], k[None, :, :] - seed[:, None, None])
    dk = d ^ key
    prod = (dk & 0xFFFFFFFF) * (dk >> 32)
    beside = tl.reshape(tl.flip(tl.reshape(tl.sum(d, axis=1), (BPP, 4, 2)), 2), (BPP, 8))  # lane ^ 1
    out = b[:, None] * 8 + lane[None, :]
    tl.store(sums + out, tl.sum(prod, axis=1) + beside, mask=ok[:, None])


@triton.jit
def _frame_accs(data, kwords, seeds, last_keys, sums, accs, frame_words, full_blocks, tail_stripes):
    """One frame's accumulators: its full blocks' sums added and scrambled in order, then the
    stripes of its last partial block and its last stripe (`XXH3_hashLong_internal_loop`)."""
    data = data.to(tl.pointer_type(tl.uint64), bitcast=True)
    kwords = kwords.to(tl.pointer_type(tl.uint64), bitcast=True)
    seeds = seeds.to(tl.pointer_type(tl.uint64), bitcast=True)
    last_keys = last_keys.to(tl.pointer_type(tl.uint64), bitcast=True)
    sums = sums.to(tl.pointer_type(tl.uint64), bitcast=True)
    accs = accs.to(tl.pointer_type(tl.uint64), bitcast=True)
    f = tl.program_id(0)
    lane = tl.arange(0, 8)
    swap = lane ^ 1
    seed = tl.load(seeds + f)
    even = (lane % 2) == 0
    scr = tl.load(kwords + 16 + lane)  # the scramble key: secret bytes 128..191
    scr = tl.where(even, scr + seed, scr - seed)
    acc = tl.load(accs + f * 8 + lane)  # the initial accumulators, set by the host
    first = f.to(tl.int64) * (full_blocks + 1)  # this frame's first block in `sums`
    for i in range(full_blocks):
        a = acc + tl.load(sums + (first + i) * 8 + lane)
        a = a ^ (a >> 47)
        a = a ^ scr
        acc = a * 0x9E3779B1
    base = f.to(tl.int64) * frame_words + full_blocks * 128
    for j in range(tail_stripes):
        d = tl.load(data + base + j * 8 + lane)
        dsw = tl.load(data + base + j * 8 + swap)
        k = tl.load(kwords + j + lane)
        k = tl.where(((j + lane) % 2) == 0, k + seed, k - seed)
        dk = d ^ k
        acc = acc + dsw + (dk & 0xFFFFFFFF) * (dk >> 32)
    end = f.to(tl.int64) * frame_words + frame_words - 8  # the last stripe: the frame's last 64 bytes
    d = tl.load(data + end + lane)
    dsw = tl.load(data + end + swap)
    dk = d ^ tl.load(last_keys + f * 8 + lane)
    acc = acc + dsw + (dk & 0xFFFFFFFF) * (dk >> 32)
    tl.store(accs + f * 8 + lane, acc)


def _le64(b: bytes, at: int) -> int:
    return int.from_bytes(b[at : at + 8], "little")


def _merge(acc: list[int], sec: bytes, n: int) -> bytes:
    """`XXH3_finalizeLong_128b`, then the canonical (big-endian) digest `xxhash` returns."""

    def one(at: int, start: int) -> int:
        r = start & M64
        for i in range(4):
            p = (acc[2 * i] ^ _le64(sec, at + 16 * i)) * (acc[2 * i + 1] ^ _le64(sec, at + 16 * i + 8))
            r = (r + ((p & M64) ^ (p >> 64))) & M64
        r ^= r >> 37
        r = (r * MX1) & M64
        return r ^ (r >> 32)

    lo, hi = one(11, n * P64_1), one(192 - 64 - 11, ~(n * P64_2))
    return hi.to_bytes(8, "big") + lo.to_bytes(8, "big")


def frame_tags(frames: torch.Tensor, frame_len: int, seeds: list[int]) -> list[bytes]:
    """XXH3-128 (`xxhash.xxh3_128_digest(frame, seed=s)`) of each `frame_len`-byte frame of
    `frames` (uint8, contiguous, len(seeds) frames; `frame_len` a multiple of 1 KiB above 1 KiB)."""
    if frame_len % BLOCK or frame_len <= BLOCK or frames.numel() != frame_len * len(seeds):
        raise ValueError("frames of a multiple of 1 KiB (above 1 KiB), one seed each")
    n_frames, dev = len(seeds), frames.device
    data = frames.view(torch.int64)
    full = (frame_len - 1) // BLOCK  # XXH3's full blocks (the last 1 KiB is its partial block)
    tail = ((frame_len - 1) - full * BLOCK) // 64
    kwords = torch.tensor([_signed(_le64(KSECRET, 8 * i)) for i in range(24)], dtype=torch.int64, device=dev)
    seed_t = torch.tensor([_signed(s) for s in seeds], dtype=torch.int64, device=dev)
    secrets = [secret(s) for s in seeds]
    last = torch.tensor([[_signed(_le64(sec, 192 - 64 - 7 + 8 * i)) for i in range(8)] for sec in secrets],
                        dtype=torch.int64, device=dev)
    accs = torch.tensor([[_signed(a) for a in INIT_ACC]] * n_frames, dtype=torch.int64, device=dev)
    blocks = n_frames * (frame_len // BLOCK)
    sums = torch.empty((blocks, 8), dtype=torch.int64, device=dev)  # 64 bytes a KiB of frames
    _block_sums[(triton.cdiv(blocks, BLOCKS_A_PROGRAM),)](
        data, kwords, seed_t, sums, frame_len // BLOCK, blocks, BPP=BLOCKS_A_PROGRAM)
    _frame_accs[(n_frames,)](data, kwords, seed_t, last, sums, accs, frame_len // 8, full, tail)
    out = accs.cpu().tolist()
    return [_merge([a & M64 for a in acc], sec, frame_len) for acc, sec in zip(out, secrets)]


def check(device: str, quick: bool) -> int:
    rng = random.Random(7)
    bad = 0
    shapes = ((2048, 3), (1 << 16, 2), (4 << 20, 1)) if quick else ((2048, 3), (1 << 16, 4), (4 << 20, 3), ((4 << 20) - 1024, 2))
    for frame_len, n in shapes:
        raw = os.urandom(frame_len * n)
        seeds = [0] + [rng.getrandbits(64) for _ in range(n - 1)]
        frames = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
        got = frame_tags(frames, frame_len, seeds)
        want = [xxhash.xxh3_128_digest(raw[i * frame_len : (i + 1) * frame_len], seed=s) for i, s in enumerate(seeds)]
        ok = sum(g == w for g, w in zip(got, want))
        bad += n - ok
        print(f"gpu-hash check: {n} frames of {frame_len} bytes: {ok} of {n} tags equal xxhash's", flush=True)
    print(f"gpu-hash check: {'ok' if not bad else f'{bad} WRONG'}")
    return 1 if bad else 0


def speed(gb: float) -> int:
    frame_len = 4 << 20
    n = max(1, int(gb * 1e9) // frame_len)
    frames = torch.randint(0, 256, (n * frame_len,), dtype=torch.uint8, device="cuda")
    seeds = [random.getrandbits(64) for _ in range(n)]
    frame_tags(frames[: 4 * frame_len], frame_len, seeds[:4])  # compile
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        frame_tags(frames, frame_len, seeds)
        times.append(time.perf_counter() - t0)
    sample = frames[: 2 * frame_len].cpu().numpy().tobytes()
    ok = frame_tags(frames[: 2 * frame_len], frame_len, seeds[:2]) == [
        xxhash.xxh3_128_digest(sample[i * frame_len : (i + 1) * frame_len], seed=seeds[i]) for i in range(2)]
    best = min(times)
    print(f"gpu-hash speed: {n} frames of 4 MiB ({n * frame_len / 1e9:.2f} GB): best {best * 1e3:.1f} ms, "
          f"{n * frame_len / best / 1e9:.1f} GB/s (rounds {[round(t * 1e3, 1) for t in times]} ms); tags "
          f"{'equal' if ok else 'DIFFER from'} xxhash's")
    return 0 if ok else 1


def pipeline(gb: float, folder: str | None) -> int:
    """What a load verified on the GPU would deliver, against the medium, on one file of `gb` GB
    in the page cache: (1) the medium, 16 threads of 4 MiB `preadv` into pinned memory; (2) the
    same reads with each 64 MiB chunk copied to the GPU as soon as it is read; (3) (2) with
    each chunk's frames hashed on the GPU after its copy, the tags brought back and compared.
    The issue's bar is 0.8 of (1); (2) is the ceiling of any check."""
    import concurrent.futures as cf
    import tempfile

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    frame_len, chunk = 4 << 20, 64 << 20
    nbytes = max(chunk, int(gb * 1e9) // chunk * chunk)
    fd, path = tempfile.mkstemp(dir=folder, prefix="gpu-hash-")
    try:
        block = os.urandom(chunk)
        for _ in range(nbytes // chunk):
            os.write(fd, block)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev == "cuda")
        view = memoryview(host.numpy()).cast("B")
        pool = cf.ThreadPoolExecutor(16)
        device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        seeds = [random.getrandbits(64) for _ in range(chunk // frame_len)]
        want = [xxhash.xxh3_128_digest(block[i * frame_len : (i + 1) * frame_len], seed=s) for i, s in enumerate(seeds)]
        stream = torch.cuda.Stream() if dev == "cuda" else None

        def read(at: int) -> None:
            os.preadv(fd, [view[at : at + frame_len]], at)

        def run(copy: bool, check: bool) -> bool:
            ok = True
            reads = [pool.submit(read, at) for at in range(0, nbytes, frame_len)]  # in file order
            per = chunk // frame_len
            for k in range(nbytes // chunk):
                for f in reads[k * per : (k + 1) * per]:
                    f.result()
                if not copy:
                    continue
                at = k * chunk
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    device[at : at + chunk].copy_(host[at : at + chunk], non_blocking=stream is not None)
                    if check:
                        ok &= frame_tags(device[at : at + chunk], frame_len, seeds) == want
            if stream is not None:
                stream.synchronize()
            return ok

        run(True, True)  # warm: page cache, compile
        rows = {}
        for name, copy, check in (("medium", False, False), ("read+copy", True, False), ("read+copy+gpu check", True, True)):
            best, ok = 0.0, True
            for _ in range(3):
                t0 = time.perf_counter()
                ok &= run(copy, check)
                best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            rows[name] = best
            print(f"gpu-hash pipeline: {name:<22} {best:6.1f} GB/s{'' if ok else '  TAGS DIFFER'}", flush=True)
        print(f"gpu-hash pipeline: {nbytes / 1e9:.2f} GB, against the medium: read+copy "
              f"{rows['read+copy'] / rows['medium']:.2f}, with the GPU check {rows['read+copy+gpu check'] / rows['medium']:.2f}"
              " (the bar: 0.8)")
        pool.shutdown()
        return 0
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("check", "speed", "pipeline"))
    ap.add_argument("--dir", default=None, help="pipeline: the folder of its file (default: the temp folder)")
    ap.add_argument("--gb", type=float, default=4.8)
    ap.add_argument("--quick", action="store_true", help="check: fewer frames")
    args = ap.parse_args()
    if args.what == "check":
        return check("cuda" if torch.cuda.is_available() else "cpu", args.quick)
    if args.what == "pipeline":
        return pipeline(args.gb, args.dir)
    return speed(args.gb)


if __name__ == "__main__":
    sys.exit(main())
