"""How much Galahad's save threads slow the engine's thread (issue 8), on the CPU: the engine's
thread makes small torch calls (each lets go of the interpreter lock and takes it back, as
vLLM's engine thread does at every kernel launch) while N threads save Qwen3-8B-shaped 9.4 MB
parts through a real `KVCacheService` and `FilesystemBlockStore` (36 layers, 64 tokens a part,
plain). A measurement behind docs/performance.md ("Twelfth session") and GALAHAD_SAVE_THREADS,
not a test.

    python bench/convoy.py                         # 0, 1, 2, 4, 8, 16 save threads, store in /dev/shm
                                                   # (a few GB written a count, removed after it)
    python bench/convoy.py --threads 0,2,8 --dir /var/tmp --png convoy.png

It prints a table (seconds for the engine's calls, that against no saves, parts saved a second)
and one line `convoy-bench: slowdown_<N>=R ...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402

from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.codec import cipher_lookup  # noqa: E402
from galahad.domain.chunking import Chunking, Span  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.service import KVCacheService, SegmentSpec  # noqa: E402

BLOCK, LAYERS = 16, 36
SHAPE = (4, 2 * BLOCK, 8, 128)  # a 64-token part of one layer: 4 blocks, K and V, 8 heads of 128
CALLS = 20_000


def _engine() -> float:
    """The engine thread's stand-in: CALLS small torch calls, seconds."""
    t0 = time.perf_counter()
    for _ in range(CALLS):
        torch.empty(0, dtype=torch.bfloat16)
    return time.perf_counter() - t0


def _service(root: Path, threads: int) -> KVCacheService:
    ns = Namespace(model="convoy", model_fingerprint="convoy", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, LAYERS),),
                   payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    store = FilesystemBlockStore(root, ns, rescan_s=None, max_bytes=64 << 30)
    return KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.CHUNK, BLOCK),
                          layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check),
                          io_threads=max(1, threads))


def measure(folder: str, threads: int, rounds: int) -> tuple[float, float]:
    """(best engine seconds over `rounds`, parts saved a second meanwhile) with `threads` savers."""
    root = Path(tempfile.mkdtemp(prefix="galahad-convoy-", dir=folder)) / "store"
    root.mkdir(mode=0o700)
    svc = _service(root, threads)
    tokens = list(range(64 * 20_000 + 1))
    keys = svc.keys(tokens, svc.seed())
    segments = tuple(SegmentSpec(0, i, 0, "bfloat16", SHAPE) for i in range(LAYERS))
    payload = [bytes(4 * 2 * BLOCK * 8 * 128 * 2) for _ in range(LAYERS)]
    nxt, lock, stop = [0], threading.Lock(), threading.Event()

    def saver() -> None:
        while not stop.is_set():
            with lock:
                i = nxt[0]
                nxt[0] += 1
            svc.save_part(keys[i], Span(64 * i, 64 * (i + 1)), 0, segments, payload)

    workers = [threading.Thread(target=saver, daemon=True) for _ in range(threads)]
    try:
        for w in workers:
            w.start()
        time.sleep(0.5 if threads else 0)
        best, rates = float("inf"), []
        for _ in range(rounds):
            c0, t0 = nxt[0], time.perf_counter()
            best = min(best, _engine())
            rates.append((nxt[0] - c0) / (time.perf_counter() - t0))
        return best, max(rates) if threads else 0.0
    finally:
        stop.set()
        for w in workers:
            w.join()
        svc.close()
        shutil.rmtree(root.parent, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="0,1,2,4,8,16", help="save thread counts, comma-separated")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="parent of the temp store folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    args = ap.parse_args()
    counts = [int(x) for x in args.threads.split(",")]
    rows = []
    for n in counts:
        seconds, rate = measure(args.dir, n, args.rounds)
        rows.append((n, seconds, rate))
        print(f"  {n:2d} save threads: engine {seconds:.3f} s, {rate:.0f} parts/s", flush=True)
    base = next((s for n, s, _ in rows if n == 0), rows[0][1])
    print(f"\n| save threads | engine's {CALLS} torch calls, s | against no saves | parts saved / s |")
    print("| ---: | ---: | ---: | ---: |")
    for n, seconds, rate in rows:
        print(f"| {n} | {seconds:.3f} | {seconds / base:.1f} | {rate:.0f} |")
    print("convoy-bench: " + " ".join(f"slowdown_{n}={s / base:.1f}" for n, s, _ in rows))
    if args.png:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot import Panel, grouped_bars_figure

        labels = [str(n) for n, _s, _r in rows]
        grouped_bars_figure([
            Panel("engine thread, against no saves", labels, {"slowdown": [s / base for _n, s, _r in rows]},
                  ylabel="x"),
            Panel("parts saved a second", labels, {"parts/s": [r for _n, _s, r in rows]}, ylabel="parts/s"),
        ], args.png, columns=1, suptitle="save threads (bench/convoy.py)")
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
