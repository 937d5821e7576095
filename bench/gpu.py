"""GPU benchmark (one H200, vLLM 0.26): time to first token after a process restart.

    python bench/gpu.py all WORKDIR [--lens 2048,8192] [--deadline-s 480]
    python bench/gpu.py MODE WORKDIR [--lens ...]     # one mode, one process (what `all` runs)
    python bench/gpu.py answers WORKDIR               # the turns runs' answers against turns-off's

Model: Qwen3-8B shape from its config only (`load_format="dummy"`, bf16, FlashAttention 3; nothing
compiled, every step of up to 512 tokens replayed as a CUDA graph, `cudagraph_mode=FULL`: the
few tokens a hit leaves to compute take one graph replay (vLLM's default compiled engine replays
such steps as piecewise graphs; not measured here) instead of an eager forward of about 34 ms. `GALAHAD_BENCH_ENGINE=graphs` replays decode
steps only (`FULL_DECODE_ONLY`, this benchmark's setting before the seventh session), `eager`
runs everything eagerly, as ../shared/gpu/README.md measured it). Every mode is its own process, so each "load" really is
a restarted engine reading a store another process wrote; the page cache is warm (written just
before, the usual redeploy on one machine), then dropped (`/proc/sys/vm/drop_caches`) for the cold
figures. Per length, distinct prompts are stored (five up to 2k, three up to 8k, one at 32k)
and the median is reported.

Modes: `transfer` (CudaBlockTransfer gather/scatter bandwidth, Qwen3-8B KV shape),
`recompute` (no connector), `recompute-idle` (Galahad attached but not caching: no licence; vLLM's
connector machinery alone), `gpuhit` (no connector: vLLM's own prefix cache hit on the GPU, the
same prompt again in one process: the floor of any hit), `store-plain`/`load-plain` (Galahad, xxh3 checksums),
`store-sealed`/`load-sealed` (Galahad, AES-256-GCM), `store-fs`/`load-fs` (vLLM's
OffloadingConnector with its `fs` tier), `cold-*` (a new process that drops the page cache before
its first hit: vLLM's CPU tier, filled by the warm hits of `load-fs`, would otherwise answer the
"cold" ones), `summary`. A load or cold mode with `~sN` (e.g. `load-plain~s512`) reads checksum
frames N KiB at a time (`codec._slice_bytes`; 4 MiB on 8 or more cores, else 512); with `~direct`
(`load-plain~direct`) plain loads are verified on the GPU (`GALAHAD_DIRECT_LOADS=1`); with
`~nopreload` nothing is read ahead at startup (`GALAHAD_PRELOAD_BYTES=0`; `auto`, on, otherwise); with
`~py` checksum frames are read and hashed by the Python loop, not the compiled one (`galahad.readhash`),
and `cold-*` modes read nothing ahead unless `~preload` (they drop the page cache after the engine
started, to time the load-or-recompute choice). Each measurement is one line `RESULT {json}`;
`all` appends them to WORKDIR/results.jsonl, ends with the `gpu-bench:` line and writes a plot
(WORKDIR/gpu-bench.png, or `--png FILE`; `summary` redraws it from the results).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
SEEDS = 3
KV_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # bytes: K and V, layers, KV heads, head size, bf16
MODE_BUDGET_S = {"turns-off": 150, "turns-idle": 150, "turns-on": 150, "turns-always": 150, "turns-threads": 150, "turns-always-threads": 150, "turns-faulty": 150, "transfer": 60, "gpuhit": 60, "loadpath": 120, "load-plainsync": 100, "load-sealedsync": 100, "recompute": 100, "store-plain": 150, "store-sealed": 150,
                 "store-fs": 150, "load-plain": 100, "load-sealed": 100, "load-fs": 100,
                 "cold-plain": 100, "cold-sealed": 100, "cold-fs": 100}
ORDER = ["transfer", "recompute", "store-plain", "load-plain", "cold-plain", "store-sealed",
         "load-sealed", "cold-sealed", "store-fs", "load-fs", "cold-fs"]


def seeds_for(n: int) -> list[int]:
    """Stored prompts of length n (the median is reported): five up to 2k (a request of 30-50 ms
    moves by a few ms from one to the next: the median of three was one request's figure),
    three up to 8k, one at 32k (device time)."""
    return [1000 * n + s for s in range(5 if n <= 2048 else SEEDS if n <= 8192 else 1)]


def emit(mode: str, name: str, **kw: Any) -> None:
    print("RESULT " + json.dumps({"mode": mode, "name": name, **kw}), flush=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(n)]


def drop_caches() -> bool | str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as exc:
        return f"failed: {exc}"


# -- one process per mode ---------------------------------------------------------------------


def _galahad_env(work: Path, variant: str) -> dict[str, str]:
    sync = variant.endswith("sync")  # e.g. load-plainsync: the plain store, loads inside the step
    variant = variant.removesuffix("sync")
    root = work / f"galahad-{variant}"
    env = {"GALAHAD_ASYNC_LOAD": "0" if sync else "1", "GALAHAD_CACHE_DIR": str(root / "store"), "GALAHAD_MIN_TOKENS": "256",
           "GALAHAD_TEST_COUNTERS_FILE": str(root / "counters.json")}
    if variant == "sealed":
        env["GALAHAD_KEY_FILE"] = str(root / "store.key")
    lic = root / "licence"
    if not (lic / "licence.lic").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
        from vllm_support.licence import make_licence

        make_licence(lic, points=8)  # up to TP x PP = 8 ranks (GALAHAD_BENCH_TP)
    env.update(GALAHAD_LICENCE_FILE=str(lic / "licence.lic"), GALAHAD_LICENCE_ISSUER_KEY=str(lic / "issuer.pub"))
    return env


def _kv_config(mode: str, work: Path) -> dict[str, Any] | None:
    if mode.endswith("-fs"):
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 30,
                    "secondary_tiers": [{"type": "fs", "root_dir": str(work / "vllm-fs")}]}}
    if mode in ("recompute", "gpuhit", "transfer") or turns_batch(mode)[0] == "turns-off":
        return None
    # the module path: worker processes (tensor parallel) find the connector without the plugin
    return {"kv_connector": "GalahadConnector", "kv_connector_module_path": "galahad_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def make_llm(mode: str, work: Path, lens: list[int], kv_bytes: int | None = None) -> Any:
    from vllm import LLM

    kv = _kv_config(mode, work)
    if kv is not None and kv["kv_connector"] == "GalahadConnector":
        from galahad.adapters.vllm import compat
        from galahad.adapters.vllm.registration import register_connector

        register_connector()
        compat.install()
    model = work / "qwen3_8b_shape"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    kw: dict[str, Any] = {"kv_transfer_config": kv} if kv else {}
    engine = os.environ.get("GALAHAD_BENCH_ENGINE", "full")
    if engine == "graphs":  # decode steps replay CUDA graphs (FlashAttention 3), nothing compiled
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    elif engine == "full":  # every step of up to 512 tokens replays a CUDA graph (FlashAttention 3
        # captures mixed prefill and decode batches), nothing compiled
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL",
                                    "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}
    t = time.perf_counter()

    tp = int(os.environ.get("GALAHAD_BENCH_TP", "1"))  # tensor parallel ranks (a 2-GPU machine: 2)
    if tp > 1:
        kw["tensor_parallel_size"] = tp

    def start(**extra: Any) -> Any:
        return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=max(lens) + 512, gpu_memory_utilization=0.25, max_num_seqs=16, seed=0,
                   generation_config="vllm", attention_backend="FLASH_ATTN",
                   kv_cache_memory_bytes=kv_bytes or ((16 << 30) if max(lens) > 8192 else (8 << 30)), **extra)

    try:
        llm = start(enforce_eager=engine == "eager", **kw)
    except Exception as exc:  # noqa: BLE001 - graphs refused here: the figures say eager
        if engine == "eager":
            raise
        emit(mode, "engine_fallback", error=str(exc)[:300])
        kw.pop("compilation_config", None)
        engine = "eager"
        llm = start(enforce_eager=True, **kw)
    try:  # what vLLM made of the setting (it may lower a CUDA graph mode the backend cannot do)
        graphs = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    except AttributeError:
        graphs = "?"
    emit(mode, "engine_startup", s=round(time.perf_counter() - t, 1), engine=engine, tp=tp, cudagraph_mode=graphs)
    return llm


def ttft(llm: Any, toks: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": toks}], sp, use_tqdm=False)
    return round((time.perf_counter() - t) * 1000, 2), int(out[0].num_cached_tokens)


def series(llm: Any, mode: str, name: str, n: int, seeds: list[int]) -> None:
    ms, cached, pin_ms = [], [], []
    for s in seeds:
        before = len(_PINS)
        m, c = ttft(llm, prompt(s, n))
        ms.append(m)
        cached.append(c)
        pin_ms.append(round(sum(seconds for _n, seconds in _PINS[before:]) * 1e3, 1))
    pins = {"pin_ms": pin_ms} if _PINS_TRACED else {}  # time spent pinning new buffers, per request
    emit(mode, name, tokens=n, ms=ms, median_ms=statistics.median(ms), num_cached_tokens=cached, **pins)


_PINS: list[tuple[int, float]] = []  # (bytes, seconds) of every buffer Galahad's pool pinned
_PINS_TRACED = False  # `_trace_pins` is on (modes where Galahad caches)


def _trace_pins() -> None:
    """Time every buffer the worker's pinned pool pins (bench only; the engine runs in this
    process), so a request that stalled shows whether it paid for pinning (`pin_ms`)."""
    global _PINS_TRACED
    from galahad.adapters.vllm import cuda

    pin = cuda.PinnedPool._pin

    def timed(self: Any, nbytes: int) -> Any:
        t0 = time.perf_counter()
        try:
            return pin(self, nbytes)
        finally:
            _PINS.append((nbytes, time.perf_counter() - t0))

    cuda.PinnedPool._pin = timed  # type: ignore[method-assign]
    _PINS_TRACED = True


def settle(llm: Any, mode: str, work: Path, counters: str | None) -> None:
    """Keep the engine stepping (tiny prompts) until every save is durable, or 90 s."""
    t0, last = time.time(), None
    while time.time() - t0 < 90:
        ttft(llm, prompt(int(time.time() * 1000) % 100000, 32))
        time.sleep(0.2)
        if counters:
            try:
                data = json.loads(Path(counters).read_text())
            except (OSError, ValueError):
                continue
            if data.get("pending_commits", 1) == 0:
                emit(mode, "counters", **data)
                break
        else:
            cur = sum(f.stat().st_size for f in (work / "vllm-fs").rglob("*") if f.is_file())
            if cur == last and cur > 0:
                break
            last = cur
    emit(mode, "settled", s=round(time.time() - t0, 1))


def slice_kib(mode: str) -> int | None:
    """The `~sN` suffix's N (KiB), or None. Each `~` suffix is taken whole, so that a suffix that only
    begins with `s` (`~seq`, `~sync2`) is not read as a slice size (the twenty-seventh session lost
    two modes to that)."""
    sizes = [s[1:] for s in mode.split("~")[1:] if s[:1] == "s" and s[1:].isdigit()]
    return int(sizes[-1]) if sizes else None


def run_mode(mode: str, work: Path, lens: list[int]) -> None:
    if mode == "transfer":
        return transfer_bench(lens)
    if mode == "loadpath":
        return loadpath_bench(work, lens)
    if mode.startswith("turns-"):
        return turns_bench(mode, work)
    variant = mode.split("-", 1)[1].partition("~")[0] if "-" in mode else ""
    if (kib := slice_kib(mode)) is not None:  # e.g. load-plain~s512: checksum frames read 512 KiB at a time
        from galahad import codec

        codec._slices[:] = [kib << 10]
    if "~py" in mode:  # e.g. load-plain~py: checksum frames read and hashed in Python, as where
        from galahad import readhash  # galahad._readhash was not built (twenty-sixth session)

        readhash._native = None
    if "~direct" in mode:  # e.g. load-plain~direct: plain loads verified on the GPU, not on the host
        os.environ["GALAHAD_DIRECT_LOADS"] = "1"  # (`adapters/vllm/direct.py`, twenty-fourth session)
    # Reading ahead at startup (GALAHAD_PRELOAD_BYTES, auto on CUDA; twenty-fifth session): off with
    # `~nopreload`, and off in the cold modes unless `~preload`: a cold mode drops the page cache after
    # the engine started, to time the load-or-recompute choice, and what was read ahead is in memory
    if "~nopreload" in mode or (mode.startswith("cold-") and "~preload" not in mode):
        os.environ["GALAHAD_PRELOAD_BYTES"] = "0"
    counters = None
    if variant.removesuffix("sync") in ("plain", "sealed"):
        env = _galahad_env(work, variant)
        os.environ.update(env)
        counters = env["GALAHAD_TEST_COUNTERS_FILE"]
    elif mode == "recompute-idle":  # Galahad attached but not caching (no licence): what vLLM's
        # connector machinery costs a request by itself (the floor under `cold-*`)
        os.environ.update(_galahad_env(work, "idle"), GALAHAD_LICENCE_FILE=str(work / "no-licence"))
    if counters:  # Galahad caching: where a request's time goes when it pins a buffer
        _trace_pins()
    llm = make_llm(mode, work, lens)
    ttft(llm, prompt(9, 1024))  # warm-up: first-request costs stay out of the figures
    stored = {n: seeds_for(n) for n in lens}
    if mode in ("recompute", "recompute-idle"):
        for n in lens:
            series(llm, mode, f"recompute_{n}", n, [7 + s for s in seeds_for(n)])
    elif mode == "gpuhit":  # vLLM's own prefix cache hit on the GPU (the prompt again, this
        # process): the floor of any hit, whose last tokens vLLM computes in one more step
        for n in lens:
            seeds = [5 + s for s in seeds_for(n)]
            for s in seeds:
                ttft(llm, prompt(s, n))
            series(llm, mode, f"gpuhit_{n}", n, seeds)
    elif mode.startswith("store-"):
        for n in lens:
            series(llm, mode, f"store_{n}", n, stored[n])
        settle(llm, mode, work, counters)
    elif mode.startswith(("load-", "cold-")):
        kind = mode.split("-", 1)[0]
        if kind == "cold":
            emit(mode, "drop_caches", ok=drop_caches())
        profiler = _profiler(mode)
        hooks = _HookClock() if counters else None  # Galahad's hooks: where a hit's time goes
        for n in lens:
            series(llm, mode, f"{'warm' if kind == 'load' else 'cold'}_{n}", n, stored[n])
            if hooks is not None:
                emit(mode, f"hooks_{n}", **hooks.take())
        _write_profile(profiler, mode, work)
        emit_counters(mode, counters)
    emit(mode, "done")


def emit_counters(mode: str, path: str | None) -> None:
    """The counters the connector wrote to GALAHAD_TEST_COUNTERS_FILE (none without Galahad)."""
    if not path:
        return
    try:
        emit(mode, "counters", **json.loads(Path(path).read_text()))
    except (OSError, ValueError) as exc:
        emit(mode, "counters", missing=str(exc))


def transfer_bench(lens: list[int]) -> None:
    """Gather and scatter bandwidth of CudaBlockTransfer on the Qwen3-8B KV shape (36 layers)."""
    import torch

    from galahad.adapters.vllm.blocks import byte_view
    from galahad.adapters.vllm.cuda import CudaBlockTransfer, PinnedPool

    blocks, bs = 4096, 16
    layers = [torch.randn(blocks, bs, 8, 256, device="cuda").to(torch.bfloat16).permute(0, 2, 1, 3)
              for _ in range(36)]
    views = [byte_view(t, blocks)[0] for t in layers]
    pool = PinnedPool(32 << 30)
    t = CudaBlockTransfer(views, pool=pool)
    for n in lens:
        nb = n // bs
        ids = torch.randperm(blocks)[:nb].tolist()
        nbytes = t.payload_bytes(nb)
        pool.reserve(nbytes)
        g = t.gather([ids]); g.wait(); t.release(g)  # noqa: E702 - warm-up
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            g = t.gather([ids])
            g.wait()
            times.append(time.perf_counter() - t0)
            host = g.host
            t.release(g)
        gather_s = statistics.median(times)
        buf = pool.acquire(nbytes)
        assert buf is not None
        buf.view(nbytes).copy_(host)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            ev = t.scatter([ids], buf.view(nbytes), nrows=nb)
            ev.synchronize()
            times.append(time.perf_counter() - t0)
        scatter_s = statistics.median(times)
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        h2d = 5 * nbytes / (time.perf_counter() - t0)
        emit("transfer", f"transfer_{n}", tokens=n, bytes=nbytes, gather_ms=round(gather_s * 1e3, 2),
             gather_gbs=round(nbytes / gather_s / 1e9, 1), scatter_ms=round(scatter_s * 1e3, 2),
             scatter_gbs=round(nbytes / scatter_s / 1e9, 1), pinned_h2d_gbs=round(h2d / 1e9, 1),
             pinned_allocations=pool.pinned_allocations)
        pool.release(buf)
    emit("transfer", "done")


TURNS = {"conversations": 24, "first_tokens": 3072, "turn_tokens": 256, "answer_tokens": 16,
         "rounds": 4, "kv_bytes": 3 << 30}


def turns_batch(mode: str) -> tuple[str, int]:
    """(the mode without its batch suffix, conversations sent at once). `turns-on`: every
    conversation's next turn in flight at once (a server with 24 users, each sending a turn when
    the last answer came back; vLLM batches them as they fit); `turns-on-b4`: four at a time, the
    next four only when those four answered (the workload of the seventh session and before)."""
    base, sep, size = mode.rpartition("-b")
    if sep and size.isdigit():
        return base, int(size)
    return mode, TURNS["conversations"]


def turns_bench(mode: str, work: Path) -> None:
    """A multi-turn workload: conversations whose every turn resends the whole history plus a new
    message, more of them than the GPU's KV cache holds (3 GiB: about 21k tokens of this model),
    so vLLM's own prefix cache has evicted a conversation by the time its next turn comes.
    Each round sends every conversation's next turn, all at once or `-bN` N at a time
    (`turns_batch`).
    `turns-off`: no connector; `turns-idle`: Galahad configured but not caching (no licence:
    vLLM's connector path alone); `turns-on`: Galahad (plain); `turns-always`: every hit loaded;
    `turns-threads`, `turns-always-threads`: as `turns-on`, `turns-always`, without reader
    processes (GALAHAD_READER_PROCESSES=0);
    `turns-yieldN`: as `turns-on` with GALAHAD_SAVE_YIELD_MS=N (each save waits at most N ms
    while a load runs; `turns-on` has the default, 400);
    `turns-saveN`: as `turns-on` with GALAHAD_SAVE_THREADS=N (N threads write saves);
    `turns-procN`: as `turns-on` with GALAHAD_SAVE_PROCESSES=N (N helper processes seal and
    write saves);
    `turns-readN`: as `turns-on` with N reader processes (GALAHAD_READER_PROCESSES=N), N entries
    of a job read at once;
    `turns-switchN`: as `turns-on` with this process's interpreter switch interval at N
    microseconds (5000 by default: a thread that wants the lock waits that long for the engine's);
    `turns-nopending`: as `turns-on` with GALAHAD_PENDING_LOADS=0 (a turn's saves are loaded
    only once durable, never from the copies the saves hold);
    `turns-faulty`: Galahad with GALAHAD_FAULT_LOAD_RATE=0.33 (a third of the loads fail and
    recompute). Turns/s over the rounds after the first (the first computes and saves every
    conversation)."""
    from vllm import SamplingParams

    cfg = TURNS
    full, batch = mode, 0
    mode, batch = turns_batch(full)
    olds = ["galahad-plain", "galahad-sealed", "vllm-fs"] + [p.name for p in work.glob("galahad-turns-*")]
    for old in olds:  # the load modes and other turns modes ran before: free the disk (64 GiB there)
        shutil_rm(work / old)
    if mode == "turns-idle":  # the connector configured but not caching (no licence): what
        # vLLM's connector path costs by itself, apart from Galahad's work
        os.environ.update(_galahad_env(work, "turns-idle"), GALAHAD_LICENCE_FILE=str(work / "no-licence"))
    elif mode != "turns-off":
        env = _galahad_env(work, "turns-" + full.split("-", 1)[1])
        env["GALAHAD_MIN_TOKENS"] = "1024"
        # A conversation resends its history: chunk order stores each 64 tokens once, so a turn
        # writes only what is new (layer order would write the whole history again every turn).
        env["GALAHAD_PAYLOAD_ORDER"] = os.environ.get("GALAHAD_BENCH_TURNS_ORDER", "chunk")
        env["GALAHAD_MAX_BYTES"] = "30G"
        if mode == "turns-faulty":
            env["GALAHAD_FAULT_LOAD_RATE"] = "0.33"
        if mode.endswith("-threads"):  # read by this process's threads, no reader processes
            env["GALAHAD_READER_PROCESSES"] = "0"
        if mode.startswith("turns-always"):  # every hit loaded (no cost model): the in-engine load rate
            env["GALAHAD_LOAD_POLICY"] = "always"
        if mode.startswith("turns-yield"):  # `turns-on` with saves waiting at most N ms for loads
            env["GALAHAD_SAVE_YIELD_MS"] = mode.removeprefix("turns-yield")
        if mode.startswith("turns-save"):  # `turns-on` with N save threads (GALAHAD_SAVE_THREADS)
            env["GALAHAD_SAVE_THREADS"] = mode.removeprefix("turns-save")
        if mode.startswith("turns-proc"):  # `turns-on` with N save processes (GALAHAD_SAVE_PROCESSES)
            env["GALAHAD_SAVE_PROCESSES"] = mode.removeprefix("turns-proc")
        if mode.startswith("turns-read"):  # `turns-on` with N reader processes, N entries read at once
            env["GALAHAD_READER_PROCESSES"] = env["GALAHAD_BENCH_AHEAD"] = mode.removeprefix("turns-read")
        if mode == "turns-nopending":  # `turns-on` with GALAHAD_PENDING_LOADS=0: loads only from
            # the disk, once a save is durable (the code before the twenty-first session)
            env["GALAHAD_PENDING_LOADS"] = "0"
        if mode.startswith("turns-switch"):  # `turns-on` with the interpreter's switch interval at N us
            sys.setswitchinterval(int(mode.removeprefix("turns-switch")) * 1e-6)
        os.environ.update(env)
    trace = _trace_loads() if mode != "turns-off" else None
    emit(full, "workload", batch=batch, **{k: v for k, v in cfg.items() if k != "kv_bytes"})
    llm = make_llm(full, work, [cfg["first_tokens"] + cfg["rounds"] * 600], kv_bytes=cfg["kv_bytes"])
    hooks = _HookClock() if mode != "turns-off" else None  # after make_llm: compat installed
    cpu = _ThreadCpu()
    # GALAHAD_BENCH_LOGPROBS=1: each token's log-probability and its lead over the runner-up,
    # for `answers` (how far the logits moved before a token differed)
    margins = os.environ.get("GALAHAD_BENCH_LOGPROBS") == "1"
    sp = SamplingParams(max_tokens=cfg["answer_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                        logprobs=2 if margins else None)
    rng = random.Random(5)
    history = [[rng.randrange(1000, 150000) for _ in range(cfg["first_tokens"])]
               for _ in range(cfg["conversations"])]
    scores: list[list[list[list[float]]]] = [[] for _ in history]
    answers: list[list[list[int]]] = [[] for _ in history]
    errors = 0
    profiler = None
    profile_from = int(os.environ.get("GALAHAD_BENCH_PROFILE_FROM", "1"))  # 0: the first round too
    rounds = int(os.environ.get("GALAHAD_BENCH_ROUNDS", cfg["rounds"]))  # fewer: e.g. 1 to look at round 0
    for rnd in range(rounds):
        if rnd == profile_from:  # the engine thread, from this round on (the second by default)
            profiler = _profiler(full)
        t0 = time.perf_counter()
        for start in range(0, len(history), batch):
            ids = range(start, min(start + batch, len(history)))
            try:
                outs = llm.generate([{"prompt_token_ids": history[i]} for i in ids], sp, use_tqdm=False)
            except Exception as exc:  # noqa: BLE001 - a client error is counted, not fatal
                errors += 1
                print("turn error:", exc, flush=True)
                continue
            for i, out in zip(ids, outs):
                answer = list(out.outputs[0].token_ids)
                answers[i].append(answer)
                if margins:
                    scores[i].append(_token_scores(answer, out.outputs[0].logprobs))
                history[i] = history[i] + answer + [rng.randrange(1000, 150000) for _ in range(cfg["turn_tokens"])]
        took = time.perf_counter() - t0
        emit(full, f"round_{rnd}", s=round(took, 3), turns=len(history),
             turns_per_s=round(len(history) / took, 2))
        if hooks is not None:
            emit(full, f"hooks_{rnd}", **hooks.take())
        if trace is not None:  # what this round loaded (round 1 finds round 0's saves still being written)
            emit(full, f"loads_{rnd}", **trace.take_round())
        emit(full, f"thread_cpu_{rnd}", **cpu.take())
        if profiler is not None:  # one profile a round: round 0 (the writes) apart from the rest
            _write_profile(profiler, f"{full}-round{rnd}", work)
            profiler = _profiler(full) if rnd + 1 < rounds else None
    emit(full, "turns", errors=errors, answers_digest=hashlib_digest(answers))
    emit(full, "answers", answers=answers, **({"scores": scores} if margins else {}))
    if trace is not None:
        emit(full, "load_jobs", **trace.summary())
        for f in (work / f"galahad-{full}").rglob("figures-*.json"):
            emit(full, "figures", **json.loads(f.read_text()))
    emit_counters(full, os.environ.get("GALAHAD_TEST_COUNTERS_FILE"))
    emit(full, "done")


class _HookClock:
    """Wall time the engine spends inside each GalahadConnector hook (bench only): the
    connector's whole cost on the engine thread, per round (ms). The engine runs in this process."""

    HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
             "update_connector_output", "request_finished", "request_finished_all_groups",
             "start_load_kv", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
             "build_connector_worker_meta", "get_kv_connector_stats")

    def __init__(self) -> None:
        from galahad.adapters.vllm.connector import GalahadConnector

        self.ms: dict[str, float] = {}
        for name in self.HOOKS:
            if hasattr(GalahadConnector, name):
                setattr(GalahadConnector, name, self._wrap(name, getattr(GalahadConnector, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

        return timed

    def take(self) -> dict[str, float]:
        out = {k: round(v, 1) for k, v in sorted(self.ms.items()) if v >= 0.05}
        out["total"] = round(sum(self.ms.values()), 1)
        self.ms = {}
        return out


class _ThreadCpu:
    """CPU seconds this process's threads used since the last `take`, by thread name prefix
    (galahad-save, galahad-io, ...; `engine` is the main thread), from /proc/self/task."""

    def __init__(self) -> None:
        self.last: dict[int, float] = {}
        self.take()

    @staticmethod
    def _cpu(tid: int) -> float | None:
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def take(self) -> dict[str, float]:
        import threading

        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        main = threading.main_thread().native_id
        out: dict[str, float] = {}
        seen: dict[int, float] = {}
        for entry in os.listdir("/proc/self/task"):
            tid = int(entry)
            cpu = self._cpu(tid)
            if cpu is None:
                continue
            seen[tid] = cpu
            name = "engine" if tid == main else names.get(tid, "other").rsplit("_", 1)[0]
            out[name] = out.get(name, 0.0) + cpu - self.last.get(tid, 0.0)
        self.last = seen
        return {k: round(v, 2) for k, v in sorted(out.items()) if v >= 0.01}


class _LoadTrace:
    """What the worker's load jobs took (the engine runs in this process): per job its entries,
    bytes and seconds from the first read to the last copy, and the copies' engine-thread time."""

    def __init__(self) -> None:
        self.jobs: list[tuple[int, int, float]] = []
        self.copy_s: list[float] = []
        self.wait_s = 0.0  # the job's thread waiting for the next entry's read, in order
        self.entry_s: list[float] = []  # each entry's read and verification, in its thread
        self.readers: Any = None  # the worker's ReaderPool, when it has one
        self._taken = 0  # jobs already reported by `take_round`

    def take_round(self) -> dict[str, Any]:
        """The load jobs since the last call: how many, their entries and GB (what a round loaded)."""
        jobs, self._taken = self.jobs[self._taken :], len(self.jobs)
        return {"jobs": len(jobs), "entries": sum(n for n, _b, _s in jobs),
                "gb": round(sum(b for _n, b, _s in jobs) / 1e9, 2),
                "seconds": round(sum(s for _n, _b, s in jobs), 3)}

    def summary(self) -> dict[str, Any]:
        if not self.jobs:
            return {"jobs": 0}
        rates = sorted(b / s / 1e9 for _n, b, s in self.jobs if s > 0)
        return {"jobs": len(self.jobs), "entries": sum(n for n, _b, _s in self.jobs),
                "gb": round(sum(b for _n, b, _s in self.jobs) / 1e9, 2),
                "seconds": round(sum(s for _n, _b, s in self.jobs), 3),
                "gbs_median": round(statistics.median(rates), 2), "gbs_min": round(rates[0], 2),
                "gbs_max": round(rates[-1], 2), "copy_calls": len(self.copy_s),
                "copy_s": round(sum(self.copy_s), 3), "wait_s": round(self.wait_s, 3),
                "entry_reads": len(self.entry_s), "entry_ms_median": round(
                    statistics.median(self.entry_s) * 1e3, 2) if self.entry_s else None,
                **self._readers_summary()}

    def _readers_summary(self) -> dict[str, Any]:
        """Per part a reader process read, in ms: waiting for an idle one, from sending the job to
        holding its reply, and the helper's own reading and verifying (the rest of the ask is the
        socket and this process's interpreter lock)."""
        pool = self.readers
        n = getattr(pool, "parts_read", 0)
        if not n:
            return {}
        return {"helper_parts": n, "take_ms_mean": round(pool.take_seconds / n * 1e3, 2),
                "ask_ms_mean": round(pool.ask_seconds / n * 1e3, 2),
                "helper_ms_mean": round(pool.helper_seconds / n * 1e3, 2)}


def _trace_loads() -> _LoadTrace:
    """Wrap the worker's `_finish` and `_scatter_parts` (bench only) to time every load job.
    GALAHAD_BENCH_AHEAD=N also sets how many entries of a job are read at once."""
    from galahad.adapters.vllm import worker as w

    trace = _LoadTrace()
    ahead = os.environ.get("GALAHAD_BENCH_AHEAD")
    if ahead:
        w._READ_AHEAD = int(ahead)
        w.usable_cores = lambda: 2 * int(ahead)  # type: ignore[assignment]
    finish, scatter = w.GalahadWorker._finish, w.GalahadWorker._scatter_parts
    take_parts, read_one = w.GalahadWorker._take_parts, w.GalahadWorker._read_one

    def timed_take(job: Any, results: Any, *args: Any) -> Any:  # the engine thread's wait for reads
        def timed() -> Any:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(results)
                except StopIteration:
                    return
                finally:
                    trace.wait_s += time.perf_counter() - t0
                yield item

        return take_parts(job, timed(), *args)

    def timed_one(self: Any, *args: Any, **kwargs: Any) -> Any:
        if trace.readers is None and self.service is not None:
            trace.readers = getattr(self.service, "_readers", None)
        t0 = time.perf_counter()
        try:
            return read_one(self, *args, **kwargs)
        finally:
            trace.entry_s.append(time.perf_counter() - t0)

    def timed_finish(self: Any, job: Any, outcome: Any, *, placed: Any = ()) -> Any:
        parts = list(placed) + list(outcome.parts)  # the job's read time, then its last copies
        nbytes = sum(w.part_bytes(p) for p in parts)
        from_memory = any(not hasattr(p, "header") for p in parts)  # pending loads (no disk read)
        t0 = time.perf_counter()
        try:
            return finish(self, job, outcome, placed=placed)
        finally:
            # a failed job's read is not timed (its prefix's bytes are); nor one with parts loaded
            # from the copies of pending saves (a host-to-device copy, not the store's rate)
            if outcome.failed is None and not from_memory:
                trace.jobs.append((len(parts), nbytes, outcome.seconds + time.perf_counter() - t0))

    def timed_scatter(self: Any, items: Any) -> None:
        t0 = time.perf_counter()
        try:
            scatter(self, items)
        finally:
            trace.copy_s.append(time.perf_counter() - t0)

    w.GalahadWorker._finish = timed_finish  # type: ignore[method-assign]
    w.GalahadWorker._scatter_parts = timed_scatter  # type: ignore[method-assign]
    w.GalahadWorker._take_parts = staticmethod(timed_take)  # type: ignore[method-assign,assignment]
    w.GalahadWorker._read_one = timed_one  # type: ignore[method-assign]
    return trace


def _profiler(mode: str) -> Any:
    """A running cProfile of this thread (the engine's: the engine runs in-process) when
    GALAHAD_BENCH_PROFILE names `mode` (or is 1); else None."""
    if os.environ.get("GALAHAD_BENCH_PROFILE") not in ("1", mode):
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _write_profile(profiler: Any, mode: str, work: Path) -> None:
    if profiler is None:
        return
    import io
    import pstats

    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(60)
    Path(os.environ.get("OUT", str(work)), f"profile-{mode}.txt").write_text(text.getvalue())


def _token_scores(answer: list[int], logprobs: Any) -> list[list[float]]:
    """Per generated token: [its log-probability, its lead over the best other token]."""
    out = []
    for token, top in zip(answer, logprobs or []):
        mine = top[token].logprob
        others = [v.logprob for k, v in top.items() if k != token]
        out.append([round(mine, 5), round(mine - max(others), 5) if others else 99.0])
    return out


def compare_answers(work: Path) -> list[str]:
    """Each turns run's answers against the first `turns-off` run's: per run, the conversations
    that answered differently and, for the first token that differs in each, the reference's lead
    of its token over the runner-up, and the largest change of a shared token's log-probability
    before it (both with GALAHAD_BENCH_LOGPROBS=1). With this benchmark's dummy weights every lead
    is 0 to 5 decimals: a change in the logits' last bits changes the token. Nothing without
    turns runs; one line without a `turns-off` run."""
    runs = [(r["mode"], r) for r in load_results(work) if r.get("name") == "answers"]
    if not runs:
        return []
    ref = next((r for mode, r in runs if mode == "turns-off"), None)
    if ref is None:
        return ["answers: no turns-off run to compare with"]
    lines = []
    for n, (mode, run) in enumerate(runs):
        if run is ref:
            continue
        scored = "scores" in run and "scores" in ref
        diverged, drift = [], 0.0
        for c in range(min(len(run["answers"]), len(ref["answers"]))):
            where, moved = _first_difference(run, ref, c, scored)
            drift = max(drift, moved)
            if where is not None:
                rnd, pos = where
                lead = ref["scores"][c][rnd][pos][1] if "scores" in ref else None
                diverged.append(f"conv {c} round {rnd} token {pos} (reference lead {lead})")
        moved_text = f"{drift:.4f}" if scored else "n/a (no GALAHAD_BENCH_LOGPROBS)"
        lines.append(f"answers: run {n} {mode}: {len(diverged)} of {len(run['answers'])} conversations differ; "
                     f"largest log-probability change before a difference {moved_text}"
                     + "".join(f"\n    {d}" for d in diverged))
    return lines


def _first_difference(run: dict[str, Any], ref: dict[str, Any], c: int,
                      scored: bool) -> tuple[tuple[int, int] | None, float]:
    """Conversation c's first (round, token) where `run` answered otherwise than `ref` (None: it
    never did), and the largest change of a log-probability before it (0.0 unless `scored`)."""
    moved = 0.0
    for rnd, (a, b) in enumerate(zip(run["answers"][c], ref["answers"][c])):
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if scored:
            mine, theirs = run["scores"][c][rnd], ref["scores"][c][rnd]
            upto = len(a) if pos is None else pos
            moved = max([moved] + [abs(mine[k][0] - theirs[k][0]) for k in range(upto)])
        if pos is not None:
            return (rnd, pos), moved
    return None, moved


def hashlib_digest(value: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def _turns_per_s(results: list[dict[str, Any]], mode: str) -> float | None:
    rounds = [r for r in results if r.get("mode") == mode and str(r.get("name", "")).startswith("round_")]
    later = [r for r in rounds if r["name"] != "round_0"]
    if not later:
        return None
    return sum(r["turns"] for r in later) / sum(r["s"] for r in later)


def _timed(fn: Any, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loadpath_bench(work: Path, lens: list[int]) -> None:
    """Where a load's time goes, without vLLM: one rank's part of n tokens (Qwen3-8B shape) in a
    real store, page cache warm, read into a pinned buffer by the medium alone (threads of
    preadv), by `service.load_part` (plain: xxh3; sealed: AES-GCM through OpenSSL, which holds the
    interpreter lock, or pycryptodome, which releases it), with the frame pool at 4 and 8 threads
    and at every core, plain also with each read size of a checksum frame (512 KiB to 4 MiB:
    `codec._slice_bytes`); xxh3 alone; and the pinned buffer's copy to the GPU."""
    import concurrent.futures as cf

    import torch
    import xxhash

    from galahad import codec, readhash
    from galahad.adapters.crypto import aesgcm
    from galahad.adapters.fs.store import FilesystemBlockStore
    from galahad.codec import cipher_lookup
    from galahad.domain.chain import ChainKey
    from galahad.domain.chunking import Chunking, Span
    from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
    from galahad.domain.rank import RankLayout
    from galahad.domain.secret import SecretKey
    from galahad.format.checksum import Xxh3FrameCheck
    from galahad.service import KVCacheService, SegmentSpec

    cores = len(os.sched_getaffinity(0))
    cuda = torch.cuda.is_available()
    ns = Namespace(model="bench", model_fingerprint="bench", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 36),))
    ciphers = {"plain": Xxh3FrameCheck(), "sealed": aesgcm.AesGcmCipher(SecretKey(os.urandom(32)))}
    pool = cf.ThreadPoolExecutor(cores)
    for n in lens:
        nbytes = n * KV_PER_TOKEN
        layer = torch.randint(0, 255, (nbytes // 36,), dtype=torch.uint8)
        payload = [layer.numpy().data] * 36
        segs = [SegmentSpec(0, i, 0, "bfloat16", (2, n, 8, 128)) for i in range(36)]
        host = torch.empty(nbytes + (1 << 20), dtype=torch.uint8, pin_memory=cuda)
        out = memoryview(host.numpy()).cast("B")
        row: dict[str, Any] = {"tokens": n, "bytes": nbytes, "cores": cores}
        for kind, cipher in ciphers.items():
            folder = work / f"loadpath-{kind}-{n}"
            shutil_rm(folder)
            services = {}
            for ft in sorted({4, 8, cores}):
                store = FilesystemBlockStore(str(folder), ns, max_bytes=1 << 40, io_threads=cores, rescan_s=None)
                store.wait_indexed(60)
                services[ft] = KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.LAYER, 16),
                                              layout=RankLayout(), cipher=cipher, ciphers=cipher_lookup(cipher),
                                              io_threads=cores, frame_threads=ft)
            key = ChainKey(bytes(32))
            svc = services[cores]
            svc.save_part(key, Span(0, n), 0, segs, payload)
            svc.commit(key)
            path = next(p for p in folder.rglob("*") if p.is_file() and p.stat().st_size >= nbytes)
            if kind == "plain":
                fd = os.open(path, os.O_RDONLY)
                chunk = 4 << 20

                def raw(threads: int) -> None:
                    offs = list(range(0, nbytes, chunk))

                    def one(o: int) -> None:
                        os.preadv(fd, [out[o : min(o + chunk, nbytes)]], o)
                    list(pool.map(one, offs) if threads > 1 else map(one, offs))
                row["raw_1t_gbs"] = round(nbytes / _timed(lambda: raw(1)) / 1e9, 1)
                row["raw_all_gbs"] = round(nbytes / _timed(lambda: raw(cores)) / 1e9, 1)
                os.close(fd)

                def hash_all() -> None:
                    list(pool.map(lambda o: xxhash.xxh3_128_digest(out[o : o + chunk]), range(0, nbytes, chunk)))
                row["xxh3_all_gbs"] = round(nbytes / _timed(hash_all) / 1e9, 1)
                row["xxh3_1t_gbs"] = round(nbytes / _timed(lambda: xxhash.xxh3_128_digest(out[:nbytes])) / 1e9, 1)
                if cuda:
                    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

                    def h2d() -> None:
                        dev.copy_(host[:nbytes], non_blocking=True)
                        torch.cuda.synchronize()
                    h2d()
                    row["h2d_gbs"] = round(nbytes / _timed(h2d) / 1e9, 1)
            for ft, s in services.items():
                row[f"{kind}_ft{ft}_gbs"] = round(nbytes / _timed(lambda: s.load_part(key, 0, out=out)) / 1e9, 1)
            if kind == "plain":  # read size of a checksum frame in the Python loop (codec._slice_bytes)
                native = readhash._native
                readhash._native = None  # these rows: the Python loop, as where galahad._readhash is not built
                for kib in (512, 1024, 2048, 4096):
                    codec._slices[:] = [kib << 10]
                    for ft in sorted({8, cores}):
                        s = services[ft]
                        row[f"plain_ft{ft}_s{kib}_gbs"] = round(
                            nbytes / _timed(lambda: s.load_part(key, 0, out=out)) / 1e9, 1)
                codec._slices[:] = []
                readhash._native = native
                row["compiled_loop"] = native is not None  # the plain_ftN rows: compiled, when built
                if native is not None:  # the compiled loop's read size (readhash.STEP)
                    step = readhash.STEP
                    for kib in (128, 256, 1024, 4096):
                        readhash.STEP = kib << 10
                        for ft in sorted({8, cores}):
                            s = services[ft]
                            row[f"plain_ft{ft}_c{kib}_gbs"] = round(
                                nbytes / _timed(lambda: s.load_part(key, 0, out=out)) / 1e9, 1)
                    readhash.STEP = step
            if kind == "sealed":
                was = aesgcm._OPENSSL_INTO
                aesgcm._OPENSSL_INTO = False
                try:
                    row[f"sealed_pycryptodome_ft{cores}_gbs"] = round(
                        nbytes / _timed(lambda: svc.load_part(key, 0, out=out)) / 1e9, 1)
                finally:
                    aesgcm._OPENSSL_INTO = was
            for s in services.values():
                s.close()
        emit("loadpath", f"loadpath_{n}", **row)
    emit("loadpath", "done")


def shutil_rm(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


# -- orchestration ----------------------------------------------------------------------------


def load_results(work: Path) -> list[dict[str, Any]]:
    path = work / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median(results: list[dict[str, Any]], mode: str, name: str) -> float | None:
    for r in results:
        if r.get("mode") == mode and r.get("name") == name and "median_ms" in r:
            return float(r["median_ms"])
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def summary(work: Path) -> str:
    r = load_results(work)
    rec = {n: _median(r, "recompute", f"recompute_{n}") for n in (2048, 32768)}
    warm2k = _median(r, "load-plain", "warm_2048")
    warm32k = _median(r, "load-plain", "warm_32768")
    cold2k = _median(r, "cold-plain", "cold_2048")
    fs2k = _median(r, "load-fs", "warm_2048")
    off, on, faulty = (_turns_per_s(r, m) for m in ("turns-off", "turns-on", "turns-faulty"))
    return ("gpu-bench: "
            f"warm2k_vs_recompute={_ratio(warm2k, rec[2048])} "
            f"warm32k_vs_recompute={_ratio(warm32k, rec[32768])} "
            f"cold2k_vs_recompute={_ratio(cold2k, rec[2048])} "
            f"warm2k_vs_vllm_fs={_ratio(warm2k, fs2k)} "
            f"turns_vs_off={_ratio(on, off)} turns_faulty_vs_off={_ratio(faulty, off)}")


def summary_batches(work: Path) -> list[str]:
    """The multi-turn ratios of each `-bN` workload that ran (conversations N at a time)."""
    r = load_results(work)
    sizes = sorted({turns_batch(str(x.get("mode")))[1] for x in r
                    if str(x.get("mode", "")).startswith("turns-off-b")})
    lines = []
    for n in sizes:
        off, on, faulty = (_turns_per_s(r, f"{m}-b{n}") for m in ("turns-off", "turns-on", "turns-faulty"))
        lines.append(f"gpu-bench, {n} conversations at a time: turns_vs_off={_ratio(on, off)} "
                     f"turns_faulty_vs_off={_ratio(faulty, off)}")
    return lines


def table(work: Path) -> str:
    r = load_results(work)
    lines = ["| mode | figure | tokens | median ms | cached tokens |", "| --- | --- | ---: | ---: | --- |"]
    for x in r:
        if "median_ms" in x:
            lines.append(f"| {x['mode']} | {x['name']} | {x.get('tokens', '')} | {x['median_ms']} | "
                         f"{x.get('num_cached_tokens', '')} |")
    return "\n".join(lines)


def run_all(work: Path, lens: list[int], deadline_s: float, modes: list[str]) -> None:
    end = time.time() + deadline_s
    log_dir = Path(os.environ.get("OUT", str(work)))
    for mode in modes:
        left = end - time.time()
        base = turns_batch(mode)[0] if mode.startswith("turns-") else mode.partition("~")[0]
        default = MODE_BUDGET_S["turns-on"] if base.startswith("turns-") else 120  # e.g. turns-yield100
        budget = min(MODE_BUDGET_S.get(base, default) * (2 if 32768 in lens else 1), left)
        if budget < 30:
            print(f"skip {mode}: {left:.0f} s left", flush=True)
            continue
        t0 = time.time()
        cmd = [sys.executable, __file__, mode, str(work), "--lens", ",".join(map(str, lens))]
        with open(log_dir / f"bench-{mode}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=budget).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = (log_dir / f"bench-{mode}.log").read_text(errors="replace")
        found = [line[len("RESULT "):] for line in text.splitlines() if line.startswith("RESULT ")]
        with open(work / "results.jsonl", "a") as f:
            for line in found:
                f.write(line + "\n")
        print(f"=== {mode}: rc={rc} {time.time() - t0:.0f}s", flush=True)
        for line in found:
            print("   ", line[:300], flush=True)
        if rc != 0:
            errs = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln][-6:]
            print("\n".join("   ! " + e[:300] for e in errs), flush=True)
    print(table(work), flush=True)
    for line in summary_batches(work):
        print(line, flush=True)
    print(summary(work), flush=True)


def plot(work: Path, path: Path) -> str:
    """Time to first token per mode and length (log scale), and multi-turn turns/s per mode,
    from WORK/results.jsonl; written to `path` (needs matplotlib: the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: matplotlib not installed (pip install .[bench])"
    r = load_results(work)
    rows = [("recompute", "recompute_{}"), ("gpuhit", "gpuhit_{}"), ("load-plain", "warm_{}"),
            ("load-plain~nopreload", "warm_{}"), ("load-sealed", "warm_{}"), ("cold-plain", "cold_{}"),
            ("load-fs", "warm_{}")]
    labels = {"recompute": "recompute", "gpuhit": "vLLM's own hit on the GPU (the floor)",
              "load-plain": "Galahad plain, warm", "load-plain~nopreload": "Galahad plain, warm, nothing read ahead",
              "load-sealed": "Galahad sealed, warm", "cold-plain": "Galahad plain, cold", "load-fs": "vLLM fs tier, warm"}
    # the two new rows only where they were run (the third to twenty-fourth sessions' plots had neither)
    rows = [(m, n) for m, n in rows if m not in ("gpuhit", "load-plain~nopreload") or any(x.get("mode") == m for x in r)]
    lens = sorted({int(x["tokens"]) for x in r if "median_ms" in x and x.get("mode") != "transfer"
                   and str(x.get("name", "")).split("_")[0] in ("recompute", "warm", "cold")})
    any_turns = any(str(x.get("mode", "")).startswith("turns-") for x in r)
    bx = None
    if lens:
        if any_turns:
            fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
        else:  # no multi-turn runs: the load modes alone
            fig, ax = plt.subplots(1, 1, figsize=(9, 4.5))
        width = 0.8 / max(1, len(rows))
        for k, (mode, name) in enumerate(rows):
            ms = [_median(r, mode, name.format(n)) for n in lens]
            xs = [i + k * width for i in range(len(lens))]
            ax.bar(xs, [m or 0 for m in ms], width, label=labels[mode])
        ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(lens))], [f"{n:,} tokens" for n in lens])
        ax.set_yscale("log")
        ax.set_ylabel("time to first token after a restart, ms (log)")
        ax.legend(fontsize=8)
    else:  # multi-turn modes only
        fig, bx = plt.subplots(1, 1, figsize=(6, 4.5))
    turn_modes = sorted({str(x["mode"]) for x in r if str(x.get("mode", "")).startswith("turns-")},
                        key=lambda m: (turns_batch(m)[1], ("turns-off", "turns-on", "turns-faulty").index(turns_batch(m)[0])
                                       if turns_batch(m)[0] in ("turns-off", "turns-on", "turns-faulty") else 9, m))
    modes = [m for m in turn_modes if _turns_per_s(r, m) is not None]
    colours = {"turns-off": "grey", "turns-on": "tab:blue", "turns-faulty": "tab:orange"}
    if bx is not None:
        bx.bar([m.replace("turns-", "").replace("-b", "\n") for m in modes], [_turns_per_s(r, m) or 0 for m in modes],
               color=[colours.get(turns_batch(m)[0], "tab:green") for m in modes])
        bx.set_ylabel("multi-turn: turns/s after the first round")
        bx.set_xlabel("conversations at a time: all (24), or the number under the mode", fontsize=8)
    fig.suptitle("bench/gpu.py: one H200, vLLM 0.26, Qwen3-8B shape")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode")
    ap.add_argument("work")
    ap.add_argument("--lens", default="2048,8192")
    ap.add_argument("--deadline-s", type=float, default=480)
    ap.add_argument("--modes", default=",".join(ORDER))
    ap.add_argument("--png", default=None, help="the plot (default WORK/gpu-bench.png)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    lens = [int(x) for x in args.lens.split(",") if x]
    png = Path(args.png) if args.png else work / "gpu-bench.png"
    if args.mode == "all":
        run_all(work, lens, args.deadline_s, args.modes.split(","))
        print(plot(work, png), flush=True)
        for line in compare_answers(work):  # token identity of every turns run, per conversation
            print(line, flush=True)
    elif args.mode == "summary":
        print(table(work))
        for line in summary_batches(work):
            print(line)
        print(summary(work))
        print(plot(work, png))
    elif args.mode == "answers":  # the turns runs' answers side by side (GALAHAD_BENCH_LOGPROBS=1)
        for line in compare_answers(work):
            print(line)
    else:
        run_mode(args.mode, work, lens)


if __name__ == "__main__":
    main()
