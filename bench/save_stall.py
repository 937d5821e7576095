"""Save stall benchmark: how long do Galahad's saves hold the engine's thread? Not a test.

    python bench/save_stall.py [--tokens 2048] [--saves 4] [--plain] [--writers N] [--out DIR]

An engine's thread runs Python between calls that release the interpreter lock (a CUDA
synchronisation, a step's wait). Galahad seals and writes on its own threads in the same process,
so any piece of that work that holds the lock delays the engine's next step. Here a thread stands
for the engine: a loop of a little Python work and a 0.5 ms wait that releases the lock. It runs
alone (idle), then while the service saves `--saves` new parts of `--tokens` tokens of a
Qwen3-8B-shaped model (144 KiB a token: 2048 tokens are 302 MB) into a sealed store in a temporary
folder (`--plain`: checksummed), one after another, as a server saves new prompts. With `--writers N`
the payload lies in a shared region and N writer processes seal and write it, as on a GPU worker
with 8 or more usable cores (the default is what such a worker on this host starts: none below 8
cores). The figures are the loop's times: median, 99th percentile and longest, idle and while
saving.

The last line is `save-stall-bench: loop_p99_vs_idle=A longest_ms=B saved_gbps=C`: A is the 99th
percentile of a loop while saving over that idle (1.00: saving never holds the engine), B the
longest loop while saving in ms (the worst a step waits), C what the saves wrote, GB/s. Outputs
go to `--out DIR` (default bench/out/save-stall-<YYYYmmdd-HHMMSS>/save-stall.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from galahad.adapters.crypto.aesgcm import AesGcmCiphers
from galahad.adapters.crypto.key import Keyring
from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.adapters.helpers.pool import HelperPool, HelperRecipe, SharedRegion
from galahad.adapters.posix.memory import kernel_zeroed
from galahad.app.service import KVCacheService, SegmentSpec
from galahad.bootstrap import writer_processes_for
from galahad.domain.chunking import Chunking, Span
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.codec import cipher_lookup
from galahad.format.fanout import usable_cores

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import run_folder  # noqa: E402

LAYERS, TOKEN_LAYER_BYTES = 36, 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16: 144 KiB a token in all


def _engine(stop: threading.Event, times: list[float]) -> None:
    """The engine's thread: a little Python work, then a wait that releases the lock."""
    while not stop.is_set():
        t = time.perf_counter()
        total = 0
        for i in range(2000):
            total += i
        time.sleep(0.0005)
        times.append(time.perf_counter() - t)


def _figures(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"loops": len(times), "p50_ms": round(statistics.median(times) * 1e3, 3),
            "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 3), "max_ms": round(ordered[-1] * 1e3, 2)}


def run(args: argparse.Namespace, folder: Path) -> dict[str, object]:
    ns = Namespace(model="stall", model_fingerprint="stall", dtype="bfloat16", kv_cache_dtype="auto", block_size=16,
                   groups=(KVGroup(GroupKind.FULL, 16, 1),), payload_order=PayloadOrder.LAYER)
    keyring = None if args.plain else Keyring(SecretKey(os.urandom(32)))
    cipher = Xxh3FrameCheck() if keyring is None else AesGcmCiphers(keyring).for_sealing()
    root = folder / "store"
    root.mkdir(mode=0o700)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(root, ns, rescan_s=None),
                         chunking=Chunking(PayloadOrder.LAYER, 16), layout=RankLayout(), cipher=cipher,
                         ciphers=cipher_lookup(cipher), allocate_sealed=kernel_zeroed)  # as bootstrap composes it
    layer = args.tokens * TOKEN_LAYER_BYTES
    payload: list[bytes | memoryview] = [os.urandom(layer) for _ in range(LAYERS)]
    shared_at = None
    if args.writers:  # the payload where a GPU save copies it: the writers' shared region
        region = SharedRegion(layer * LAYERS)
        for i, data in enumerate(payload):
            region.view[i * layer : (i + 1) * layer] = data
        payload = [region.view[i * layer : (i + 1) * layer] for i in range(LAYERS)]
        svc.attach_writers(HelperPool(region, HelperRecipe("galahad.bootstrap", "helper_ciphers", (keyring,)),
                                      args.writers, work="write"))
        shared_at = 0
    segments = [SegmentSpec(0, i, 0, "uint8", (layer,)) for i in range(LAYERS)]
    stop, idle, busy = threading.Event(), [], []
    engine = threading.Thread(target=_engine, args=(stop, idle), daemon=True)
    engine.start()
    time.sleep(2.0)
    stop.set()
    engine.join()
    stop = threading.Event()
    engine = threading.Thread(target=_engine, args=(stop, busy), daemon=True)
    engine.start()
    t0 = time.perf_counter()
    for s in range(args.saves):  # new prompts, one after another
        key = svc.keys(list(range(s * 100_000, s * 100_000 + args.tokens + 1)), svc.seed())[-1]
        svc.save_part(key, Span(0, args.tokens), 0, segments, payload, shared_at=shared_at)
    took = time.perf_counter() - t0
    stop.set()
    engine.join()
    svc.close()
    return {"tokens": args.tokens, "saves": args.saves, "sealed": not args.plain, "writers": args.writers,
            "seconds": round(took, 3),
            "bytes": args.saves * layer * LAYERS, "idle": _figures(idle), "saving": _figures(busy)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a part holds (144 KiB each)")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--plain", action="store_true", help="a checksummed store instead of a sealed one")
    ap.add_argument("--writers", type=int, default=writer_processes_for(usable_cores()),
                    help="writer processes sealing the saves (default: what a GPU worker on this host starts)")
    ap.add_argument("--out", default=None, help="folder for save-stall.json (default bench/out/save-stall-<time>/)")
    args = ap.parse_args(argv)
    out = run_folder("save-stall", args.out)
    with tempfile.TemporaryDirectory(prefix="galahad-stall-") as tmp:
        result = run(args, Path(tmp))
    (out / "save-stall.json").write_text(json.dumps(result, indent=2))
    idle, busy = result["idle"], result["saving"]
    print(f"[bench] {args.saves} {'sealed' if not args.plain else 'checksummed'} saves of {args.tokens} tokens "
          f"({f'{args.writers} writer processes' if args.writers else 'sealed in process'}) in "
          f"{result['seconds']} s; engine loop idle p50 {idle['p50_ms']} ms p99 {idle['p99_ms']} ms, while saving "  # type: ignore[index]
          f"p50 {busy['p50_ms']} ms p99 {busy['p99_ms']} ms longest {busy['max_ms']} ms", flush=True)  # type: ignore[index]
    print(f"results file: {out / 'save-stall.json'}")
    print(f"save-stall-bench: loop_p99_vs_idle={busy['p99_ms'] / idle['p99_ms']:.2f} "  # type: ignore[index]
          f"longest_ms={busy['max_ms']:.1f} saved_gbps={result['bytes'] / result['seconds'] / 1e9:.2f}")  # type: ignore[index,operator]
    return 0


if __name__ == "__main__":
    sys.exit(main())
