"""GPU benchmark: what does Galahad change for a vLLM server on a GPU? Time to first token after a
restart (KV loaded from Galahad's store instead of recomputed), and the throughput of a multi-turn
workload whose conversations no longer fit in the GPU's KV cache. One H200, vLLM 0.26.

    python bench/gpu.py all [--out DIR] [--store DIR] [--lens 2048,8192,32768] [--modes M,M,...]
                            [--deadline-s S]
    python bench/gpu.py MODE --out DIR [--store DIR] [--lens ...]   # one mode (what `all` runs)
    python bench/gpu.py summary --out DIR                           # the report of a run again

Model: Qwen3-8B shape from its config only (`load_format="dummy"`, bf16, FlashAttention 3;
nothing compiled, every step of up to 512 tokens replayed as a CUDA graph, `cudagraph_mode=FULL`,
so the few tokens a hit leaves to compute take one graph replay). Every mode is its own process,
so each load really is a restarted engine reading a store another process wrote; the page cache
is warm (written just before: a redeploy on one machine), then dropped
(`/proc/sys/vm/drop_caches`, needs root) for the cold figures. Per length, distinct prompts are
stored (five up to 2k tokens, three up to 8k, one at 32k) and the median is reported.

Modes (`all` runs them in this order, each in its own process, within its time budget):
`recompute` (no connector), `cold-recompute` (no connector, the page cache dropped after the
engine started, as the `cold-*` modes do: vLLM alone in the state a cold hit meets), `gpuhit`
(no connector: vLLM's own prefix cache hit on the GPU, the same prompt again in one process: the
floor of any hit), `store-plain`/`load-plain`/`cold-plain` (Galahad, xxh3 checksums),
`store-sealed`/`load-sealed`/`cold-sealed` (Galahad, AES-256-GCM),
`store-fs`/`load-fs`/`cold-fs` (vLLM's OffloadingConnector with its `fs` tier; `store-*` time
new prompts answered one after another while their saves are written, each length once the saves
of the one before are durable, the 32k-token one the first of its process; `cold-*` drop the
page cache before their first hit, since vLLM's CPU tier, filled by the warm hits of `load-fs`,
would otherwise answer them; Galahad's cold modes read nothing ahead at startup,
GALAHAD_PRELOAD_BYTES=0, so they time the load itself), and the multi-turn modes `turns-off` (no
connector), `turns-on` (Galahad, sealed), `turns-faulty` (Galahad, sealed, with a third of its
loads failing on purpose, GALAHAD_FAULT_LOAD_RATE=0.33: they are recomputed) and `turns-slow`
(Galahad, sealed, on a disk slower than the saves: every part waits 50 ms on its save thread
before it is written, GALAHAD_TEST_SAVE_DELAY=0:0.05).

Every figure is a line of OUT/results.jsonl; logs go to OUT/logs/, the plot to OUT/gpu-bench.png;
OUT is `--out DIR`, default bench/out/gpu-<YYYYmmdd-HHMMSS>/. The stores and the model's config
go to `--store DIR` (default OUT/store; tens of GB with 32k-token prompts). docs/benchmarks.md
("GPU") shows a run.

The report ends with two ratio lines, `n/a` where a mode did not run. The last is the documented
deployment, sealed stores: `gpu-bench: new2k_sealed_vs_recompute=N
first32k_sealed_vs_recompute=F turns_round0_sealed_vs_off=R0 turns_sealed_vs_off=T
turns_faulty_sealed_vs_off=TF turns_slow_round0_sealed_vs_off=S0 turns_slow_sealed_vs_off=S
slow_saves_skipped=K cold2k_sealed_vs_recompute=C warm2k_sealed_vs_recompute=W
warm32k_sealed_vs_recompute=W32 warm2k_sealed_vs_vllm_fs=FS cold2k_sealed_vs_cold_recompute=CC`.
N and F are what saving costs a request, time to first token of new prompts over the same
without Galahad (1.00: nothing); R0, T and TF are multi-turn turns a second with Galahad over
without (above 1: more): the first round (every conversation new, all saved, nothing loaded; 48
new conversations in two batches), the later ones, and the later ones with a third of the loads
failing; S0 and S the first round and the later ones on the slow disk, K the parts it skipped
there; C, W and W32 are time to first token after a restart over recomputing (below 1: sooner),
for a 2k-token prompt from the disk, from a warm page cache, and a 32k-token one; FS is
Galahad's warm 2k time over vLLM's fs tier's (below 1: Galahad is faster); CC is the cold 2k
time over `cold-recompute`'s: what the cold hit adds to recomputing on a machine whose page
cache was dropped as well (1.00: nothing). The line before it, `gpu-bench-plain:`, gives the
restart ratios with plain (checksummed) stores. Before them, one line per multi-turn run says
whether its answers are token for token those of `turns-off`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/plot.py, then off the path again:
try:  # the tests load this module: leave their import path as it was
    from plot import PLOT_SKIPPED, pyplot, run_folder
finally:
    del sys.path[0]

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
MODE_BUDGET_S = {"recompute": 100, "cold-recompute": 100, "gpuhit": 60,  # seconds a mode may take (2x with 32k)
                 "store-plain": 150, "load-plain": 100, "cold-plain": 100,
                 "store-sealed": 150, "load-sealed": 100, "cold-sealed": 100,
                 "store-fs": 150, "load-fs": 100, "cold-fs": 100,
                 "turns-off": 150, "turns-on": 150, "turns-faulty": 150, "turns-slow": 150}  # fmt: skip
ORDER = list(MODE_BUDGET_S)  # what `all` runs, in this order
TURNS_MODES = ("turns-off", "turns-on", "turns-faulty", "turns-slow")

_results: Path | None = None  # OUT/results.jsonl: every `emit` appends its line there


def seeds_for(n: int) -> list[int]:
    """Stored prompts of length n (the median is reported): five up to 2k (a request of 30-50 ms
    moves by a few ms from one to the next), three up to 8k, one at 32k. A restarted engine reads
    the most recent entries into its pinned arena (6.6 GiB with 32k-token prompts): five 2k entries
    and the 32k one fit there together, nine do not, and the warm figures would time the page
    cache for some."""
    return [1000 * n + s for s in range(5 if n <= 2048 else SEEDS if n <= 8192 else 1)]


def emit(mode: str, name: str, **kw: Any) -> None:
    """One figure: printed (`RESULT {json}`) and appended to OUT/results.jsonl in one write."""
    line = json.dumps({"mode": mode, "name": name, **kw})
    print("RESULT " + line, flush=True)
    if _results is not None:
        with open(_results, "a") as handle:
            handle.write(line + "\n")


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


def _galahad_env(store: Path, variant: str) -> dict[str, str]:
    """Galahad's settings for one store (`plain`, `sealed`, or a turns mode's own): sealed with
    a key, as documented, except `plain` (xxh3 checksums)."""
    root = store / f"galahad-{variant}"
    env = {"GALAHAD_CACHE_DIR": str(root / "store"), "GALAHAD_MIN_TOKENS": "256"}
    if variant != "plain":
        env["GALAHAD_KEY_FILE"] = str(root / "store.key")
    lic = root / "licence"
    if not (lic / "licence.lic").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
        from vllm_support.licence import make_licence

        make_licence(lic, points=1)  # one GPU, one rank
    env.update(GALAHAD_LICENCE_FILE=str(lic / "licence.lic"), GALAHAD_LICENCE_ISSUER_KEY=str(lic / "issuer.pub"))
    return env


def _kv_config(mode: str, store: Path) -> dict[str, Any] | None:
    if mode.endswith("-fs"):
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 30,
                    "secondary_tiers": [{"type": "fs", "root_dir": str(store / "vllm-fs")}]}}
    if mode in ("recompute", "cold-recompute", "gpuhit", "turns-off"):
        return None
    return {"kv_connector": "GalahadConnector", "kv_connector_module_path": "galahad_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def make_llm(mode: str, store: Path, lens: list[int], kv_bytes: int | None = None) -> Any:
    from vllm import LLM

    kv = _kv_config(mode, store)
    if kv is not None and kv["kv_connector"] == "GalahadConnector":
        from galahad.adapters.vllm import compat
        from galahad.adapters.vllm.registration import register_connector

        register_connector()
        compat.install()
    model = store / "qwen3_8b_shape"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    kw: dict[str, Any] = {"kv_transfer_config": kv} if kv else {}
    # every step of up to 512 tokens replays a CUDA graph (FlashAttention 3 captures mixed prefill
    # and decode batches), nothing compiled
    kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL",
                                "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}
    t = time.perf_counter()

    def start(**extra: Any) -> Any:
        return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=max(lens) + 512, gpu_memory_utilization=0.25, max_num_seqs=16, seed=0,
                   generation_config="vllm", attention_backend="FLASH_ATTN",
                   kv_cache_memory_bytes=kv_bytes or ((16 << 30) if max(lens) > 8192 else (8 << 30)), **extra)

    engine = "graphs"
    try:
        llm = start(**kw)
    except Exception as exc:  # noqa: BLE001 - graphs refused here: the figures say eager
        emit(mode, "engine_fallback", error=str(exc)[:300])
        kw.pop("compilation_config", None)
        engine = "eager"
        llm = start(enforce_eager=True, **kw)
    try:  # what vLLM made of the setting (it may lower a CUDA graph mode the backend cannot do)
        graphs = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    except AttributeError:
        graphs = "?"
    emit(mode, "engine_startup", s=round(time.perf_counter() - t, 1), engine=engine, cudagraph_mode=graphs)
    return llm


def ttft(llm: Any, toks: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": toks}], sp, use_tqdm=False)
    return round((time.perf_counter() - t) * 1000, 2), int(out[0].num_cached_tokens)


def series(llm: Any, mode: str, name: str, n: int, seeds: list[int]) -> None:
    ms, cached = [], []
    for s in seeds:
        m, c = ttft(llm, prompt(s, n))
        ms.append(m)
        cached.append(c)
    emit(mode, name, tokens=n, ms=ms, median_ms=statistics.median(ms), num_cached_tokens=cached)


def settle(llm: Any, mode: str, store: Path, *, final: bool = True) -> None:
    """Keep the engine stepping (tiny prompts) until every save is durable, or 90 s; `final`: then
    emit how long it took. Galahad says when through vLLM's connector API (`has_pending_push_work`:
    saves shipped and not yet committed); for vLLM's fs tier, the files stop growing."""
    t0, last = time.time(), None
    connector = _connector(llm)
    galahad = mode.endswith(("-plain", "-sealed"))
    folder = Path(os.environ["GALAHAD_CACHE_DIR"]) if galahad else store / "vllm-fs"
    while time.time() - t0 < 90:
        ttft(llm, prompt(int(time.time() * 1000) % 100000, 32))
        time.sleep(0.2)
        if connector is not None:
            if not connector.has_pending_push_work():
                break
        else:  # the files stop growing
            cur = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
            if cur == last and cur > 0:
                break
            last = cur
    if final:
        emit(mode, "settled", s=round(time.time() - t0, 1))


def _connector(llm: Any) -> Any:
    """The engine's Galahad connector (its scheduler side: the engine runs in this process,
    VLLM_ENABLE_V1_MULTIPROCESSING=0), or None (no Galahad)."""
    try:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        return None
    return connector if type(connector).__name__ == "GalahadConnector" else None


class _Totals(logging.Handler):
    """The line Galahad logs when the engine shuts down, `[galahad] totals since start: k=v, ...`:
    a run's counters as a user reads them. The timed modes run as deployed, without the test hook
    that writes the counters to a file every step (GALAHAD_TEST_COUNTERS_FILE)."""

    PREFIX = "[galahad] totals since start:"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.line: str | None = None
        logging.getLogger("galahad.adapters.vllm.diagnostics").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            self.line = message

    def counters(self) -> dict[str, float]:
        """The counters of the line (those it leaves out are zero)."""
        out: dict[str, float] = {}
        for item in (self.line or "")[len(self.PREFIX):].split(","):
            name, _, value = item.strip().partition("=")
            if name and value:
                out[name] = float(value) if "." in value else int(value)
        return out


def emit_counters(mode: str, llm: Any, totals: _Totals) -> None:
    """Shut the engine down (it logs Galahad's totals since start) and emit them as the mode's
    counters; nothing without Galahad."""
    if _connector(llm) is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - the figures are in; say why the counters are not
        emit(mode, "counters", missing=f"shutdown: {exc}"[:300])
        return
    if totals.line is None:
        emit(mode, "counters", missing="no totals line at shutdown")
        return
    emit(mode, "counters", **totals.counters())


def run_mode(mode: str, store: Path, lens: list[int]) -> None:
    if mode.startswith("turns-"):
        return turns_bench(mode, store)
    variant = mode.split("-", 1)[1] if "-" in mode else ""
    if mode.startswith("cold-"):  # drops the page cache after the engine started: nothing read ahead
        os.environ["GALAHAD_PRELOAD_BYTES"] = "0"
    totals = _Totals()
    if variant in ("plain", "sealed"):
        os.environ.update(_galahad_env(store, variant))
    llm = make_llm(mode, store, lens)
    ttft(llm, prompt(9, 1024))  # warm-up: first-request costs stay out of the figures
    stored = {n: seeds_for(n) for n in lens}
    if mode == "recompute":
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
        # each length's series starts with every earlier save durable: what one length's saves
        # cost is not measured on the saves of the length before (nine 2k prompts are 2.7 GB to
        # write, and a pinned buffer they hold is not there for the 32k prompt's 4.8 GB)
        for i, n in enumerate(lens):
            if i:
                settle(llm, mode, store, final=False)
            series(llm, mode, f"store_{n}", n, stored[n])
        settle(llm, mode, store)
    else:  # load-* and cold-*
        kind = mode.split("-", 1)[0]
        if kind == "cold":
            emit(mode, "drop_caches", ok=drop_caches())
        for n in lens:
            series(llm, mode, f"{'warm' if kind == 'load' else 'cold'}_{n}", n, stored[n])
    emit_counters(mode, llm, totals)
    emit(mode, "done")


TURNS = {"conversations": 24, "first_tokens": 3072, "turn_tokens": 256, "answer_tokens": 16,
         "rounds": 4, "first_batches": 2, "kv_bytes": 3 << 30}


def turns_bench(mode: str, store: Path) -> None:
    """A multi-turn workload: conversations whose every turn resends the whole history plus a new
    message, more of them than the GPU's KV cache holds (3 GiB: about 21k tokens of this model),
    so vLLM's own prefix cache has evicted a conversation by the time its next turn comes.
    Each round sends every conversation's next turn at once (a server with 24 users, each sending
    a turn when the last answer came back; vLLM batches them as they fit). Turns a second over the
    rounds after the first (the first computes and saves every conversation). The first round is
    timed over `first_batches` batches of new conversations: the extra ones are sent first and not
    continued (one batch takes about 2.4 s, which moves by a few percent from one process to the
    next). A short prompt (below GALAHAD_MIN_TOKENS: nothing saved) runs first, so the first
    request's costs of the process stay out of the figures. Each answer token's log-probability
    and lead over the runner-up are kept, for `compare_answers`."""
    from vllm import SamplingParams

    cfg = TURNS
    for old in ["galahad-plain", "galahad-sealed", "vllm-fs"] + [p.name for p in store.glob("galahad-turns-*")]:
        shutil.rmtree(store / old, ignore_errors=True)  # what ran before: free the disk
    if mode != "turns-off":
        env = _galahad_env(store, mode)
        env["GALAHAD_MIN_TOKENS"] = "1024"
        # A conversation resends its history: chunk order stores each 64 tokens once, so a turn
        # writes only what is new (layer order would write the whole history again every turn).
        env["GALAHAD_PAYLOAD_ORDER"] = "chunk"
        env["GALAHAD_MAX_BYTES"] = "30G"
        if mode == "turns-faulty":
            env["GALAHAD_FAULT_LOAD_RATE"] = "0.33"
        if mode == "turns-slow":  # every part waits 50 ms on its save thread before it is written
            env["GALAHAD_TEST_SAVE_DELAY"] = "0:0.05"
        os.environ.update(env)
    emit(mode, "workload", **{k: v for k, v in cfg.items() if k != "kv_bytes"})
    totals = _Totals()
    llm = make_llm(mode, store, [cfg["first_tokens"] + cfg["rounds"] * 600], kv_bytes=cfg["kv_bytes"])
    sp = SamplingParams(max_tokens=cfg["answer_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                        logprobs=2)
    llm.generate([{"prompt_token_ids": prompt(9, 512)}], sp, use_tqdm=False)  # warm-up
    rng = random.Random(5)
    history = [[rng.randrange(1000, 150000) for _ in range(cfg["first_tokens"])]
               for _ in range(cfg["conversations"])]
    scores: list[list[list[list[float]]]] = [[] for _ in history]
    answers: list[list[list[int]]] = [[] for _ in history]
    errors = 0

    def send(prompts: list[list[int]]) -> tuple[Any, float]:
        t0 = time.perf_counter()
        try:
            outs = llm.generate([{"prompt_token_ids": h} for h in prompts], sp, use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 - a client error is counted, not fatal
            print("turn error:", exc, flush=True)
            return None, time.perf_counter() - t0
        return outs, time.perf_counter() - t0

    other = random.Random(6)
    for b in range(cfg["first_batches"] - 1):  # more new conversations for the first round's figure
        outs, took = send([[other.randrange(1000, 150000) for _ in range(cfg["first_tokens"])]
                           for _ in range(cfg["conversations"])])
        errors += outs is None
        emit(mode, f"round_0_new{b}", s=round(took, 3), turns=cfg["conversations"],
             turns_per_s=round(cfg["conversations"] / took, 2))
    for rnd in range(cfg["rounds"]):
        outs, took = send(history)
        if outs is None:
            errors += 1
            continue
        for i, out in enumerate(outs):
            answer = list(out.outputs[0].token_ids)
            answers[i].append(answer)
            scores[i].append(_token_scores(answer, out.outputs[0].logprobs))
            history[i] = history[i] + answer + [rng.randrange(1000, 150000) for _ in range(cfg["turn_tokens"])]
        emit(mode, f"round_{rnd}", s=round(took, 3), turns=len(history), turns_per_s=round(len(history) / took, 2))
    digest = hashlib.sha256(json.dumps(answers).encode()).hexdigest()[:16]
    emit(mode, "turns", errors=errors, answers_digest=digest)
    emit(mode, "answers", answers=answers, scores=scores)
    emit_counters(mode, llm, totals)
    emit(mode, "done")


def _token_scores(answer: list[int], logprobs: Any) -> list[list[float]]:
    """Per generated token: [its log-probability, its lead over the best other token]."""
    out = []
    for token, top in zip(answer, logprobs or []):
        mine = top[token].logprob
        others = [v.logprob for k, v in top.items() if k != token]
        out.append([round(mine, 5), round(mine - max(others), 5) if others else 99.0])
    return out


# -- the report -------------------------------------------------------------------------------


def load_results(out: Path) -> list[dict[str, Any]]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_answers(out: Path) -> list[str]:
    """Each multi-turn run's answers against the first `turns-off` run's: per run, the
    conversations that answered differently and, for the first token that differs in each, the
    reference's lead of its token over the runner-up, and the largest change of a shared token's
    log-probability before it. With this benchmark's dummy weights every lead is 0 to 5 decimals:
    a change in the logits' last bits changes the token. Nothing without multi-turn runs; one
    line without a `turns-off` run."""
    runs = [(r["mode"], r) for r in load_results(out) if r.get("name") == "answers"]
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
        moved_text = f"{drift:.4f}" if scored else "n/a (no log-probabilities recorded)"
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


def _turns_per_s(results: list[dict[str, Any]], mode: str, first: bool = False) -> float | None:
    """Turns a second over the rounds after the first, or (`first`) over the first round alone
    (every conversation new: everything saved, nothing to load; with its extra batches)."""
    rounds = [r for r in results if r.get("mode") == mode and str(r.get("name", "")).startswith("round_")]
    some = [r for r in rounds if r["name"].startswith("round_0") == first]
    if not some:
        return None
    return sum(r["turns"] for r in some) / sum(r["s"] for r in some)


def _median(results: list[dict[str, Any]], mode: str, name: str) -> float | None:
    for r in results:
        if r.get("mode") == mode and r.get("name") == name and "median_ms" in r:
            return float(r["median_ms"])
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def summary(out: Path) -> str:
    """The ratio lines (the module docstring says what each ratio is): plain stores, then sealed
    ones (the documented deployment), last."""
    r = load_results(out)
    rec = {n: _median(r, "recompute", f"recompute_{n}") for n in (2048, 32768)}
    fs2k = _median(r, "load-fs", "warm_2048")
    plain = {"warm2k": _median(r, "load-plain", "warm_2048"), "warm32k": _median(r, "load-plain", "warm_32768"),
             "cold2k": _median(r, "cold-plain", "cold_2048")}
    cold_rec = _median(r, "cold-recompute", "cold_2048")
    sealed = {"warm2k": _median(r, "load-sealed", "warm_2048"), "warm32k": _median(r, "load-sealed", "warm_32768"),
              "cold2k": _median(r, "cold-sealed", "cold_2048"), "new2k": _median(r, "store-sealed", "store_2048"),
              "first32k": _median(r, "store-sealed", "store_32768")}
    off, on, faulty, slow = (_turns_per_s(r, m) for m in TURNS_MODES)
    off0, on0, slow0 = (_turns_per_s(r, m, first=True) for m in ("turns-off", "turns-on", "turns-slow"))
    skipped = next((x.get("saves_skipped", 0) for x in r if x.get("mode") == "turns-slow"
                    and x.get("name") == "counters" and "missing" not in x), None)
    return ("gpu-bench-plain: "
            f"warm2k_vs_recompute={_ratio(plain['warm2k'], rec[2048])} "
            f"warm32k_vs_recompute={_ratio(plain['warm32k'], rec[32768])} "
            f"cold2k_vs_recompute={_ratio(plain['cold2k'], rec[2048])} "
            f"warm2k_vs_vllm_fs={_ratio(plain['warm2k'], fs2k)}\n"
            "gpu-bench: "
            f"new2k_sealed_vs_recompute={_ratio(sealed['new2k'], rec[2048])} "
            f"first32k_sealed_vs_recompute={_ratio(sealed['first32k'], rec[32768])} "
            f"turns_round0_sealed_vs_off={_ratio(on0, off0)} "
            f"turns_sealed_vs_off={_ratio(on, off)} turns_faulty_sealed_vs_off={_ratio(faulty, off)} "
            f"turns_slow_round0_sealed_vs_off={_ratio(slow0, off0)} turns_slow_sealed_vs_off={_ratio(slow, off)} "
            f"slow_saves_skipped={'n/a' if skipped is None else skipped} "
            f"cold2k_sealed_vs_recompute={_ratio(sealed['cold2k'], rec[2048])} "
            f"warm2k_sealed_vs_recompute={_ratio(sealed['warm2k'], rec[2048])} "
            f"warm32k_sealed_vs_recompute={_ratio(sealed['warm32k'], rec[32768])} "
            f"warm2k_sealed_vs_vllm_fs={_ratio(sealed['warm2k'], fs2k)} "
            f"cold2k_sealed_vs_cold_recompute={_ratio(sealed['cold2k'], cold_rec)}")


def table(out: Path) -> str:
    lines = ["| mode | figure | tokens | median ms | cached tokens |", "| --- | --- | ---: | ---: | --- |"]
    for x in load_results(out):
        if "median_ms" in x:
            lines.append(f"| {x['mode']} | {x['name']} | {x.get('tokens', '')} | {x['median_ms']} | "
                         f"{x.get('num_cached_tokens', '')} |")
    for mode in TURNS_MODES:
        rate = _turns_per_s(load_results(out), mode)
        if rate is not None:
            lines.append(f"| {mode} | turns/s after the first round | | {rate:.2f} | |")
    return "\n".join(lines)


def report(out: Path) -> None:
    """The table, the plot, the answers' comparison and, last, the ratio line."""
    print(table(out), flush=True)
    print(plot(out, out / "gpu-bench.png"), flush=True)
    for line in compare_answers(out):
        print(line, flush=True)
    print(summary(out), flush=True)


def plot(out: Path, path: Path) -> str:
    """Time to first token per mode and length (log scale), and multi-turn turns/s per mode,
    from OUT/results.jsonl; returns the line to print."""
    r = load_results(out)
    rows = [("recompute", "recompute_{}", "recompute"),
            ("gpuhit", "gpuhit_{}", "vLLM's own hit on the GPU (the floor)"),
            ("load-plain", "warm_{}", "Galahad plain, warm"), ("load-sealed", "warm_{}", "Galahad sealed, warm"),
            ("cold-plain", "cold_{}", "Galahad plain, cold"), ("load-fs", "warm_{}", "vLLM fs tier, warm"),
            ("cold-recompute", "cold_{}", "recompute, page cache dropped")]
    rows = [row for row in rows if any(x.get("mode") == row[0] for x in r)]
    lens = sorted({int(x["tokens"]) for x in r if "median_ms" in x
                   and str(x.get("name", "")).split("_")[0] in ("recompute", "gpuhit", "warm", "cold")})
    modes = [m for m in TURNS_MODES if _turns_per_s(r, m) is not None]
    if not (rows and lens) and not modes:
        return "plot skipped: no figures in " + str(out / "results.jsonl")
    plt = pyplot()
    if plt is None:
        return PLOT_SKIPPED
    has_ttft = bool(rows and lens)
    both = has_ttft and bool(modes)
    fig, axes = plt.subplots(1, 2 if both else 1, figsize=(12 if both else 9 if has_ttft else 6, 4.5),
                             squeeze=False, gridspec_kw={"width_ratios": [2, 1]} if both else None)
    axes = list(axes.flat)
    if has_ttft:
        ax = axes.pop(0)
        width = 0.8 / len(rows)
        for k, (mode, name, label) in enumerate(rows):
            ms = [_median(r, mode, name.format(n)) for n in lens]
            ax.bar([i + k * width for i in range(len(lens))], [m or 0 for m in ms], width, label=label)
        ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(lens))], [f"{n:,} tokens" for n in lens])
        ax.set_yscale("log")
        ax.set_ylabel("time to first token after a restart, ms (log)")
        ax.legend(fontsize=8)
    if modes:
        bx = axes.pop(0)
        colours = {"turns-off": "grey", "turns-on": "tab:blue", "turns-faulty": "tab:orange", "turns-slow": "tab:red"}
        bx.bar([m.removeprefix("turns-") for m in modes], [_turns_per_s(r, m) or 0 for m in modes],
               color=[colours[m] for m in modes])
        bx.set_ylabel("multi-turn: turns/s after the first round")
    fig.suptitle("bench/gpu.py: vLLM 0.26, Qwen3-8B shape")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# -- orchestration ----------------------------------------------------------------------------


def run_all(out: Path, store: Path, lens: list[int], deadline_s: float | None, modes: list[str]) -> None:
    """Each mode in its own process (its output in OUT/logs/MODE.log), within its time budget
    (twice that with 32k-token prompts) and what is left of `deadline_s`."""
    end = None if deadline_s is None else time.time() + deadline_s
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        left = float("inf") if end is None else end - time.time()
        budget = min(MODE_BUDGET_S.get(mode, 120) * (2 if max(lens) > 8192 else 1), left)
        if budget < 30:
            print(f"skip {mode}: {left:.0f} s left", flush=True)
            continue
        t0 = time.time()
        cmd = [sys.executable, __file__, mode, "--out", str(out), "--store", str(store),
               "--lens", ",".join(map(str, lens))]
        with open(logs / f"{mode}.log", "w") as log:
            try:
                rc: int | str = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=budget).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = (logs / f"{mode}.log").read_text(errors="replace")
        print(f"=== {mode}: rc={rc} {time.time() - t0:.0f}s", flush=True)
        for line in text.splitlines():
            if line.startswith("RESULT ") and '"name": "answers"' not in line:
                print("   ", line[len("RESULT ") :][:300], flush=True)
        if rc != 0:
            errs = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln][-6:]
            print("\n".join("   ! " + e[:300] for e in errs), flush=True)


def main(argv: list[str] | None = None) -> int:
    global _results
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", help=f"all, summary, or one of: {', '.join(ORDER)}")
    ap.add_argument("--out", default=None, help="folder for results.jsonl, logs and the plot "
                    "(default: bench/out/gpu-<YYYYmmdd-HHMMSS>)")
    ap.add_argument("--store", default=None, help="folder for the stores and the model config (default: OUT/store)")
    ap.add_argument("--lens", default="2048,8192,32768", help="prompt lengths, tokens")
    ap.add_argument("--deadline-s", type=float, default=None, help="`all`: stop starting modes after this long")
    ap.add_argument("--modes", default=",".join(ORDER), help="`all`: the modes to run, in order")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in [args.mode, *modes] if m not in (*ORDER, "all", "summary")]
    if unknown or "all" in modes or "summary" in modes:
        ap.error(f"unknown mode {', '.join(unknown or modes)}; the modes: {', '.join(ORDER)}, all, summary")
    if args.mode == "summary" and not (args.out and Path(args.out).is_dir()):
        ap.error("summary needs --out DIR, the folder of a run")
    out = run_folder("gpu", args.out)
    store = Path(args.store) if args.store else out / "store"
    lens = [int(x) for x in args.lens.split(",") if x]
    if args.mode == "all":
        store.mkdir(parents=True, exist_ok=True)
        run_all(out, store, lens, args.deadline_s, modes)
        report(out)
    elif args.mode == "summary":
        report(out)
    else:
        store.mkdir(parents=True, exist_ok=True)
        _results = out / "results.jsonl"
        run_mode(args.mode, store, lens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
