"""A restart with the wrong key loses nothing (offline vLLM runs over one store).

A mistyped `GALAHAD_KEY_FILE` makes a new key at the mistyped path: the server runs, every stored
prompt is a miss (said once, with the fix), and saving those prompts again must leave the entries
sealed under the right key alone. Back with the right key, every prompt loads again, and the
answers are the same throughout. (Before, the wrong-key server set each entry aside as it saved
its prompt anew, so the right key back found nothing.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from vllm_support.harness import GalahadEnv, kv_config, run_offline  # noqa: E402
from vllm_support.model import build_model, prompt_ids  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
PROMPTS = [prompt_ids(600, 41), prompt_ids(500, 42)]


def _tokens(run: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for phase in run["phases"] for o in phase]


def test_a_mistyped_key_file_misses_saves_nothing_over_the_entries_and_the_right_key_finds_them(
        tmp_path: Path) -> None:
    model = build_model()
    phases = [[{"ids": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]]
    llm = {"enable_prefix_caching": False}
    right = GalahadEnv(tmp_path, VLLM_CPU_OMP_THREADS_BIND="1")
    filled = run_offline(model, phases, right, kv=kv_config(), llm=llm, name="fill")
    assert filled["counters"][-1]["committed"] == 2, filled["counters"]
    stored = sorted(p.name for p in right.store_files() if p.suffix == ".blk")

    typo = GalahadEnv(tmp_path, VLLM_CPU_OMP_THREADS_BIND="1",
                      GALAHAD_KEY_FILE=str(tmp_path / "store.kye"))  # made, with a fresh key
    typo.reset_counters()
    wrong = run_offline(model, phases, typo, kv=kv_config(), llm=llm, name="typo")
    assert _tokens(wrong) == _tokens(filled)
    c = wrong["counters"][-1]
    assert c["hits_disk"] == 0 and c["saves"] == 0 and c["committed"] == 0, c
    assert "the store holds entries this server cannot open (for example sealed under key id" in wrong["log"]
    assert not list(tmp_path.glob("store/ns-*/quarantine/*"))  # nothing set aside
    assert sorted(p.name for p in right.store_files() if p.suffix == ".blk") == stored

    right.reset_counters()
    back = run_offline(model, phases, right, kv=kv_config(), llm=llm, name="back")
    assert _tokens(back) == _tokens(filled)
    assert back["counters"][-1]["hits_disk"] == 2, back["counters"]
