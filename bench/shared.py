"""Shared-store benchmark: how much sooner does a fresh node answer prompts another node saved into
a store both mount over a network filesystem, and what does sharing cost a lookup? vLLM's CPU
build, a small random-weight model; a benchmark, not a test.

    python bench/shared.py --node-a MOUNT_A --node-b MOUNT_B [--local DIR] [--quick] [--out DIR]

MOUNT_A and MOUNT_B are one shared folder as two nodes see it (two mounts of one GlusterFS or NFS
volume, say); the benchmark makes a fresh store below them and removes it at the end. `--local`
names a folder on a local disk, for the lookup figures beside them (default: the temp folder).

1. Node A, a vLLM OpenAI server with Galahad on MOUNT_A, answers prompts of 1k and 2k tokens
   (saving them) and is stopped.
2. Node B, a new server on MOUNT_B, answers the same prompts (loaded from what A saved: warm) and
   fresh prompts of the same lengths (recomputed: cold), alternating, `--repeats` times each.
3. The store API, nodes A and B in this process: how long until an entry A commits is found by
   B, and what a lookup that misses and one that hits costs on B, against the local disk.

The figures (shared.json) and the servers' logs go to `--out DIR`, default
bench/out/shared-<YYYYmmdd-HHMMSS>/. docs/benchmarks.md ("Shared store") shows a run.
The last line is `shared-bench: warm_ttft_vs_cold=R visible_ms=V lookup_miss_us=M lookup_hit_us=H
local_miss_us=LM local_hit_us=LH`: R the time to first token of a 2k-token prompt node B loaded
over one it recomputed, V the median time until B sees an entry A committed, M and H a lookup on
B through the mount, LM and LH the same on the local disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from galahad.adapters.fs import FilesystemBlockStore
from galahad.cli.demo import Server, build_model, demo_environ, prompt_ids
from galahad.domain.chain import ChainKey
from galahad.domain.namespace import GroupKind, KVGroup, Namespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import run_folder  # noqa: E402
from restart import BENCH_MODEL, QUICK_MODEL  # noqa: E402

sys.path.pop(0)

NAMESPACE = Namespace(model="shared-bench", model_fingerprint="2" * 64, dtype="bfloat16", kv_cache_dtype="bfloat16",
                      block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 4),), tp_size=1)


def _ttft(server: Server, ids: list[int]) -> float:
    return server.ask(ids, 4)[1]


def _servers(args: argparse.Namespace, work: Path, out: Path, store_a: Path, store_b: Path) -> dict[str, Any]:
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    model = build_model(spec)
    vocab = spec["vocab_size"]
    env = demo_environ(work)
    env.update(VLLM_CPU_OMP_THREADS_BIND=args.threads, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
    lengths = [1024, 2048]
    stored = {n: prompt_ids(n, 1000 + n, vocab) for n in lengths}
    server = Server(model, {**env, "GALAHAD_CACHE_DIR": str(store_a)}, out / "node-a.log")
    try:
        server.wait_ready()
        for n in lengths:
            _ttft(server, stored[n])
        server.wait_metric("committed", len(lengths))
    finally:
        server.stop()
    result: dict[str, Any] = {"lengths": lengths, "warm": {}, "cold": {}}
    server = Server(model, {**env, "GALAHAD_CACHE_DIR": str(store_b)}, out / "node-b.log")
    try:
        server.wait_ready()
        for n in lengths:
            warm, cold = [], []
            for r in range(args.repeats):
                warm.append(_ttft(server, stored[n]))
                cold.append(_ttft(server, prompt_ids(n, 5000 + 97 * r + n, vocab)))
            result["warm"][n], result["cold"][n] = warm, cold
            print(f"[bench] node B, {n} tokens: cold {statistics.median(cold):.3f} s, "
                  f"warm {statistics.median(warm):.3f} s", flush=True)
        result["metrics_b"] = server.metrics()
    finally:
        server.stop()
    return result


def _key(n: int) -> ChainKey:
    return ChainKey(hashlib.sha256(b"shared-bench %d" % n).digest())


def _lookups(store: FilesystemBlockStore, hit: ChainKey, rounds: int = 2000) -> tuple[float, float]:
    """(a lookup that misses, one that hits) in microseconds, median of 5 batches."""
    miss_keys = [_key(10_000_000 + n) for n in range(rounds)]
    misses, hits = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for key in miss_keys:
            store.is_committed(key)
        misses.append((time.perf_counter() - t0) / rounds * 1e6)
        t0 = time.perf_counter()
        for _ in range(rounds):
            store.is_committed(hit)
        hits.append((time.perf_counter() - t0) / rounds * 1e6)
    return statistics.median(misses), statistics.median(hits)


def _store_figures(store_a: Path, store_b: Path, local: Path, entries: int) -> dict[str, Any]:
    with FilesystemBlockStore(store_a, NAMESPACE, max_bytes=1 << 34) as a, \
            FilesystemBlockStore(store_b, NAMESPACE, max_bytes=1 << 34) as b, \
            FilesystemBlockStore(local, NAMESPACE, max_bytes=1 << 34) as here:
        visible = []
        for n in range(entries):
            key = _key(n)
            b.is_committed(key)  # B has looked, and missed, before A writes
            a.put(key, 0, os.urandom(64 << 10))
            a.commit(key, (0,))
            t0 = time.perf_counter()
            while not b.is_committed(key):
                time.sleep(0.0005)
            visible.append((time.perf_counter() - t0) * 1e3)
        here.put(_key(0), 0, b"x" * 4096)
        here.commit(_key(0), (0,))
        miss, hit = _lookups(b, _key(0))
        local_miss, local_hit = _lookups(here, _key(0))
    return {"visible_ms": visible, "lookup_miss_us": miss, "lookup_hit_us": hit,
            "local_miss_us": local_miss, "local_hit_us": local_hit}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--node-a", required=True, help="the shared folder as node A mounts it")
    parser.add_argument("--node-b", required=True, help="the same folder as node B mounts it")
    parser.add_argument("--local", default=None, help="a folder on a local disk (default: the temp folder)")
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--entries", type=int, default=50, help="entries committed by A and looked for by B")
    parser.add_argument("--threads", default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"))
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--out", help="folder for the figures and the logs (default: bench/out/shared-<time>)")
    args = parser.parse_args(argv)
    name = f"galahad-shared-bench-{uuid.uuid4().hex[:8]}"
    store_a, store_b = Path(args.node_a) / name, Path(args.node_b) / name
    out = run_folder("shared", args.out)
    work = Path(tempfile.mkdtemp(prefix="galahad-shared-bench-", dir=args.local))
    try:
        result = _servers(args, work, out, store_a / "vllm", store_b / "vllm")
        result.update(_store_figures(store_a / "api", store_b / "api", work / "api", args.entries))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store_a, ignore_errors=True)
    r = statistics.median(result["warm"][2048]) / statistics.median(result["cold"][2048])
    v = statistics.median(result["visible_ms"])
    result.update(warm_ttft_vs_cold=r)
    (out / "shared.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"results file: {out / 'shared.json'}")
    print(f"shared-bench: warm_ttft_vs_cold={r:.3f} visible_ms={v:.2f} lookup_miss_us={result['lookup_miss_us']:.1f} "
          f"lookup_hit_us={result['lookup_hit_us']:.1f} local_miss_us={result['local_miss_us']:.1f} "
          f"local_hit_us={result['local_hit_us']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
