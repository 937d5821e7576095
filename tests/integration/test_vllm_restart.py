"""A restarted vLLM server answers warm, token-identical, from Galahad's store (real OpenAI servers).

Scenarios, each a real `vllm.entrypoints.openai.api_server` process on the CPU build:
(a) vLLM without the connector; (b) with Galahad, first start (saves); (c) a new process with
Galahad loading from disk; (d) the same with every loaded block deliberately corrupted (the
test hook GALAHAD_TEST_PERTURB_LOAD): the tokens change, so (c) would fail on wrong KV;
damage: every stored block file has bytes flipped, then recompute / fail policies.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from vllm_support.harness import (  # noqa: E402
    GalahadEnv, Server, block_files, flip_bytes, kv_config, metrics_lines, wait_committed,
)
from vllm_support.model import build_model, prompt_ids  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 24
PROMPTS = [prompt_ids(n, seed) for n, seed in [(700, 1), (1000, 2), (520, 3)]]
VARIANT = [PROMPTS[0][:3] + [(PROMPTS[0][3] + 1) % 2000 + 3] + PROMPTS[0][4:]]  # one early token changed


def _ask(server: Server, prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [server.complete(p, MAX_TOKENS) for p in prompts]


def _settle(seconds: float = 2.5) -> None:
    time.sleep(seconds)  # let vLLM's 1 s stats logger print the KV Transfer metrics line


@pytest.fixture(scope="module")
def model() -> str:
    return build_model()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("restart")


@pytest.fixture(scope="module")
def baseline(model: str, root: Path) -> dict[str, Any]:
    env = GalahadEnv(root / "plain")
    with Server(model, env.environ(), root / "a-plain.log") as server:
        return {"answers": _ask(server, PROMPTS), "variant": _ask(server, VARIANT)}


@pytest.fixture(scope="module")
def first(model: str, root: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    env = GalahadEnv(root / "galahad")
    with Server(model, env.environ(), root / "b-first.log", kv=kv_config()) as server:
        answers = _ask(server, PROMPTS)
        counters = wait_committed(env, at_least=len(PROMPTS))
        _settle()
        log = server.log()
    shutil.copytree(env.vars["GALAHAD_CACHE_DIR"], root / "store-after-first")
    return {"env": env, "answers": answers, "counters": counters, "log": log}


def _restart(model: str, root: Path, first: dict[str, Any], name: str, *, damage: bool = False,
             policy: str = "recompute", fresh_store: bool = True, **more: str) -> dict[str, Any]:
    env: GalahadEnv = first["env"]
    store = Path(env.vars["GALAHAD_CACHE_DIR"])
    if fresh_store:
        shutil.rmtree(store)
        shutil.copytree(root / "store-after-first", store)
    if damage:
        for path in block_files(store):
            flip_bytes(path)
    env.reset_counters()
    with Server(model, env.environ(**more), root / f"{name}.log", kv=kv_config(policy)) as server:
        answers = _ask(server, PROMPTS)
        other = _ask(server, [prompt_ids(600, 99)])  # a prompt never stored: must be served
        _settle()
        log = server.log()
    time.sleep(0.5)
    return {"answers": answers, "other": other, "counters": env.counters(), "log": log,
            "store": store}


@pytest.fixture(scope="module")
def restarted(model: str, root: Path, first: dict[str, Any]) -> dict[str, Any]:
    return _restart(model, root, first, "c-restart")


@pytest.fixture(scope="module")
def perturbed(model: str, root: Path, first: dict[str, Any], restarted: dict[str, Any]) -> dict[str, Any]:
    return _restart(model, root, first, "d-perturbed", GALAHAD_TEST_PERTURB_LOAD="1")


@pytest.fixture(scope="module")
def damaged(model: str, root: Path, first: dict[str, Any], perturbed: dict[str, Any]) -> dict[str, Any]:
    return _restart(model, root, first, "e-damaged", damage=True)


@pytest.fixture(scope="module")
def after_damage(model: str, root: Path, first: dict[str, Any], damaged: dict[str, Any]) -> dict[str, Any]:
    return _restart(model, root, first, "f-after-damage", fresh_store=False)


@pytest.fixture(scope="module")
def damaged_fail(model: str, root: Path, first: dict[str, Any], after_damage: dict[str, Any]) -> dict[str, Any]:
    return _restart(model, root, first, "g-damaged-fail", damage=True, policy="fail")


def _ids(answers: list[dict[str, Any]]) -> list[list[int]]:
    for a in answers:
        assert a["error"] is None, a
        assert len(a["token_ids"]) == MAX_TOKENS
    return [a["token_ids"] for a in answers]


def test_the_test_model_continues_differently_when_one_early_token_changes(baseline: dict[str, Any]) -> None:
    assert _ids(baseline["variant"])[0] != _ids(baseline["answers"])[0]
    assert all(len(set(ids)) > 4 for ids in _ids(baseline["answers"]))  # not one token repeated


def test_answers_are_identical_without_galahad_on_first_start_and_after_a_restart(
        baseline: dict[str, Any], first: dict[str, Any], restarted: dict[str, Any]) -> None:
    assert _ids(first["answers"]) == _ids(baseline["answers"])
    assert _ids(restarted["answers"]) == _ids(baseline["answers"])


def test_the_first_start_saves_and_commits_every_prompt(first: dict[str, Any]) -> None:
    c = first["counters"]
    assert c["saves"] == len(PROMPTS) and c["committed"] == len(PROMPTS)
    assert c["hits_disk"] == 0
    assert "[galahad] (scheduler) caching ENABLED" in first["log"]
    assert "encryption ON" in first["log"] and "licence OK" in first["log"]


def test_the_restarted_server_loads_every_prompt_from_disk(restarted: dict[str, Any]) -> None:
    c = restarted["counters"]
    assert c["hits_disk"] == len(PROMPTS) and c["loads"] == len(PROMPTS)
    assert c["bytes_loaded"] > 0 and c["load_failures"] == 0 and c["errors"] == 0
    logged = metrics_lines(restarted["log"])
    assert sum(line.get("hits_disk", 0) for line in logged) == len(PROMPTS), logged


def test_wrong_kv_gives_different_tokens(baseline: dict[str, Any], perturbed: dict[str, Any]) -> None:
    assert "GALAHAD_TEST_PERTURB_LOAD=1" in perturbed["log"]
    assert perturbed["counters"]["hits_disk"] == len(PROMPTS)
    for wrong, right in zip(_ids(perturbed["answers"]), _ids(baseline["answers"])):
        assert wrong != right


def test_damaged_blocks_are_refused_recomputed_and_quarantined(
        baseline: dict[str, Any], damaged: dict[str, Any]) -> None:
    assert _ids(damaged["answers"]) == _ids(baseline["answers"])
    assert damaged["other"][0]["error"] is None
    c = damaged["counters"]
    assert c.get("refused_damaged", 0) == len(PROMPTS), c
    assert c["quarantined"] == len(PROMPTS) and c["loads"] == 0
    assert "Recovered from KV load failure" in damaged["log"]
    assert len(list((damaged["store"]).rglob("quarantine/*"))) >= len(PROMPTS)


def test_the_next_restart_does_not_offer_quarantined_entries_again(
        baseline: dict[str, Any], after_damage: dict[str, Any]) -> None:
    assert _ids(after_damage["answers"]) == _ids(baseline["answers"])
    c = after_damage["counters"]
    assert not any(k.startswith("refused_") and v for k, v in c.items()), c
    assert c["quarantined"] == 0
    assert c["hits_disk"] == len(PROMPTS)  # the entries recomputed and saved again after the damage


def test_with_the_fail_policy_damaged_requests_error_and_the_server_keeps_serving(
        baseline: dict[str, Any], damaged_fail: dict[str, Any]) -> None:
    for answer in damaged_fail["answers"]:
        assert answer["error"] is not None or answer.get("finish_reason") == "error", answer
    assert damaged_fail["other"][0]["error"] is None and len(damaged_fail["other"][0]["token_ids"]) == MAX_TOKENS
    assert "Failing 1 request(s) due to KV load failure" in damaged_fail["log"]
    assert damaged_fail["counters"]["quarantined"] == len(PROMPTS)
