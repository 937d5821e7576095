"""What is saved and what is reused: short prompts, payload orders, tenants (offline vLLM runs).

vLLM's own prefix cache is switched off in these runs, so a repeated prompt inside one process
is served by Galahad's store (as after a restart), not by vLLM's memory.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from vllm_support.harness import GalahadEnv, kv_config, run_offline  # noqa: E402
from vllm_support.licence import make_licence  # noqa: E402
from vllm_support.model import build_lora, build_model, prompt_ids  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
SHORT = prompt_ids(200, 10)  # below GALAHAD_MIN_TOKENS (256)
A = prompt_ids(700, 11)
PREAMBLE = prompt_ids(384, 12)  # six 64-token sharing points
B, C, D = (PREAMBLE + prompt_ids(200, seed) for seed in (13, 14, 15))
NO_CACHE = {"enable_prefix_caching": False}


def _req(ids: list[int], salt: str | None = None, lora: str | None = None) -> dict[str, Any]:
    return {"ids": ids, "max_tokens": MAX_TOKENS, "cache_salt": salt, "lora": lora}


def _delta(run: dict[str, Any], phase: int, name: str) -> float:
    before = run["counters"][phase - 1].get(name, 0) if phase else 0
    return run["counters"][phase].get(name, 0) - before


def _tokens(run: dict[str, Any], phase: int) -> list[list[int]]:
    return [o["token_ids"] for o in run["phases"][phase]]


@pytest.fixture(scope="module")
def model() -> str:
    return build_model()


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The three runs side by side (one OpenMP thread each: the same numerics as one at a time)."""
    layer_env = GalahadEnv(tmp_path_factory.mktemp("layer"), GALAHAD_ASYNC_LOAD="off")  # sync loads
    # its store is on network storage, as the mount table this run reads says (nothing else changes)
    table = layer_env.root / "mountinfo"
    table.write_text(f"27 1 254:0 / / rw - ext4 /dev/vda rw\n"
                     f"40 27 0:50 / {layer_env.root} rw - nfs4 fileserver:/export/galahad rw\n")
    layer_env.vars["VLLM_SUPPORT_MOUNTINFO"] = str(table)
    layer_phases = [
        [_req(SHORT), _req(A), _req(B)],
        [_req(SHORT), _req(A), _req(A, "tenant-x"), _req(C), _req(D)],
        [_req(A, "tenant-x"), _req(A, "tenant-y")],
    ]
    chunk_env = GalahadEnv(tmp_path_factory.mktemp("chunk"), GALAHAD_PAYLOAD_ORDER="chunk",
                           VLLM_CPU_OMP_THREADS_BIND="1")
    chunk_phases = [[_req(B)], [_req(C)], [_req(D)]]
    lora_env = GalahadEnv(tmp_path_factory.mktemp("lora"))
    lora_phases = [[_req(A)], [_req(A, lora="adapter")], [_req(A, lora="adapter")], [_req(A)]]
    lora_llm = {**NO_CACHE, "enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    tp2_env = GalahadEnv(tmp_path_factory.mktemp("tp2"), VLLM_CPU_OMP_THREADS_BIND="0|1")
    tp2_env.vars.update(zip(("GALAHAD_LICENCE_FILE", "GALAHAD_LICENCE_ISSUER_KEY"),
                            make_licence(tp2_env.root / "licence", points=2, name="two.lic")))
    tp2_llm = {**NO_CACHE, "tensor_parallel_size": 2}
    with ThreadPoolExecutor(4) as pool:
        tp2 = pool.submit(run_offline, model, [[_req(A)], [_req(A)]], tp2_env, kv=kv_config(), llm=tp2_llm,
                          name="tp2")
        layer = pool.submit(run_offline, model, layer_phases, layer_env, kv=kv_config(), llm=NO_CACHE,
                            name="layer")
        # the chunk run finds the connector through kv_connector_module_path, not the plugin
        chunk = pool.submit(run_offline, model, chunk_phases, chunk_env, kv=kv_config(module_path=True),
                            llm=NO_CACHE, name="chunk")
        lora = pool.submit(run_offline, model, lora_phases, lora_env, kv=kv_config(), llm=lora_llm,
                           lora={"adapter": build_lora(model)}, name="lora")
        return {"layer": {**layer.result(), "store": layer_env.vars["GALAHAD_CACHE_DIR"]},
                "chunk": chunk.result(), "lora": lora.result(),
                "tp2": {**tp2.result(), "files": [p.name for p in tp2_env.store_files()]}}


@pytest.fixture(scope="module")
def layer_run(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["layer"]


@pytest.fixture(scope="module")
def chunk_run(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["chunk"]


@pytest.fixture(scope="module")
def lora_run(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["lora"]


def test_prompts_shorter_than_the_minimum_are_neither_saved_nor_looked_up(layer_run: dict[str, Any]) -> None:
    assert _delta(layer_run, 0, "bypassed") == 1
    assert _delta(layer_run, 0, "saves") == 2  # A and B, not SHORT
    assert _delta(layer_run, 1, "bypassed") == 1
    assert layer_run["phases"][1][0]["num_cached_tokens"] == 0


def test_a_repeated_prompt_loads_from_disk_with_identical_tokens(layer_run: dict[str, Any]) -> None:
    assert _tokens(layer_run, 1)[1] == _tokens(layer_run, 0)[1]
    assert layer_run["phases"][1][1]["num_cached_tokens"] == 672
    assert _delta(layer_run, 1, "hits_disk") == 1 and _delta(layer_run, 1, "loads") == 1


def test_a_clean_shutdown_logs_the_totals_since_start_once(runs: dict[str, dict[str, Any]]) -> None:
    """docs/vllm.md: the scheduler side logs its totals (its own and every worker's) when vLLM's
    engine core shuts down cleanly. The two-rank offline run gets there; vLLM 0.32 on the CPU
    kills a one-worker engine core before (with Galahad or without), which the docs say too."""
    lines = re.findall(r"\[galahad\] totals since start: (.*)$", runs["tp2"]["log"], re.M)
    assert len(lines) == 1, lines
    totals = dict(item.split("=") for item in lines[0].split(", "))
    assert int(totals["hits_disk"]) >= 1 and int(totals["loads"]) >= 1 and int(totals["saves"]) >= 1


def test_a_store_on_network_storage_is_named_once_per_process_at_startup_and_still_caches(
        layer_run: dict[str, Any]) -> None:
    """The product page: "Galahad warns at startup if the store is not on a local disk, but does
    not refuse"; the troubleshooting row "much slower than expected": "the startup warning names it"."""
    store = os.path.realpath(layer_run["store"])
    warning = (f"[galahad] store {store} is on nfs4, a shared network filesystem: servers that mount it with the "
               "same GALAHAD_CACHE_DIR share its entries; loads are slower than from a local disk (docs/store.md, "
               "A store shared by several servers)")
    # through vLLM's own log handlers: its process prefix and level, as every [galahad] line
    lines = re.findall(r"^\((\w+) pid=(\d+)\) WARNING [^\]]*\] (.*)$", layer_run["log"], re.M)
    said = Counter((who, pid) for who, pid, text in lines if text == warning)
    assert sorted(who for who, _pid in said) == ["EngineCore", "Worker"], lines  # each process that opens it
    assert set(said.values()) == {1}, said
    assert "NOT CACHING" not in layer_run["log"]
    assert _delta(layer_run, 1, "loads") == 1  # and it loads from there


def test_a_different_cache_salt_never_loads_another_tenants_entry(layer_run: dict[str, Any]) -> None:
    salted = layer_run["phases"][1][2]
    assert salted["num_cached_tokens"] == 0  # tenant-x misses the unsalted entry of A
    assert salted["token_ids"] == _tokens(layer_run, 0)[1]
    x_again, y = layer_run["phases"][2]
    assert x_again["num_cached_tokens"] == 672  # its own entry, saved in phase 1
    assert y["num_cached_tokens"] == 0  # tenant-y misses tenant-x's entry
    assert _delta(layer_run, 2, "hits_disk") == 1


def test_layer_order_does_not_reuse_a_shared_preamble_nor_count_chain_hits(layer_run: dict[str, Any]) -> None:
    c, d = layer_run["phases"][1][3:]
    assert c["num_cached_tokens"] == 0 and d["num_cached_tokens"] == 0
    assert layer_run["counters"][-1]["chain_hits"] == 0
    assert layer_run["counters"][-1]["saver_chain_saved"] == 0


def test_chunk_order_reuses_a_shared_preamble_across_different_follow_ups(
        chunk_run: dict[str, Any], layer_run: dict[str, Any]) -> None:
    for phase in (1, 2):
        assert chunk_run["phases"][phase][0]["num_cached_tokens"] == len(PREAMBLE)
        assert _delta(chunk_run, phase, "chain_hits") == 1
    assert chunk_run["counters"][-1]["saver_chain_saved"] == 3
    assert chunk_run["counters"][-1]["saver_chain_fallback"] == 0
    # identical to the same prompts computed in full (layer run: C and D missed there)
    assert _tokens(chunk_run, 1)[0] == _tokens(layer_run, 1)[3]
    assert _tokens(chunk_run, 2)[0] == _tokens(layer_run, 1)[4]
    assert _tokens(chunk_run, 0)[0] == _tokens(layer_run, 0)[2]


def test_a_lora_request_never_loads_the_base_models_entry(lora_run: dict[str, Any]) -> None:
    base, adapted, adapted_again, base_again = (lora_run["phases"][i][0] for i in range(4))
    assert adapted["token_ids"] != base["token_ids"]  # the adapter is active: other KV, other tokens
    assert adapted["num_cached_tokens"] == 0  # the base entry is not offered to the adapter
    assert adapted_again["num_cached_tokens"] == 672  # its own entry is
    assert adapted_again["token_ids"] == adapted["token_ids"]
    assert base_again["num_cached_tokens"] == 672 and base_again["token_ids"] == base["token_ids"]


def test_with_two_ranks_each_writes_its_part_and_the_entry_counts_once_both_are_durable(
        runs: dict[str, dict[str, Any]]) -> None:
    tp2 = runs["tp2"]
    first, again = (tp2["phases"][i][0] for i in range(2))
    assert again["num_cached_tokens"] == 672 and again["token_ids"] == first["token_ids"]
    c = tp2["counters"][-1]
    assert c["saves"] == 2 and c["committed"] == 1 and c["loads"] == 1 and c["hits_disk"] == 1, c
    parts = sorted(name.rsplit(".", 2)[1] for name in tp2["files"] if name.endswith(".blk"))
    assert parts == ["p0", "p1"] and sum(name.endswith(".ok") for name in tp2["files"]) == 1


def test_chunk_order_loads_that_fail_midway_keep_the_answers_identical(
        model: str, layer_run: dict[str, Any], tmp_path: Path) -> None:
    """Every load fails at one of its entries, chosen at random (GALAHAD_FAULT_LOAD_RATE=1): the
    entries before it are copied in, vLLM recomputes the rest, and the answer is the one computed
    in full. Three requests: three failures at three random places."""
    env = GalahadEnv(tmp_path, GALAHAD_PAYLOAD_ORDER="chunk", GALAHAD_ASYNC_LOAD="off",
                     GALAHAD_FAULT_LOAD_RATE="1")
    run = run_offline(model, [[_req(B)], [_req(B)], [_req(B)], [_req(B)]], env, kv=kv_config(),
                      llm=NO_CACHE, name="chunk-faults")
    full = _tokens(layer_run, 0)[2]  # B computed in full, no connector help
    assert [_tokens(run, phase)[0] for phase in range(4)] == [full] * 4
    last = run["counters"][-1]
    assert last["hits_disk"] == 3 and last["refused_injected"] == 3 and last["loads"] == 0, last
    assert last.get("quarantined", 0) == 0  # an injected fault keeps the entry
