"""Load or recompute on real vLLM (CPU build): the figures are measured for real, checked, and a
hit over the always-load size (32 MiB) is loaded after a restart, whatever the figures file says.

The model keeps 32 KiB of KV a token (float32, 8 layers of 8 KV heads of 64), so a 2048-token
entry is 64 MiB: above the 32 MiB under which every load is made unpriced, so the cost model
decides. On this CPU a 2048-token prefill takes about a second; loading 64 MiB from the page cache
takes milliseconds: every such hit must load.
"""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from galahad.adapters.vllm.advisor import LoadAdvisor  # noqa: E402
from vllm_support.harness import GalahadEnv, kv_config, run_offline  # noqa: E402
from vllm_support.model import ModelSpec, build_model, prompt_ids  # noqa: E402

pytestmark = pytest.mark.vllm

WIDE_KV = ModelSpec(
    vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, head_dim=64, init_std=0.08,
    max_position_embeddings=8192, seed=0, dtype="bfloat16",
)
A, B = prompt_ids(2049, 51), prompt_ids(2049, 52)  # layer order saves 2048 tokens of each


def _req(ids: list[int], max_tokens: int = 16) -> dict[str, Any]:
    return {"ids": ids, "max_tokens": max_tokens}


def _figures(env: GalahadEnv) -> Path:
    found = sorted(Path(env.vars["GALAHAD_CACHE_DIR"]).glob("figures-*.json"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, GalahadEnv, dict[str, Any]]:
    """A server answers A (one token: its time is the time to its first token) and B, saving both."""
    model = build_model(WIDE_KV)
    env = GalahadEnv(tmp_path_factory.mktemp("first"))
    run = run_offline(model, [[_req(A, 1)], [_req(B)]], env, kv=kv_config(), name="first")
    assert run["counters"][-1].get("committed") == 2, run["counters"][-1]
    return model, env, run


def _restart(model: str, first_env: GalahadEnv, root: Path, cores: str, figures: str | None = None
             ) -> tuple[dict[str, Any], GalahadEnv]:
    """A new server on a copy of the first one's store (and key and licence), answering B then A;
    the figures file beside the store replaced by `figures` first, if given."""
    shutil.copytree(first_env.root, root)
    env = GalahadEnv(root, VLLM_CPU_OMP_THREADS_BIND=cores)  # the copied store and key, a new licence
    env.reset_counters()
    if figures is not None:
        _figures(env).write_text(figures)
    return run_offline(model, [[_req(B)], [_req(A)]], env, kv=kv_config(), name="restart"), env


def test_the_prefill_figure_is_the_time_of_the_forward(first: tuple[str, GalahadEnv, dict[str, Any]]) -> None:
    """The figure kept for a 2048-token prompt is within a factor of two of that prompt's time to
    its first token (vLLM 0.32 starts a step's asynchronous loads after its forward: a clock
    started there read the forward as taking nothing)."""
    _model, env, run = first
    ttft = run["phases"][0][0]["seconds"]
    model = LoadAdvisor(path=str(_figures(env)), warm_up=False).model()
    assert model is not None
    figure = model.prefill.seconds(2048)
    assert ttft / 2 <= figure <= ttft * 2, (figure, ttft)


def test_hits_over_32_mib_load_after_a_restart_whatever_the_figures_file_says(
        first: tuple[str, GalahadEnv, dict[str, Any]], tmp_path: Path) -> None:
    model, env, run = first
    answers = {"A": None, "B": run["phases"][1][0]["token_ids"]}
    absurd = json.dumps({"version": 1, "prefill": [[1024, 0.0], [2048, 1e-7]], "warm_bps": 0.5,
                         "cold_bps": 1e30})
    with ThreadPoolExecutor(2) as pool:
        kept = pool.submit(_restart, model, env, tmp_path / "kept", "0")
        planted = pool.submit(_restart, model, env, tmp_path / "absurd", "1", absurd)
        runs = {"kept": kept.result(), "absurd": planted.result()}
    for name, (restart, _env) in runs.items():
        counters = restart["counters"][-1]
        assert counters.get("hits_disk") == 2 and counters.get("loads") == 2, (name, counters)
        assert counters.get("bypassed", 0) == 0 and counters.get("hits_recomputed", 0) == 0, (name, counters)
        assert counters.get("tokens_loaded") == 4096, (name, counters)
        assert restart["phases"][0][0]["token_ids"] == answers["B"], name
        answers["A"] = answers["A"] or restart["phases"][1][0]["token_ids"]
        assert restart["phases"][1][0]["token_ids"] == answers["A"], name
    log = runs["absurd"][0]["log"]
    assert log.count("load or recompute: refused") == 1, log[-4000:]


def test_a_wrong_figure_in_the_file_costs_one_recomputed_hit(
        first: tuple[str, GalahadEnv, dict[str, Any]], tmp_path: Path) -> None:
    """A plausible figure that is wrong for this server (a 2048-token prefill in 1 ms: a GPU's
    figure, a stale file) recomputes the first hit; that recompute is measured, replaces the
    figure, and the next hit loads, in the same process."""
    model, env, run = first
    wrong = json.dumps({"version": 1, "prefill": [[2048, 0.001]]})
    restart, _env = _restart(model, env, tmp_path / "wrong", "0", wrong)
    after_b, after_a = restart["counters"]
    assert after_b.get("hits_recomputed") == 1 and after_b.get("hits_disk", 0) == 0, after_b
    assert after_a.get("hits_disk") == 1 and after_a.get("tokens_loaded") == 2048, after_a
    assert restart["phases"][0][0]["token_ids"] == run["phases"][1][0]["token_ids"]
