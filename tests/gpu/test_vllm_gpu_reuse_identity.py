"""A reused preamble answers as vLLM does, on the GPU: (preamble, follow-up) pairs, chunk order.

Real vLLM (0.26 on the H200 machine), a model of Qwen3-8B's layer shape (hidden 4096, 32 query and
8 KV heads of 128, MLP 12288; 4 of its 36 layers, a vocabulary of 8192: random weights, built and
saved once, so every process has the same), bfloat16, block size 16. For each pair: a server
with Galahad answers the FILL and stops; a new one answers the FOLLOW-UP, loading the preamble
from the store. vLLM alone answers the FOLLOW-UP after the FILL in one process (its own prefix
cache holding the preamble) and fresh in another. Every request runs alone in its steps.

The preambles are whole multiples of 64 tokens, so vLLM's own hit and Galahad's leave the same
tokens to compute: the claim checked is identity with vLLM's own warm path, bit for bit. In
bfloat16 that warm path can answer otherwise than a full prefill on this GPU, with or without
Galahad (`test_vllm_gpu_restart.py`); how often, the test writes beside GALAHAD_GPU_RESULTS.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))

DECODE = 24
QWEN3_8B_LAYERS = dict(
    vocab_size=8192, hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, init_std=0.02,
    max_position_embeddings=8192, seed=0, dtype="bfloat16",
)
# (preamble, follow-up length): the follow-up's answer crosses a 64-token boundary while it decodes
PAIRS = [(384, 634), (256, 1010), (512, 700), (640, 1213), (320, 445), (1024, 1150)]


def _pairs() -> list[dict[str, Any]]:
    rng = random.Random(47)
    words = list(range(3, QWEN3_8B_LAYERS["vocab_size"]))
    out = []
    for shared, length in PAIRS:
        preamble = [rng.choice(words) for _ in range(shared)]
        tail = [rng.choice(words) for _ in range(length - shared)]
        own = [rng.choice([w for w in words if w != tail[0]])] + [rng.choice(words) for _ in range(49)]
        out.append({"fill": preamble + own, "follow_up": preamble + tail, "shared": shared})
    return out


def _run(tmp: Path, name: str, model: str, phases: list[list[dict[str, Any]]], env: dict[str, str] | None
         ) -> dict[str, Any]:
    job = {
        "model": model,
        "llm": {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 4096, "seed": 0,
                "gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 4 << 30,
                "skip_tokenizer_init": True, "block_size": 16},
        "kv": {"kv_connector": "GalahadConnector", "kv_connector_module_path": "galahad_vllm.connector",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute"} if env is not None else None,
        "phases": phases, "out": str(tmp / f"{name}.json"),
        "counters_file": (env or {}).get("GALAHAD_TEST_COUNTERS_FILE"),
    }
    (tmp / f"{name}.job.json").write_text(json.dumps(job))
    with open(tmp / f"{name}.log", "w") as log:
        rc = subprocess.run([sys.executable, str(HERE / "vllm_runner.py"), str(tmp / f"{name}.job.json")],
                            env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                            timeout=600).returncode
    if rc != 0:
        pytest.fail(f"{name} exited {rc}:\n{(tmp / f'{name}.log').read_text()[-4000:]}")
    return json.loads((tmp / f"{name}.json").read_text())


def _alone(ids: list[int]) -> list[dict[str, Any]]:
    return [{"ids": ids, "max_tokens": DECODE}]


def test_a_reused_preamble_answers_as_vllms_own_prefix_hit(tmp_path: Path) -> None:
    from vllm_support.licence import make_licence
    from vllm_support.model import ModelSpec, build_model

    model = build_model(ModelSpec(QWEN3_8B_LAYERS))
    pairs = _pairs()
    lic, pub = make_licence(tmp_path / "licence")
    env = {"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_KEY_FILE": str(tmp_path / "store.key"),
           "GALAHAD_LICENCE_FILE": lic, "GALAHAD_LICENCE_ISSUER_KEY": pub, "GALAHAD_PAYLOAD_ORDER": "chunk",
           "GALAHAD_TEST_COUNTERS_FILE": str(tmp_path / "counters.json")}
    fresh = _run(tmp_path, "fresh", model, [_alone(p["follow_up"]) for p in pairs], None)
    own = _run(tmp_path, "own", model, [_alone(ids) for p in pairs for ids in (p["fill"], p["follow_up"])], None)
    _run(tmp_path, "fill", model, [_alone(p["fill"]) for p in pairs], env)
    env["GALAHAD_TEST_COUNTERS_FILE"] = str(tmp_path / "reuse.counters.json")
    reused = _run(tmp_path, "reuse", model, [_alone(p["follow_up"]) for p in pairs], env)

    answers = {
        "fresh": [ph[0]["token_ids"] for ph in fresh["phases"]],
        "own": [ph[0]["token_ids"] for ph in own["phases"][1::2]],
        "reused": [ph[0]["token_ids"] for ph in reused["phases"]],
    }
    cached = {"own": [ph[0]["num_cached_tokens"] for ph in own["phases"][1::2]],
              "reused": [ph[0]["num_cached_tokens"] for ph in reused["phases"]]}
    counters = reused["counters"][-1]
    summary = {"pairs": [(p["shared"], len(p["follow_up"])) for p in pairs], "answers": answers,
               "cached": cached, "counters": counters,
               "reused_equals_own": [a == b for a, b in zip(answers["reused"], answers["own"])],
               "reused_equals_fresh": [a == b for a, b in zip(answers["reused"], answers["fresh"])],
               "own_equals_fresh": [a == b for a, b in zip(answers["own"], answers["fresh"])]}
    dest = os.environ.get("GALAHAD_GPU_RESULTS")
    if dest:  # beside the restart test's results
        Path(dest).with_name("reuse-identity.json").write_text(json.dumps(summary))
    for ids in answers["fresh"]:
        assert len(set(ids)) > 3, ids  # context-sensitive: not one token repeated
    assert cached["reused"] == [p["shared"] for p in pairs] == cached["own"], cached
    assert counters.get("chain_hits") == len(pairs) and counters.get("load_failures", 0) == 0, counters
    assert answers["reused"] == answers["own"], summary
