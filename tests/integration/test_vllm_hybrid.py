"""A sliding-window hybrid model (Gemma3-style) is saved and restored per KV cache group (offline vLLM runs).

vLLM's hybrid KV manager gives the model sliding-window groups (window 128 tokens, 32-token blocks)
and a full-attention group. An entry holds every group's part: the full-attention layer every block
of the prefix, each sliding layer only the 4 blocks inside the window at the saving point.

Runs, two at a time on separate cores (one OpenMP thread each): (plain) vLLM without the connector;
(first) with Galahad, saves; (restart) a new process loading from disk; (perturbed) the same, with
the loaded sliding-window blocks deliberately negated: the tokens change, so the window Galahad
restores is the one the model attends to; (damaged) every stored file damaged: each load fails as a
whole request (`failed_recving`), vLLM recomputes, answers identical; (damaged-fail) the same under
`kv_load_failure_policy=fail`: the requests error, the server keeps serving.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from galahad.format.v1 import decode_header  # noqa: E402
from vllm_support.harness import block_files, kv_config  # noqa: E402
from vllm_support.hybrid_model import GEMMA3, build_gemma3  # noqa: E402
from vllm_support.model import prompt_ids  # noqa: E402
from vllm_support.scenario import Scenario, copy_store, together  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
PROMPTS = [prompt_ids(1000, 61), prompt_ids(3000, 62)]
SAVED_ENDS = [992, 2976]  # (n - 1) // 32 * 32: an identical prompt leaves one token to compute
VARIANT = PROMPTS[0][:3] + [(PROMPTS[0][3] + 1) % 2000 + 3] + PROMPTS[0][4:]  # one early token changed
OTHER = prompt_ids(600, 63)


@pytest.fixture(scope="module")
def model() -> str:
    return build_gemma3()


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scenario]:
    root = tmp_path_factory.mktemp("hybrid")

    def run(name: str, **kw: Any) -> Scenario:
        return Scenario(root, name, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw)

    plain = run("plain", kv=None, core="1", extra=[VARIANT])
    first = run("first", kv=kv_config(), core="0")
    together(model, plain, first)
    key = first.key_file
    restart = run("restart", kv=kv_config(), core="0", key_file=key, extra=[OTHER])
    perturbed = run("perturbed", kv=kv_config(), core="1", key_file=key,
                    GALAHAD_TEST_PERTURB_LOAD="sliding")
    for r in (restart, perturbed):
        copy_store(first, r)
    together(model, restart, perturbed)
    damaged = run("damaged", kv=kv_config(), core="0", key_file=key, extra=[OTHER])
    failing = run("damaged-fail", kv=kv_config("fail"), core="1", key_file=key, extra=[OTHER])
    for r in (damaged, failing):
        copy_store(first, r, damage=True)
    together(model, damaged, failing)
    return {r.name: r for r in (plain, first, restart, perturbed, damaged, failing)}


def _sliding_groups(log: str) -> set[int]:
    return {int(g) for g in re.findall(r"group (\d+) \(\d+-token blocks\): sliding window", log)}


def _bytes_by_group(store: Path) -> dict[int, dict[int, int]]:
    """Per saved entry (by its end token): the payload bytes each KV cache group holds."""
    out: dict[int, dict[int, int]] = {}
    for path in block_files(store):
        header = decode_header(path.read_bytes())
        per_group: dict[int, int] = defaultdict(int)
        for seg in header.segments:
            per_group[seg.group] += seg.nbytes
        out[header.token_end] = dict(per_group)
    return out


def test_the_test_model_continues_differently_when_one_early_token_changes(runs: dict[str, Scenario]) -> None:
    plain = runs["plain"]
    assert plain.tokens(1)[0] != plain.tokens(0)[0]  # the early token is 800+ tokens outside the window
    assert all(len(set(t)) > 4 for t in plain.tokens(0))  # not one token repeated


def test_the_hybrid_manager_is_on_and_the_plan_is_logged_once(runs: dict[str, Scenario]) -> None:
    log = runs["first"].log
    lines = [line for line in log.splitlines() if "hybrid KV manager ON" in line]
    assert len(lines) == 1, lines
    assert "Turning off hybrid kv cache manager" not in log
    assert "hybrid KV plan unavailable" not in log and "NOT CACHING" not in log
    window = GEMMA3["sliding_window"]
    assert f"sliding window of {window} tokens, 1 layer: the last 4 blocks (128 tokens)" in lines[0]
    assert "full attention, 1 layer: every block of the prefix" in lines[0]
    assert len(_sliding_groups(log)) == GEMMA3["num_hidden_layers"] - 1


def test_answers_are_identical_without_galahad_on_first_start_and_after_a_restart(
        runs: dict[str, Scenario]) -> None:
    expected = runs["plain"].tokens()
    assert all(len(t) == MAX_TOKENS for t in expected)
    assert runs["first"].tokens() == expected
    assert runs["restart"].tokens() == expected


def test_the_restarted_process_loads_every_prompt_from_disk(runs: dict[str, Scenario]) -> None:
    first, restart = runs["first"].counters, runs["restart"].counters
    assert first["saves"] == len(PROMPTS) and first["committed"] == len(PROMPTS), first
    assert restart["hits_disk"] == len(PROMPTS) and restart["loads"] == len(PROMPTS), restart
    assert restart["tokens_loaded"] == sum(SAVED_ENDS)
    assert restart["load_failures"] == 0 and restart["errors"] == 0, restart
    cached = [o["num_cached_tokens"] for o in runs["restart"].outputs()]
    assert cached == SAVED_ENDS
    assert len(runs["restart"].tokens(1)[0]) == MAX_TOKENS


def test_a_sliding_layer_saves_its_window_not_the_prompt(runs: dict[str, Scenario]) -> None:
    first = runs["first"]
    sliding = _sliding_groups(first.log)
    saved = _bytes_by_group(first.store)
    assert sorted(saved) == SAVED_ENDS
    short, long = saved[SAVED_ENDS[0]], saved[SAVED_ENDS[1]]
    page = 2 * 32 * 2 * GEMMA3["head_dim"] * 4  # KV heads x block tokens x (K+V) x float32
    (full,) = set(short) - sliding
    for g in sliding:  # 4 blocks: the 128-token window, for a 1k and a 3k prompt alike
        assert short[g] == long[g] == 4 * page
    assert short[full] == SAVED_ENDS[0] // 32 * page and long[full] == SAVED_ENDS[1] // 32 * page
    print(f"\nsliding-window entry bytes: 1k prompt {sum(short[g] for g in sliding)}, 3k prompt "
          f"{sum(long[g] for g in sliding)} ({len(sliding)} sliding layers); full-attention layer: "
          f"{short[full]} and {long[full]}; whole entry {sum(short.values())} and {sum(long.values())}")


def test_wrong_sliding_window_kv_gives_different_tokens(runs: dict[str, Scenario]) -> None:
    perturbed = runs["perturbed"]
    assert "GALAHAD_TEST_PERTURB_LOAD=sliding" in perturbed.log
    assert perturbed.counters["loads"] == len(PROMPTS)
    for wrong, right in zip(perturbed.tokens(), runs["plain"].tokens()):
        assert wrong != right


def test_a_damaged_entry_is_a_miss_for_every_group_and_answers_stay_identical(runs: dict[str, Scenario]) -> None:
    damaged = runs["damaged"]
    assert damaged.tokens() == runs["plain"].tokens()
    c = damaged.counters
    assert c.get("refused_damaged", 0) == len(PROMPTS) and c["quarantined"] == len(PROMPTS), c
    assert c["loads"] == 0 and c["errors"] == 0, c
    # several KV cache groups: failures go to vLLM per request (failed_recving), never per block
    assert "invalid_block_ids" not in damaged.log
    assert len(damaged.tokens(1)[0]) == MAX_TOKENS


def test_with_the_fail_policy_damaged_hybrid_requests_error_and_the_server_keeps_serving(
        runs: dict[str, Scenario]) -> None:
    failing = runs["damaged-fail"]
    reasons = [o["finish_reason"] for o in failing.outputs()]
    assert reasons == ["error"] * len(PROMPTS), reasons
    assert failing.counters["quarantined"] == len(PROMPTS)
    assert len(failing.tokens(1)[0]) == MAX_TOKENS and failing.outputs(1)[0]["finish_reason"] != "error"
