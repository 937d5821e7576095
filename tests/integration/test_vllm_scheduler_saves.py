"""The scheduler side's save planning and commits, over a real service and filesystem store (no
engine: vLLM's scheduler output and the workers' reports are stood in for by plain objects).

A prompt's entries are committed once their parts are acknowledged, on the commit threads (the
step does not wait); a later prompt sharing the prefix saves only what is new, without reading
the committed entries' markers again; and an entry gone since (evicted, quarantined) is saved
again: a lookup that stops short of it says it is no longer committed."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm")

from galahad.adapters.crypto.key import Keyring  # noqa: E402
from galahad.adapters.vllm.metadata import GalahadWorkerMetadata  # noqa: E402
from galahad.adapters.vllm.scheduler import GalahadScheduler  # noqa: E402
from galahad.domain.chain import ChainKey  # noqa: E402
from galahad.domain.chunking import Span  # noqa: E402
from galahad.domain.secret import SecretKey  # noqa: E402
from galahad.app.service import SegmentSpec  # noqa: E402

from helpers.services import LAYERS, helper_service  # noqa: E402
from test_service_commits import BLOCK, _service  # noqa: E402

pytestmark = pytest.mark.vllm


def _request(req_id: str, tokens: list[int]) -> NS:
    return NS(request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens), num_computed_tokens=0)


def _prefill(sched: GalahadScheduler, req: NS) -> list:
    """The request is looked up, then its whole prompt computed in one step: its save entries."""
    sched.matched(req, 0)
    blocks = (list(range(1, len(req.prompt_token_ids) // BLOCK + 2)),)
    out = NS(kv_connector_block_state=NS(get_block_ids=lambda _rid: blocks),
             num_scheduled_tokens={req.request_id: len(req.prompt_token_ids)},
             total_num_scheduled_tokens=len(req.prompt_token_ids))
    meta = sched.build_meta(out)
    return [e for job in meta.saves for e in job.entries]


def _write_and_ack(sched: GalahadScheduler, entries: list, *, others: int = 0, layers: int = 1) -> None:
    """Write and acknowledge `entries` (of a model of `layers` layers); return once they are
    committed (`others`: entries shipped and still waiting for their acknowledgements)."""
    svc = sched.service
    segments = [SegmentSpec(0, layer, 0, "float32", (1, 2, BLOCK, 4)) for layer in range(layers)]
    for e in entries:
        assert svc.save_part(ChainKey(e.key), Span(e.start, e.end), 0, segments,
                             [bytes(2 * BLOCK * 4 * 4)] * layers)
    sched.update(NS(kv_connector_worker_meta=GalahadWorkerMetadata(saved={e.key: [(0, True)] for e in entries})))
    end = time.monotonic() + 30
    while sched.pending_commits() > others and time.monotonic() < end:  # markers written on the commit threads
        time.sleep(0.01)
    assert sched.pending_commits() == others


def test_a_shared_prefix_is_saved_once_and_an_entry_gone_since_is_saved_again(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=False, single_group=True)
    first = list(range(5 * 64 + 1))
    saved = _prefill(sched, _request("a", first))
    assert [(e.start, e.end) for e in saved] == [(64 * i, 64 * (i + 1)) for i in range(5)]
    _write_and_ack(sched, saved)
    assert sched.committed == 5

    asked: list[bytes] = []
    holds = svc.holds

    def counted(key: ChainKey) -> bool:
        asked.append(key.raw)
        return holds(key)

    svc.holds = counted  # type: ignore[method-assign]
    longer = first[:-1] + list(range(9000, 9000 + 2 * 64 + 1))  # the same 5 chunks, then 2 new
    again = _prefill(sched, _request("b", longer))
    assert [(e.start, e.end) for e in again] == [(320, 384), (384, 448)]  # only what is new
    assert not {e.key for e in saved} & set(asked)  # committed ones not read again at save time
    assert asked == []  # and the new ones asked about at once (`first_committed`), none one by one
    _write_and_ack(sched, again)

    svc.quarantine(ChainKey(saved[2].key), "cleared")  # gone since (evicted, damaged, cleared)
    third = _prefill(sched, _request("c", longer))
    assert (128, 192) in [(e.start, e.end) for e in third]  # the gap is saved again
    assert all(e.start >= 128 for e in third)  # the prefix before it is still committed
    assert (192, 256) not in [(e.start, e.end) for e in third]  # committed after the gap: kept
    svc.close()


def test_entries_sealed_under_a_key_retired_since_are_saved_again_under_the_key_in_use(tmp_path: Path) -> None:
    """After the old key's line is deleted (docs/security.md, Rotation), a prompt used again is a
    miss and is saved anew: its old entries are set aside. They used to count as already saved.
    Under a wrong key instead (never retired), nothing is saved over them."""
    root = tmp_path / "store"
    old, new = SecretKey(os.urandom(32)), SecretKey(os.urandom(32))
    before = helper_service(root, Keyring(old))
    first = _request("a", list(range(5 * 64 + 1)))  # past the default GALAHAD_MIN_TOKENS
    with_old = GalahadScheduler(before, async_load=False, single_group=True)
    saved = _prefill(with_old, first)
    _write_and_ack(with_old, saved, layers=LAYERS)
    assert with_old.committed == 5
    wrong = helper_service(root, Keyring(SecretKey(os.urandom(32))))  # a wrong key: the entries kept
    assert _prefill(GalahadScheduler(wrong, async_load=False, single_group=True), _request("w", first.prompt_token_ids)) == []
    helper_service(root, Keyring(new, (old,))).close()  # step 2: the old key a retired line
    after = helper_service(root, Keyring(new))  # step 3: its line deleted
    sched = GalahadScheduler(after, async_load=False, single_group=True)
    again = _prefill(sched, _request("b", first.prompt_token_ids))
    assert [(e.start, e.end) for e in again] == [(e.start, e.end) for e in saved]  # all of it, anew
    assert not any(after.store.is_committed(ChainKey(e.key)) for e in again)  # the old entries set aside
    _write_and_ack(sched, again, layers=LAYERS)
    assert sched.committed == 5 and after.lookup(first.prompt_token_ids, after.seed()) is not None
    for svc in (before, wrong, after):
        svc.close()


def test_markers_written_while_the_engine_idles_are_counted_by_the_next_step_not_lost(tmp_path: Path) -> None:
    """vLLM keeps stepping while `has_pending_push_work` (pending_commits(reap=False)) says so: a
    marker written after the last step keeps it stepping, and that step counts it `committed`
    (reported in its stats). Counting it while asked would stop the engine with the count unreported."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Event

    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=False, single_group=True)
    entries = _prefill(sched, _request("r", list(range(5 * 64 + 1))))
    assert len(entries) == 5
    segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
    for e in entries:
        assert svc.save_part(ChainKey(e.key), Span(e.start, e.end), 0, segment, [bytes(2 * BLOCK * 4 * 4)])
    disk, slow = Event(), ThreadPoolExecutor(5)  # markers held until the step below is over
    svc.commit_later = lambda key: slow.submit(lambda: (disk.wait(30), svc.commit(key))[1])  # type: ignore[method-assign]
    sched.update(NS(kv_connector_worker_meta=GalahadWorkerMetadata(saved={e.key: [(0, True)] for e in entries})))
    assert sched.committed == 0 and sched.pending_commits(reap=False) == 5  # the last step: none written yet
    disk.set()  # the markers are written while the engine idles
    end = time.monotonic() + 30
    while not all(f.done() for f in sched._committing.values()) and time.monotonic() < end:
        time.sleep(0.01)
    assert sched.pending_commits(reap=False) == len(entries)  # written, not yet counted: keep stepping
    assert sched.committed == 0
    sched.update(NS(kv_connector_worker_meta=None))  # the next step counts them
    assert sched.committed == len(entries) and sched.pending_commits(reap=False) == 0


def _step_until(sched: GalahadScheduler, done, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        sched.update(NS(kv_connector_worker_meta=None))  # an engine step without reports
        time.sleep(0.01)


def test_an_entry_whose_acknowledgement_never_comes_is_committed_once_its_parts_are_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A part written and fsynced whose acknowledgement never arrives (lost on its way, or its
    worker stuck after the write) is committed from the store: a late commit, not a lost entry.
    Parts not on disk are never committed that way, and are given up in the end."""
    import galahad.adapters.vllm.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "_ACK_LATE_S", 0.2)
    monkeypatch.setattr(scheduler_module, "_PROBE_EVERY_S", 0.05)
    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=False, single_group=True)
    entries = _prefill(sched, _request("r", list(range(5 * 64 + 1))))
    segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
    written, missing = entries[:4], entries[4:]
    for e in written:  # written, never acknowledged
        assert svc.save_part(ChainKey(e.key), Span(e.start, e.end), 0, segment, [bytes(2 * BLOCK * 4 * 4)])
    sched.update(NS(kv_connector_worker_meta=None))
    assert sched.pending_commits() == 5 and sched.committed == 0  # not before `_ACK_LATE_S`
    _step_until(sched, lambda: sched.pending_commits() == 1)
    assert sched.committed == 4  # counted by a step, like any commit
    assert [svc.is_committed(ChainKey(e.key)) for e in entries] == [True] * 4 + [False]
    assert "every part is on disk: committed (an acknowledgement was lost or late)" in caplog.text

    monkeypatch.setattr(scheduler_module, "_ACK_TIMEOUT_S", 0.6)
    _step_until(sched, lambda: sched.pending_commits() == 0)  # the missing part: probed, then given up
    assert not svc.is_committed(ChainKey(missing[0].key)) and sched.committed == 4
    assert "not every rank acknowledged its part within 0 s; not committed" in caplog.text
    svc.close()


def test_a_waiting_request_loads_what_was_committed_while_it_waited_reading_only_beyond_its_hit(
        tmp_path: Path) -> None:
    """vLLM asks again and again while a request waits for room. A turn that comes while the
    turn before is still being written finds part of its prefix; what is committed meanwhile is
    loaded once it is scheduled, and the entries found before are not read again."""
    svc = _service(tmp_path / "store")
    sched = GalahadScheduler(svc, async_load=False, single_group=True)
    prompt = list(range(5 * 64 + 1))
    saved = _prefill(sched, _request("a", prompt))
    _write_and_ack(sched, saved[:2], others=3)  # the turn before: two of its five entries written so far

    asked: list[bytes] = []
    is_committed = svc.store.is_committed

    def counted(key: ChainKey) -> bool:
        asked.append(key.raw)
        return is_committed(key)

    svc.store.is_committed = counted  # type: ignore[method-assign]  # what a lookup reads
    waiting = _request("b", prompt)
    assert sched.matched(waiting, 0) == (128, False)
    assert sched.matched(waiting, 0) == (128, False) and len(asked) == 3  # asked again: no new read
    _write_and_ack(sched, saved[2:])  # the rest is committed while it waits
    asked.clear()
    assert sched.matched(waiting, 0) == (320, False)
    assert asked == [e.key for e in saved[2:]]  # only beyond the hit found before
    assert sched.matched(waiting, 0) == (320, False) and len(asked) == 3  # the whole prompt: never again
    svc.close()
