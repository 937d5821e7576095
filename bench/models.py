"""Model matrix: which architectures does Galahad cache on vLLM's CPU build, and are the answers
token-identical after a restart?

    python bench/models.py [--only llama,gemma2,...] [--tp2 llama,...|none] [--out DIR]

For every architecture below, a small model with random weights is built locally from its
`transformers` config class (no model hub) and served by real vLLM (its offline `LLM`, float32) in
four processes: vLLM alone, twice (the reference answers, and whether vLLM alone gives the same
answers twice: where it does not, the model's row says so and nothing is compared), vLLM with
Galahad and a fresh sealed store (it answers and saves), and a new vLLM process with Galahad on the
same store (after the restart: it loads, and answers). With one rank and two cores or more, the two
runs of vLLM alone go on the second core beside the two with Galahad. The architectures of `--tp2`
are measured again with two tensor-parallel ranks (every process of their row). A row records
whether the model answered, what Galahad saved (`bytes_saved`, bytes per token), whether the
restarted process loaded it (`hits_disk`), whether its answers are the reference's token for token,
the KV cache groups vLLM made, and the time. A model Galahad cannot cache says why in its startup
line (`NOT CACHING` or `hybrid KV plan unavailable`) and is served normally: that is a row too,
never a crash, never a wrong answer.

Outputs go to `--out DIR` (default bench/out/models-<YYYYmmdd-HHMMSS>/): `models.json`,
`models.md` (the table docs/models.md shows), a folder per architecture with its model and the
four logs. The last line is
`models-bench: cached=N identical=M not_cached=K not_comparable=C failed=F`: F counts the architectures that
crashed with Galahad attached, answered otherwise than vLLM alone, or loaded nothing after the
restart (it must be 0). docs/models.md shows a run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))  # the tests' vLLM runner and licences

sys.path.insert(0, str(HERE))  # bench/plot.py, then off the path again (the tests load this module)
try:
    from plot import run_folder  # noqa: E402
finally:
    del sys.path[0]

VOCAB = 2048
BASE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE: dict[str, Any] = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                           n_routed_experts=4, shared_expert_intermediate_size=128)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
RUN_KEYS = ("dtype", "llm")

# model_type -> (kind, config overrides). Kinds: dense, moe, mla, sliding, hybrid. Two keys are
# not the model's config: `dtype` (the weights' and vLLM's, default float32) and `llm` (vLLM
# settings of this architecture's row).
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("dense", {}),
    "mistral": ("dense", {"sliding_window": None}),
    "qwen2": ("dense", {}),
    "qwen3": ("dense", {}),
    "gemma": ("dense", {"tie_word_embeddings": True}),
    "gemma2": ("sliding", {"sliding_window": 128, "query_pre_attn_scalar": 64, "tie_word_embeddings": True}),
    "gemma3_text": ("sliding", {"sliding_window": 128, "query_pre_attn_scalar": 64,
                                "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("dense", {}),
    "olmo": ("dense", {}),
    "olmo2": ("dense", {}),
    "glm": ("dense", {}),
    "glm4": ("dense", {}),
    "granite": ("dense", {}),
    "starcoder2": ("dense", {"sliding_window": None}),
    "cohere": ("dense", {"tie_word_embeddings": True}),
    "stablelm": ("dense", {}),
    # GPT-NeoX has no grouped-query attention: its config ignores `num_key_value_heads`, but
    # vLLM's Transformers backend reads the key and would size the KV cache for 2 heads while the
    # model writes 4 (vLLM then writes each token's KV into the wrong slots, cached ones too)
    "gpt_neox": ("dense", {"num_key_value_heads": 4}),
    "phi": ("dense", {}),
    "exaone4": ("dense", {}),
    "seed_oss": ("dense", {}),
    "ernie4_5": ("dense", {}),
    "nemotron": ("dense", {}),
    "mistral-sliding": ("sliding", {"sliding_window": 128}),
    "cohere2": ("sliding", {"sliding_window": 128, "sliding_window_pattern": 2, "tie_word_embeddings": True}),
    "qwen2_moe": ("moe", MOE),
    "qwen3_moe": ("moe", MOE),
    "mixtral": ("moe", MOE),
    "granitemoe": ("moe", MOE),
    "olmoe": ("moe", MOE),
    "phimoe": ("moe", {**MOE, "moe_intermediate_size": 512}),  # its experts are `intermediate_size` wide
    # vLLM's reference CPU MLA backend on every machine: on a CPU with AMX vLLM would pick its AMX
    # backend, which takes bfloat16 weights only
    "deepseek_v2": ("mla", {**MOE, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                            "qk_nope_head_dim": 64, "v_head_dim": 64, "first_k_dense_replace": 1,
                            "n_shared_experts": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                            "llm": {"attention_backend": "CPU_MLA"}}),
    "qwen3_next": ("hybrid", {**MOE, "num_hidden_layers": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "dtype": "bfloat16"}),
    # Mamba-2 hybrids: vLLM's CPU build cannot keep a state per block (its scan returns no
    # intermediate states, and prefill fails with prefix caching on), so they are served without
    # prefix caching, where Galahad has no state to store: each says so at startup and is served
    "granitemoehybrid": ("hybrid", {**MOE, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
                                    "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 16,
                                    "mamba_n_groups": 1, "mamba_expand": 2, "llm": NO_PREFIX_CACHE}),
    "falcon_h1": ("hybrid", {"mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_ssm": 512, "mamba_d_state": 16,
                             "mamba_n_groups": 1, "llm": NO_PREFIX_CACHE}),
    "jamba": ("hybrid", {**MOE, "num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
                         "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 16}),
    "bamba": ("hybrid", {"num_hidden_layers": 2, "attn_layer_indices": [1], "mamba_n_heads": 8,
                         "mamba_d_head": 64, "mamba_d_state": 16, "mamba_n_groups": 1}),
    "nemotron_h": ("hybrid", {"num_hidden_layers": 2, "hybrid_override_pattern": "M*", "mamba_num_heads": 8,
                              "mamba_head_dim": 64, "ssm_state_size": 16, "n_groups": 1, "llm": NO_PREFIX_CACHE}),
    "lfm2": ("hybrid", {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "conv_dim": 256,
                        "block_dim": 256, "block_ff_dim": 512}),
}

# served again with two tensor-parallel ranks: dense, sliding window, mixture of experts, state
TP2 = ["llama", "qwen2", "gemma3_text", "mixtral", "qwen3_next"]


def build(model_type: str, overrides: dict[str, Any], root: Path) -> str:
    """A random-weight model of `model_type` with the demo's word-level tokenizer, built once."""
    from galahad.cli.demo import _write_tokenizer  # noqa: PLC2701 - the tokenizer the tests use

    folder = root / "models" / model_type
    if (folder / "done").exists():
        return str(folder)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    real_type = model_type.split("-")[0]
    torch.manual_seed(0)
    config = AutoConfig.for_model(real_type, **{**BASE, **{k: v for k, v in overrides.items() if k not in RUN_KEYS}})
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, overrides.get("dtype", "float32")))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    _write_tokenizer(folder, VOCAB)
    (folder / "done").write_text("ok\n")
    return str(folder)


def _prompts() -> list[dict[str, Any]]:
    from galahad.cli.demo import prompt_ids

    return [{"ids": prompt_ids(330, seed, VOCAB), "max_tokens": 8} for seed in (1, 2)]


_VAGUE = ("Engine core initialization failed", "EngineDeadError", "See stack trace")  # say no cause


def _root_cause(text: str) -> str:
    """The last `SomethingError: message` line of a failed run's log, shortened."""
    found = [line.split("] ", 1)[-1].strip() for line in text.splitlines()
             if "Error: " in line and not any(vague in line for vague in _VAGUE)]
    return (found[-1] if found else text.strip().splitlines()[-1])[:160]


def _groups(log: str) -> str:
    """The KV cache groups as Galahad's startup line names them: `full attention`, or for a
    hybrid plan each group's kind (`sliding window of 128 tokens + full attention`)."""
    import re

    for line in log.splitlines():
        if "hybrid KV manager ON" in line:
            kinds = re.findall(r"group \d+ \([^)]*\): ([^,;]+)", line)
            counted = dict.fromkeys(kinds, 0)  # in order of first appearance
            for kind in kinds:
                counted[kind] += 1
            return " + ".join(kind if n == 1 else f"{n} x {kind}" for kind, n in counted.items())
    return "full attention" if "caching ENABLED" in log else ""


def _refusal(log: str) -> str:
    for marker in ("hybrid KV plan unavailable: ", "NOT CACHING: "):
        for line in log.splitlines():
            if marker in line:
                return line.split(marker, 1)[1].strip()[:200]
    return ""


def run_one(name: str, kind: str, overrides: dict[str, Any], out: Path, tp: int = 1) -> dict[str, Any]:
    """One row: `name` served with `tp` tensor-parallel ranks (on vLLM's CPU build, a core each)."""
    from vllm_support.harness import GalahadEnv, kv_config, run_offline
    from vllm_support.licence import make_licence

    row: dict[str, Any] = {"arch": name, "kind": kind, "tp": tp}
    t0 = time.monotonic()
    work = out / (name if tp == 1 else f"{name}-tp{tp}")
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = build(name, overrides, out)
    except Exception as exc:  # noqa: BLE001 - a row: transformers cannot build it here
        row.update(status="not built", reason=f"{type(exc).__name__}: {exc}"[:200])
        return row
    # a prompt at a time: every run gives each prompt the same batch, so a difference can only
    # come from its KV
    phases = [[prompt] for prompt in _prompts()]
    # vLLM's defaults otherwise (prefix caching on: hybrid models keep a state per block only so);
    # float32, except where vLLM's CPU kernels take bfloat16 only (the config's `dtype`)
    llm = {"max_model_len": 2048, "dtype": overrides.get("dtype", "float32"), "tensor_parallel_size": tp,
           **overrides.get("llm", {})}
    cores = "|".join(str(rank) for rank in range(tp))  # one core per rank
    # With one rank and a core to spare, the runs of vLLM alone (on the next core) go beside the
    # runs with Galahad: a row takes half the time
    beside = tp == 1 and len(os.sched_getaffinity(0)) >= 2
    alone = {"VLLM_CPU_OMP_THREADS_BIND": "1" if beside else cores, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env = GalahadEnv(work / "galahad", VLLM_CPU_OMP_THREADS_BIND=cores)
    if tp > 1:  # a licence for as many GPUs as ranks
        env.vars.update(zip(("GALAHAD_LICENCE_FILE", "GALAHAD_LICENCE_ISSUER_KEY"),
                            make_licence(env.root / "licence", points=tp, name=f"tp{tp}.lic")))

    def references() -> tuple[dict[str, Any], dict[str, Any]]:
        run = functools.partial(run_offline, model, phases, None, llm=llm, workdir=work, timeout=600, extra_env=alone)
        return run(name="reference"), run(name="reference-again")

    def with_galahad() -> tuple[dict[str, Any], dict[str, Any]]:
        run = functools.partial(run_offline, model, phases, env, kv=kv_config(), llm=llm, timeout=600)
        return run(name="first"), run(name="restart")

    with ThreadPoolExecutor(2 if beside else 1) as pool:  # one worker: vLLM alone first, then Galahad
        alone_runs, galahad_runs = pool.submit(references), pool.submit(with_galahad)
        try:
            ref, again = alone_runs.result()
        except Exception as exc:  # noqa: BLE001 - a row: vLLM's CPU build does not serve it
            galahad_runs.cancel()  # not started yet where the runs go one after another
            log = work / "reference.log"
            row.update(status="vLLM cannot serve it here",
                       reason=_root_cause(log.read_text(errors="replace") if log.exists() else str(exc)),
                       seconds=round(time.monotonic() - t0, 1))
            return row
        try:
            first, second = galahad_runs.result()
        except Exception as exc:  # noqa: BLE001 - a crash with Galahad attached: the failure to report
            row.update(status="FAILED with Galahad", reason=traceback.format_exception_only(exc)[-1].strip()[-300:],
                       seconds=round(time.monotonic() - t0, 1))
            return row
    tokens = [[o["token_ids"] for phase in run["phases"] for o in phase] for run in (ref, first, second, again)]
    saved = first["counters"][-1] if first["counters"] else {}  # totals since start, after the last phase
    loaded = second["counters"][-1] if second["counters"] else {}
    refusal = _refusal(first["log"])
    row.update(
        groups=_groups(first["log"]), saved_bytes=int(saved.get("bytes_saved", 0)),
        bytes_per_token=round(saved.get("bytes_saved", 0) / max(1, loaded.get("tokens_loaded", 0))),
        hits_disk=int(loaded.get("hits_disk", 0)), tokens_loaded=int(loaded.get("tokens_loaded", 0)),
        identical=tokens[0] == tokens[1] == tokens[2], seconds=round(time.monotonic() - t0, 1),
    )
    if tokens[3] != tokens[0]:  # two runs of vLLM alone disagree: no answer to compare with
        row.update(status="not comparable", identical=None,
                   reason="vLLM alone answers differently from run to run on this build (nondeterministic)")
    elif not row["identical"]:  # cached or not, an answer that is not vLLM's own is a failure
        row["status"] = "FAILED: wrong answer"
    elif refusal:
        row.update(status="not cached", reason=refusal)
    elif row["hits_disk"]:
        row["status"] = "cached"
    else:
        row["status"] = "FAILED: nothing loaded"
    return row


def markdown(rows: list[dict[str, Any]], vllm_version: str, command: str) -> str:
    lines = ["| architecture | kind | TP | KV cache groups | saved, bytes per token | loaded after restart | identical tokens | status |",
             "|---|---|---:|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['arch']}` | {r['kind']} | {r.get('tp', 1)} | {r.get('groups', '') or '-'} | "
                     f"{r.get('bytes_per_token', '-') if r.get('saved_bytes') else '-'} | "
                     f"{'yes (' + str(r['tokens_loaded']) + ' tokens)' if r.get('hits_disk') else 'no'} | "
                     f"{'yes' if r.get('identical') else ('no' if r.get('identical') is False else '-')} | "
                     f"{r['status']}{': ' + r['reason'] if r.get('reason') else ''} |")
    return "\n".join(lines) + f"\n\nvLLM {vllm_version} (CPU build), `{command}`.\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated architectures (default: all)")
    ap.add_argument("--tp2", default=",".join(TP2),
                    help=f"comma-separated architectures also served with two tensor-parallel ranks "
                         f"(default: {','.join(TP2)}; 'none': none)")
    ap.add_argument("--out", help="output folder (default: bench/out/models-<time>)")
    args = ap.parse_args()
    out = run_folder("models", args.out)
    names = args.only.split(",") if args.only else list(ARCHS)
    tp2 = [] if args.tp2 == "none" else [n for n in args.tp2.split(",") if not args.only or n in names]
    rows = []
    for name, tp in [(n, 1) for n in names] + [(n, 2) for n in tp2]:
        kind, overrides = ARCHS[name]
        row = run_one(name, kind, overrides, out, tp)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "models.json").write_text(json.dumps(rows, indent=1))
    import vllm

    table = markdown(rows, vllm.__version__, "python bench/models.py")
    (out / "models.md").write_text(table)
    print(table)
    count = lambda s: sum(1 for r in rows if r["status"].startswith(s))  # noqa: E731
    print(f"models-bench: cached={count('cached')} identical={sum(1 for r in rows if r.get('identical'))} "
          f"not_cached={count('not cached')} not_comparable={count('not comparable')} failed={count('FAILED')}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
