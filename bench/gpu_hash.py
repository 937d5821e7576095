"""Checksum frames verified on the GPU: XXH3-128 of format v1's frames computed from a device
copy by the Triton kernels of `galahad.adapters.vllm.xxh3_gpu` (what `GALAHAD_DIRECT_LOADS=1`
uses), bit for bit what `xxhash` gives, and what a load verified so would deliver.

    TRITON_INTERPRET=1 python bench/gpu_hash.py check   # on a CPU: the kernels against xxhash
    TRITON_INTERPRET=1 python bench/gpu_hash.py check --quick   # fewer shapes (the unit test)
    python bench/gpu_hash.py check                      # the same on a GPU
    python bench/gpu_hash.py speed [--gb 4.8]           # on a GPU: GB/s of frames verified
    python bench/gpu_hash.py pipeline [--gb 4.8] [--dir D]   # the load paths it would give

Why (docs/performance.md, GPU, twenty-third and twenty-fourth sessions): inside vLLM a load makes
four passes over host memory (the page cache read, the pinned buffer written, the hash reading
it back, the copy to the GPU reading it again) where the medium makes two, and reaches 0.61-0.65
of the medium against the target's 0.8. Hashing the device copy instead takes the third pass
off the host. How the kernels work: `xxh3_gpu`'s docstring."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from galahad.adapters.vllm.xxh3_gpu import FrameHasher, frame_tags  # noqa: E402


def check(device: str, quick: bool) -> int:
    rng = random.Random(7)
    bad = 0
    # (frame size, payload length): whole frames, a short last frame, one frame of one block
    shapes = ((2048, 3 * 2048), (1 << 16, 3 << 15), (4 << 20, 4 << 20), (1024, 1024)) if quick else (
        (2048, 3 * 2048), (1 << 16, 4 << 16), (1 << 16, (3 << 16) + 5 * 1024), (4 << 20, 3 << 22),
        (4 << 20, (2 << 22) - 1024), (1024, 3072))
    for frame_len, payload_len in shapes:
        raw = os.urandom(payload_len)
        n = -(-payload_len // frame_len)
        seeds = [0] + [rng.getrandbits(64) for _ in range(n - 1)]
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
        got = frame_tags(payload, frame_len, seeds)
        want = [xxhash.xxh3_128_digest(raw[i * frame_len : (i + 1) * frame_len], seed=s) for i, s in enumerate(seeds)]
        # the same payload added in chunks out of order, one cut inside a frame
        h = FrameHasher(payload_len, frame_len, seeds, device)
        cut = payload_len // 2 // 1024 * 1024
        h.add(payload[cut:], cut)
        h.add(payload[:cut], 0)
        chunked = h.tags()
        ok = sum(g == w == c for g, w, c in zip(got, want, chunked))
        bad += n - ok
        print(f"gpu-hash check: {payload_len} bytes in frames of {frame_len}: {ok} of {n} tags equal xxhash's "
              "(whole and in two chunks)", flush=True)
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
    split = []  # the two kernels apart: every block's sums, then the frames' sequential loops
    for _ in range(3):
        h = FrameHasher(n * frame_len, frame_len, seeds, "cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h.add(frames, 0)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        h.tags()
        split.append((round((t1 - t0) * 1e3, 1), round((time.perf_counter() - t1) * 1e3, 1)))
    print(f"gpu-hash speed: block sums, then frame loops and tags back (ms): {split}")
    best = min(times)
    print(f"gpu-hash speed: {n} frames of 4 MiB ({n * frame_len / 1e9:.2f} GB): best {best * 1e3:.1f} ms, "
          f"{n * frame_len / best / 1e9:.1f} GB/s (rounds {[round(t * 1e3, 1) for t in times]} ms); tags "
          f"{'equal' if ok else 'DIFFER from'} xxhash's")
    return 0 if ok else 1


def _register(addr: int, nbytes: int) -> str | None:
    """cudaHostRegister of host memory torch did not allocate, read-only first (a file mapped
    PROT_READ); None, or why CUDA refused."""
    rt = torch.cuda.cudart()
    why = []
    for flags in (0x08, 0):  # cudaHostRegisterReadOnly, then the default
        err = rt.cudaHostRegister(addr, nbytes, flags)
        if int(err) == 0:
            return None
        why.append(f"flags {flags}: {rt.cudaGetErrorString(err)}")
        _clear_error()
    return "; ".join(why)


def _clear_error() -> None:
    import ctypes

    with open("/proc/self/maps") as maps:
        for path in {line.split()[-1] for line in maps if "libcudart.so" in line}:
            ctypes.CDLL(path).cudaGetLastError()


def pipeline(gb: float, folder: str | None) -> int:
    """What a load verified on the GPU would deliver, against the medium, on one file of `gb` GB
    in the page cache: (1) the medium, 16 threads of 4 MiB `preadv` into pinned memory; (2) the
    same reads with each 64 MiB chunk copied to the GPU as soon as it is read; (3) (2) with
    each chunk's frames hashed on the GPU after its copy, one wait for every tag at the end;
    (4) no read at all: the file mapped and its page cache pages registered with CUDA, the GPU
    copying straight from them (one pass over host memory), registered before and (5) with the
    registration timed inside; (6) (4) with the check. The issue's bar is 0.8 of (1). The
    direct load path (`galahad.adapters.vllm.direct`) is (3): registering costs as much as the
    copy (twenty-fourth session)."""
    import concurrent.futures as cf
    import mmap
    import tempfile
    import warnings

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
        pools = {t: cf.ThreadPoolExecutor(t) for t in (8, 16)}
        device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        per = chunk // frame_len
        seeds = [random.getrandbits(64) for _ in range(per)] * (nbytes // chunk)
        want = [xxhash.xxh3_128_digest(block[i * frame_len : (i + 1) * frame_len], seed=s)
                for i, s in enumerate(seeds[:per])] * (nbytes // chunk)
        stream = torch.cuda.Stream() if dev == "cuda" else None
        hash_stream = torch.cuda.Stream() if dev == "cuda" else None
        on_stream = (lambda: torch.cuda.stream(stream)) if stream is not None else contextlib.nullcontext

        def read(at: int) -> None:
            os.preadv(fd, [view[at : at + frame_len]], at)

        def run(copy: bool, check: bool, threads: int = 16) -> bool:  # noqa: C901
            hasher = FrameHasher(nbytes, frame_len, seeds, dev) if check else None
            reads = [pools[threads].submit(read, at) for at in range(0, nbytes, frame_len)]  # in file order
            for k in range(nbytes // chunk):
                for f in reads[k * per : (k + 1) * per]:
                    f.result()
                if not copy:
                    continue
                at = k * chunk
                with on_stream():
                    device[at : at + chunk].copy_(host[at : at + chunk], non_blocking=stream is not None)
                if hasher is not None:  # on a stream of its own: the copies go on meanwhile
                    if stream is not None:
                        landed = torch.cuda.Event()
                        landed.record(stream)
                        hash_stream.wait_event(landed)
                    with torch.cuda.stream(hash_stream) if hash_stream is not None else contextlib.nullcontext():
                        hasher.add(device[at : at + chunk], at)
            if stream is not None:
                stream.synchronize()
            if hasher is None:
                return True
            with torch.cuda.stream(hash_stream) if hash_stream is not None else contextlib.nullcontext():
                return hasher.tags() == want

        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: torch warns, nothing writes it
            arr = np.frombuffer(mapped, dtype=np.uint8)
            file_t = torch.from_numpy(arr)
        addr = arr.ctypes.data
        reg_ms: list[float] = []

        def direct(check: bool, register: bool) -> bool:
            """The GPU reading the page cache itself: no host copy."""
            hasher = FrameHasher(nbytes, frame_len, seeds, dev) if check else None
            if register:
                t0 = time.perf_counter()
                why = _register(addr, nbytes)
                reg_ms.append((time.perf_counter() - t0) * 1e3)
                if why:
                    raise RuntimeError(why)
            with on_stream():
                for k in range(nbytes // chunk):
                    at = k * chunk
                    device[at : at + chunk].copy_(file_t[at : at + chunk], non_blocking=True)
                    if hasher is not None:
                        hasher.add(device[at : at + chunk], at)
            if stream is not None:
                stream.synchronize()
            if register:
                torch.cuda.cudart().cudaHostUnregister(addr)
            return hasher is None or hasher.tags() == want

        run(True, True)  # warm: page cache, compile
        cases = [("medium", lambda: run(False, False)), ("medium, 8 threads", lambda: run(False, False, 8)),
                 ("read+copy", lambda: run(True, False)), ("read+copy+gpu check", lambda: run(True, True))]
        why = _register(addr, nbytes) if dev == "cuda" else "no GPU"
        if why is None:
            cases += [("registered: dma", lambda: direct(False, False)),
                      ("registered: dma+gpu check", lambda: direct(True, False))]
        rows = {}

        def measure(name: str, fn) -> None:
            best, ok = 0.0, True
            for _ in range(3):
                t0 = time.perf_counter()
                ok &= fn()
                best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            rows[name] = best
            print(f"gpu-hash pipeline: {name:<40} {best:6.1f} GB/s{'' if ok else '  TAGS DIFFER'}", flush=True)

        for name, fn in cases:
            measure(name, fn)
        if why is None:
            torch.cuda.cudart().cudaHostUnregister(addr)
            measure("register+dma+unregister", lambda: direct(False, True))
            print(f"gpu-hash pipeline: cudaHostRegister of {nbytes / 1e9:.2f} GB at once took "
                  f"{[round(t, 1) for t in reg_ms]} ms", flush=True)
        else:
            print(f"gpu-hash pipeline: CUDA does not register the mapped file: {why}", flush=True)
        del file_t, arr
        mapped.close()
        print(f"gpu-hash pipeline: {nbytes / 1e9:.2f} GB, against the medium: "
              + ", ".join(f"{k} {v / rows['medium']:.2f}" for k, v in rows.items() if k != "medium")
              + " (the bar: 0.8)")
        for pool in pools.values():
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
