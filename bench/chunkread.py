"""Chunk-order loads without an engine: many 64-token entries (Qwen3-8B shape: 36 layers, 9.4 MB
each) read and verified from a page-cache-warm store, the way the vLLM worker reads one load job.

    python bench/chunkread.py WORK [--entries 52] [--rounds 3]

For each combination of entry threads (1, 4, 8, 16: entries read side by side), frame pool (the
service's, every usable core; or none: each entry's frames in its own thread) and read size (512
KiB slices, or a whole 4 MiB frame per read: `codec._slice_bytes`), prints GB/s of payload (best
of the rounds), then one line `chunkread: best=... worker=...` (the worker's own configuration:
min(8, cores // 2) entry threads, each entry's frames in its thread, the read size chosen for
this machine, and `processes=`: the best of the same loads read by helper processes,
`galahad.reader_pool`, in a table of their own before that line).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from galahad import codec  # noqa: E402
from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.codec import cipher_lookup  # noqa: E402
from galahad.domain.chunking import Chunking, Span  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.fanout import usable_cores  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.service import KVCacheService, SegmentSpec  # noqa: E402

LAYERS, ROWS, PAGE = 36, 4, 16 * 8 * 256 * 2  # 4 blocks of 16 tokens; K and V of 8 heads x 128, bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("--entries", type=int, default=52)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = Path(args.work) / "chunkread-store"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    ns = Namespace(model="chunkread", model_fingerprint="chunkread", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, LAYERS),), payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    cores = usable_cores()
    store = FilesystemBlockStore(root, ns, rescan_s=None)
    svc = KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.CHUNK, 16), layout=RankLayout(),
                         cipher=check, ciphers=cipher_lookup(check), frame_threads=cores)
    keys = svc.keys(list(range(args.entries * 64 + 1)), svc.seed())
    segs = [SegmentSpec(0, i, 0, "bfloat16", (ROWS, 16, 8, 256)) for i in range(LAYERS)]
    payload = [os.urandom(ROWS * PAGE) for _ in range(LAYERS)]
    entries = []
    for i in range(args.entries):
        key = keys[svc.chunking.key_index(64 * (i + 1))]
        if not svc.has_part(key, 0):
            svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segs, payload)
        svc.commit(key)
        entries.append(key)
    nbytes = LAYERS * ROWS * PAGE
    outs = [memoryview(bytearray(nbytes)) for _ in range(16)]
    pool = svc._frames
    results = {}
    print(f"{args.entries} entries of {nbytes / 1e6:.1f} MB, {cores} usable cores", flush=True)
    print("| entry threads | frame pool | read size | GB/s |\n| ---: | --- | --- | ---: |", flush=True)
    for threads in (1, 4, 8, 16):
        for use_pool in (True, False):
            for slice_bytes in (512 << 10, 1 << 20, 2 << 20, 4 << 20):
                codec._slices[:] = [slice_bytes]
                svc._frames = pool if use_pool else None  # type: ignore[assignment]
                best = 0.0
                for _ in range(args.rounds):
                    with ThreadPoolExecutor(threads) as ex:
                        t0 = time.perf_counter()
                        got = list(ex.map(lambda i: svc.load_part(entries[i], 0, out=outs[i % threads]),
                                          range(len(entries))))
                        took = time.perf_counter() - t0
                    assert all(p is not None for p in got)
                    best = max(best, len(entries) * nbytes / took / 1e9)
                results[(threads, use_pool, slice_bytes)] = best
                print(f"| {threads} | {'on' if use_pool else 'off'} | {slice_bytes >> 10} KiB | {best:.2f} |", flush=True)
    svc._frames = pool  # type: ignore[assignment]
    codec._slices[:] = []
    procs = _processes(svc, entries, nbytes, args.rounds)
    # the worker without helpers: min(8, cores // 2) entries at once, frames in the entry's thread
    worker = results[(max(1, min(8, cores // 2)), False, codec._slice_bytes())]
    top = max(results, key=lambda k: results[k])
    print(f"chunkread: best={results[top]:.2f} (threads={top[0]} pool={'on' if top[1] else 'off'} "
          f"read={top[2] >> 10}KiB) worker={worker:.2f} processes={max(procs.values()):.2f}", flush=True)
    svc.close()


def _processes(svc: KVCacheService, entries: list, nbytes: int, rounds: int) -> dict[int, float]:
    """The same loads read by helper processes (`galahad.reader_pool`) into a shared region:
    one helper per entry thread, each thread a slot of the region."""
    import queue

    from galahad.reader_pool import HelperRecipe, ReaderPool, SharedRegion

    slot = 16 << 20
    results = {}
    print("| helper processes | GB/s |\n| ---: | ---: |", flush=True)
    for n in (4, 8, 16):
        region = SharedRegion(n * slot)
        svc.attach_readers(ReaderPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (None,)), n))
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(n):
            free.put(i * slot)

        def load(key: object) -> object:
            at = free.get()
            try:
                return svc.load_part(key, 0, out=region.view[at : at + nbytes], region_offset=at)
            finally:
                free.put(at)

        best = 0.0
        for _ in range(rounds):
            with ThreadPoolExecutor(n) as ex:
                t0 = time.perf_counter()
                got = list(ex.map(load, entries))
                took = time.perf_counter() - t0
            assert all(p is not None for p in got)
            best = max(best, len(entries) * nbytes / took / 1e9)
        results[n] = best
        print(f"| {n} | {best:.2f} |", flush=True)
        svc.attach_readers(None)
    return results


if __name__ == "__main__":
    main()
