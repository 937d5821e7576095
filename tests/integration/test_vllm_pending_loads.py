"""Pending loads: a prompt saved by this server whose part
is not durable yet is loaded from the copy its save still holds, not recomputed and not read from
the disk. The disk may take seconds to make a turn's saves durable (fsync); a conversation's
next turn comes sooner than that.

- a real vLLM (CPU build) process: the same prompt twice, the second while the first's save is
  held back by the test hook GALAHAD_TEST_SAVE_DELAY; loaded from memory (`held_loads`: nothing
  was committed yet, so without pending loads it would be recomputed, a miss), token-identical;
- the worker alone (real service, real filesystem store, real KV tensors; CPU, and marked `gpu` the
  CUDA path with its pinned save buffers): the load copies the held bytes in while no part file
  exists yet, the buffer goes back to the pool only after the save and the load are both done;
- the scheduler alone (its inputs stood in for by plain objects, as in test_vllm_scheduler_saves):
  an entry is offered once every rank holds it, and no longer once a part failed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

import torch  # noqa: E402

from galahad.adapters.vllm.metadata import (  # noqa: E402
    EntryRef,
    GalahadMetadata,
    GalahadWorkerMetadata,
    LoadJob,
    SaveJob,
)
from galahad.adapters.vllm.scheduler import GalahadScheduler  # noqa: E402
from galahad.adapters.vllm.worker import GalahadWorker  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from vllm_support.harness import GalahadEnv, kv_config, run_offline  # noqa: E402
from vllm_support.model import build_model, prompt_ids  # noqa: E402

import test_vllm_worker_reads as reads  # noqa: E402
from test_vllm_scheduler_saves import _prefill, _request, _write_and_ack  # noqa: E402
from test_service_commits import _service  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = prompt_ids(700, 31)
SAVE_DELAY_S = 6.0  # each part is written this late: the second request comes long before


def _req(ids: list[int]) -> dict[str, Any]:
    return {"ids": ids, "max_tokens": 16}


@pytest.fixture(scope="module")
def model() -> str:
    return build_model()


def _twice(model: str, root: Path, name: str) -> dict[str, Any]:
    """The prompt, then at once the same prompt again (vLLM's own prefix cache off: the second is
    Galahad's), with every part written SAVE_DELAY_S late."""
    env = GalahadEnv(root, GALAHAD_TEST_SAVE_DELAY=f"0:{SAVE_DELAY_S}")
    run = run_offline(model, [[_req(PROMPT)], [_req(PROMPT)]], env, kv=kv_config(),
                      llm={"enable_prefix_caching": False}, name=name, no_wait_after=[0])
    return run


def test_a_prompt_sent_again_before_its_save_is_durable_loads_from_memory(
        model: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    on_run = _twice(model, tmp_path_factory.mktemp("on"), "on")
    first, second = (o[0]["token_ids"] for o in on_run["phases"])
    assert second == first  # loaded from memory: the same tokens as computing it
    counters = on_run["counters"][1]
    assert counters["hits_disk"] == 1 and counters["loads"] == 1 and counters["held_loads"] >= 1
    assert counters["load_failures"] == 0 and counters["committed"] >= 1  # and saved all the same
    assert "TEST HOOK ON: GALAHAD_TEST_SAVE_DELAY" in on_run["log"]


# ---------------------------------------------------------------- the worker alone


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("gpu: torch.cuda is not available")
    return str(request.param)


def _entries(svc: Any) -> list[EntryRef]:
    tokens = [(i * 7919) % 30000 for i in range(reads.CHUNKS * 64 + 1)]
    keys = svc.keys(tokens, svc.seed())
    return [EntryRef(keys[svc.chunking.key_index(s.end)].raw, s.start, s.end,
                     (tuple(range(s.start // reads.BLOCK, s.end // reads.BLOCK)),))
            for s in svc.chunking.save_spans(reads.CHUNKS * 64)]


def _load_job(entries: list[EntryRef]) -> GalahadMetadata:
    """Blocks b of the saved entries into blocks b + 48."""
    shifted = [EntryRef(e.key, e.start, e.end, (tuple(b + 48 for b in e.blocks[0]),)) for e in entries]
    meta = GalahadMetadata()
    meta.loads.append(LoadJob("r", tuple(shifted), False, reads.CHUNKS * 64))
    return meta


@pytest.mark.parametrize("pending", [True, False])
def test_the_worker_loads_a_pending_save_from_its_copy(tmp_path: Path, device: str, pending: bool) -> None:
    svc = _service(tmp_path / "store")
    entries = _entries(svc)
    caches = reads._caches(device)
    for name in caches:  # the load's destination blocks start empty
        caches[name][48:] = 0
    worker = GalahadWorker(svc, 0, RankLayout(), reads._config(), reads.BLOCK, pending_loads=pending,
                           save_delay=(3.0, None))
    worker.register(caches)
    released: list[object] = []
    if worker.cuda is not None:  # when the pinned buffers go back to the pool
        give_back = worker.cuda.pool.release

        def counted(buf: Any, ready: Any = None) -> None:
            released.append(buf)
            give_back(buf, ready)

        worker.cuda.pool.release = counted  # type: ignore[method-assign]
    save = GalahadMetadata()
    save.saves.append(SaveJob("w", tuple(entries)))
    worker.save(save)
    # the pinned buffers the saves were gathered into (a failed load's own buffers go back at once)
    saved_into = {id(h.copy.gathered.buffer) for h in worker.pending.holds() if h.copy is not None}
    report = worker.take_report()
    held = report.held if report is not None else {}
    assert held == ({e.key: [0] for e in entries} if pending else {})

    assert not list((tmp_path / "store").rglob("*.blk"))
    worker.start_load(_load_job(entries))
    if device == "cuda":
        torch.cuda.synchronize()
    assert not list((tmp_path / "store").rglob("*.blk"))  # the saves are still waiting: nothing on disk
    assert not saved_into & {id(b) for b in released}  # kept while their saves wait
    invalid = worker.take_invalid_blocks()
    loaded = worker.take_report()
    counters = svc.take_counters()
    if pending:
        assert not invalid and counters.held_loads == len(entries)
        assert loaded is not None and loaded.loaded == {"r": [(0, None)]} and not loaded.timings
        for name, t in caches.items():  # byte for byte what was saved
            assert torch.equal(t[48 : 48 + reads.CHUNKS * 4].cpu(), t[: reads.CHUNKS * 4].cpu()), name
    else:  # nothing held: the first entry is not on disk, the whole job is recomputed
        assert counters.held_loads == 0 and len(invalid) == reads.CHUNKS * 4
    svc._saves.shutdown(wait=True)  # the saves finish; their copies go back
    assert not worker.pending and len(list((tmp_path / "store").rglob("*.blk"))) == len(entries)
    if device == "cuda" and pending:  # given back once the saves were written and the load done
        assert saved_into and saved_into <= {id(b) for b in released}
    svc.close()


# ---------------------------------------------------------------- the scheduler alone


def _held_report(entries: list[EntryRef], ranks: list[int]) -> NS:
    return NS(kv_connector_worker_meta=GalahadWorkerMetadata(held={e.key: list(ranks) for e in entries}))


def test_the_scheduler_offers_an_entry_once_every_rank_holds_it(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=False, single_group=True, pending_loads=True)
    prompt = list(range(5 * 64 + 1))
    entries = _prefill(sched, _request("a", prompt))
    assert len(entries) == 5
    again = _request("b", prompt)
    assert sched.matched(again, 0) == (0, False)  # shipped, not held yet: nothing to offer
    sched.update(_held_report(entries, [0]))
    assert sched.matched(again, 0) == (5 * 64, False)  # held: offered, loaded inside the step
    # a part that failed to write: the entry is no longer offered (nor what follows it)
    sched.update(NS(kv_connector_worker_meta=GalahadWorkerMetadata(saved={entries[2].key: [(0, False)]})))
    assert sched.matched(_request("c", prompt), 0) == (2 * 64, False)
    # the others written: committed, and offered from the store
    _write_and_ack(sched, [e for e in entries if e is not entries[2]])
    sched.update(NS(kv_connector_worker_meta=None))
    assert not sched._held and sched.committed == 4
    assert sched.matched(_request("d", prompt), 0) == (2 * 64, False)
    svc.close()


def test_the_scheduler_offers_nothing_pending_with_the_setting_off(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=False, single_group=True, pending_loads=False)
    prompt = list(range(5 * 64 + 1))  # above the 256 tokens a prompt needs to be saved
    entries = _prefill(sched, _request("a", prompt))
    sched.update(_held_report(entries, [0]))
    assert sched.matched(_request("b", prompt), 0) == (0, False)
    svc.close()


def test_a_held_hit_is_loaded_inside_the_step_whatever_the_store_costs(tmp_path: Path) -> None:
    """The cost model prices reading the store; an entry from memory reads nothing. With figures
    that make any read from the store slower than recomputing, a held hit is still offered, and
    loaded inside the step (a priced load), not asynchronously."""
    from galahad.adapters.vllm.advisor import LoadAdvisor

    advisor = LoadAdvisor()
    advisor.observe_step(64, 0.0001)  # a fast engine
    advisor.observe_load(64 << 20, 1.0, share=1.0)  # a slow store: 67 MB/s
    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=True, single_group=True, advisor=advisor, pending_loads=True)
    prompt = list(range(5 * 64 + 1))  # above the 256 tokens a prompt needs to be saved
    entries = _prefill(sched, _request("a", prompt))
    sched.update(_held_report(entries, [0]))
    assert sched.matched(_request("b", prompt), 0) == (5 * 64, False)
    assert svc.take_counters().bypassed == 0
    svc.close()
