"""A reused prefix answers as vLLM alone: many (preamble, follow-up) pairs, both payload orders.

Each pair is a FILL prompt and a FOLLOW-UP prompt sharing a preamble. A server with Galahad answers
every FILL (saving it) and stops; a new server answers every FOLLOW-UP, loading the shared part
from the store; vLLM alone (no connector) answers every FOLLOW-UP fresh. The greedy token ids must
be identical, and the counters must show that the preamble was loaded, not recomputed.

The lengths are drawn around the 32-token blocks and the 64-token sharing points of chunk order,
and each FOLLOW-UP's answer crosses the next 64-token boundary while it decodes. In chunk order
the FILL goes on past the preamble (any shared beginning is reused); in layer order the FILL is
the preamble itself (a conversation's next turn). Every request runs alone in its step, as a
request after a restart would.

Every process here takes the cores vLLM's CPU build chooses itself (`VLLM_CPU_OMP_THREADS_BIND`
unset), as a user's server does: vLLM lays cores out differently for a server with a KV connector,
and the model's rounding changes with its thread count (`galahad.adapters.vllm.cores`).

The pair that showed it (`vllm_support/reused_preamble_pair.json`: 684 and 634 tokens sharing
384, the bfloat16 model of `REPRO_MODEL`) runs in CI with a few drawn pairs; the larger campaign
is marked slow. The drawn pairs run in float32, as the other vLLM tests do: in bfloat16 vLLM
itself answers a prompt after a prefix hit of its own now and then otherwise than fresh.
"""

from __future__ import annotations

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from vllm_support.harness import GalahadEnv, kv_config, run_offline  # noqa: E402
from vllm_support.model import SMALL, ModelSpec, build_model  # noqa: E402

pytestmark = pytest.mark.vllm

DECODE = 24
AUTO_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "auto"}  # vLLM chooses, as in a user's server
REPRO_MODEL = ModelSpec(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, init_std=0.35,
    max_position_embeddings=8192, seed=1234, dtype="bfloat16",
)
REPRO_PAIR = json.loads((Path(__file__).resolve().parent / "vllm_support" / "reused_preamble_pair.json").read_text())


def _pair(rng: random.Random, order: str, vocab: int) -> dict[str, Any]:
    """A FILL and a FOLLOW-UP around the boundaries: the preamble (over 256 tokens, so saved in
    layer order too) ends a token before, on or after a block or sharing point; the FOLLOW-UP ends
    1 to DECODE-1 tokens before a 64-token boundary."""
    preamble_len = 64 * rng.randint(5, 9) + rng.choice((-33, -32, -31, -1, 0, 1, 31, 32, 33))
    follow_len = 64 * rng.randint(preamble_len // 64 + 2, preamble_len // 64 + 4) - rng.randint(1, DECODE - 1)
    words = list(range(3, vocab))
    preamble = [rng.choice(words) for _ in range(preamble_len)]
    tail = [rng.choice(words) for _ in range(follow_len - preamble_len)]
    fill = list(preamble)
    if order == "chunk":  # the FILL goes on past the preamble, with a first token of its own
        fill += [rng.choice([w for w in words if w != tail[0]])]
        fill += [rng.choice(words) for _ in range(rng.randint(20, 150))]
    return {"fill": fill, "follow_up": preamble + tail, "shared": preamble_len}


def _drawn(order: str, count: int) -> list[dict[str, Any]]:
    rng = random.Random(f"{order}-{count}")
    return [_pair(rng, order, SMALL["vocab_size"]) for _ in range(count)]


def _alone(prompt: list[int]) -> list[dict[str, Any]]:
    return [{"ids": prompt, "max_tokens": DECODE}]  # a phase of its own: one request in its steps


def _reused(model: str, pairs: list[dict[str, Any]], order: str, root: Path, *,
            llm: dict[str, Any] | None = None) -> tuple[list[list[int]], dict[str, Any], str]:
    """Galahad: one server answers every FILL, a new one every FOLLOW-UP; their token ids, the
    second server's counters and its log."""
    env = GalahadEnv(root, GALAHAD_PAYLOAD_ORDER=order, **AUTO_CORES)
    run_offline(model, [_alone(p["fill"]) for p in pairs], env, kv=kv_config(), llm=llm, name="fill")
    env.reset_counters()
    run = run_offline(model, [_alone(p["follow_up"]) for p in pairs], env, kv=kv_config(), llm=llm,
                      name="reuse")
    return [phase[0]["token_ids"] for phase in run["phases"]], run["counters"][-1], run["log"]


def _fresh(model: str, pairs: list[dict[str, Any]], root: Path, *,
           llm: dict[str, Any] | None = None) -> list[list[int]]:
    """vLLM alone, no connector: every FOLLOW-UP computed whole."""
    root.mkdir(parents=True, exist_ok=True)
    run = run_offline(model, [_alone(p["follow_up"]) for p in pairs], None, llm=llm, extra_env=AUTO_CORES,
                      name="fresh", workdir=root)
    return [phase[0]["token_ids"] for phase in run["phases"]]


def _check(pairs: list[dict[str, Any]], order: str, fresh: list[list[int]], reused: list[list[int]],
           counters: dict[str, Any]) -> None:
    step = 64 if order == "chunk" else 32
    expect_tokens = sum((p["shared"] - (order == "layer")) // step * step for p in pairs)
    assert counters.get("hits_disk") == len(pairs), counters
    assert counters.get("tokens_loaded") == expect_tokens, counters
    assert counters.get("load_failures", 0) == 0 and counters.get("bypassed", 0) == 0, counters
    if order == "chunk":
        assert counters.get("chain_hits") == len(pairs), counters
    differ = [(p["shared"], len(p["follow_up"]), f, r) for p, f, r in zip(pairs, fresh, reused) if f != r]
    assert not differ, f"{len(differ)} of {len(pairs)} answers differ from vLLM alone (shared, length, " \
                       f"fresh, reused): {differ}"


def _campaign(tmp_path: Path, counts: dict[str, int], *, with_repro: bool) -> None:
    model = build_model()
    drawn = {order: _drawn(order, n) for order, n in counts.items()}
    everything = [p for order in drawn for p in drawn[order]]
    with ThreadPoolExecutor(4) as pool:
        fresh_job = pool.submit(_fresh, model, everything, tmp_path / "fresh")
        reuse_jobs = {order: pool.submit(_reused, model, pairs, order, tmp_path / order)
                      for order, pairs in drawn.items()}
        if with_repro:
            repro_model = build_model(REPRO_MODEL)
            bf16 = {"dtype": "bfloat16"}
            repro = pool.submit(_reused, repro_model, [REPRO_PAIR], "chunk", tmp_path / "repro", llm=bf16)
            repro_fresh = _fresh(repro_model, [REPRO_PAIR], tmp_path / "repro-fresh", llm=bf16)
            reused, counters, _log = repro.result()
            _check([{**REPRO_PAIR, "shared": REPRO_PAIR["shared_prefix_tokens"]}], "chunk", repro_fresh,
                   reused, counters)
        fresh = iter(fresh_job.result())
        for order, pairs in drawn.items():
            reused, counters, _log = reuse_jobs[order].result()
            _check(pairs, order, [next(fresh) for _ in pairs], reused, counters)


def test_reused_preambles_answer_as_vllm_alone(tmp_path: Path) -> None:
    _campaign(tmp_path, {"chunk": 4, "layer": 3}, with_repro=True)


@pytest.mark.slow
def test_many_reused_preambles_answer_as_vllm_alone(tmp_path: Path) -> None:
    _campaign(tmp_path, {"chunk": 30, "layer": 20}, with_repro=False)
