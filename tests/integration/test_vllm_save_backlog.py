"""Saves never make the engine wait: copies of saves not yet written are bounded, and a save that
finds the bound reached is skipped and counted (`saves_skipped_backlog`), not queued.

A real worker, service and filesystem store on the CPU, with a disk slower than the saves (the
test hook that makes each part wait before it is written, gated by a file); no engine: the
worker's `save` hook is called as vLLM's `wait_for_save` calls it. The CUDA path's bound is its
pinned buffers, reserved at registration and never pinned on a request's path
(tests/unit/test_pinned_refused.py, and on the GPU tests/integration/test_vllm_preload.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, SaveJob  # noqa: E402
from galahad.adapters.vllm.worker import GalahadWorker  # noqa: E402
from galahad.adapters.vllm.worker.core import arena_bytes  # noqa: E402
from galahad.adapters.vllm.worker.saves import backlog_bytes  # noqa: E402
from galahad.app.service import KVCacheService  # noqa: E402
from galahad.domain.chunking import Chunking  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.format.codec import cipher_lookup  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK, CHUNKS = 16, 12
ENTRY_BYTES = 4 * 2 * BLOCK * 64 * 4  # a 64-token entry: 4 blocks of one layer, K and V, 64 float32


def saving_worker(root: Path, io_threads: int = 8) -> tuple[KVCacheService, GalahadWorker, list[EntryRef]]:
    """A worker registered on a one-layer CPU cache of CHUNKS 64-token entries, its service over a
    checksummed store at `root` (made), and those entries' save references."""
    ns = Namespace(model="backlog", model_fingerprint="backlog", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),), payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    root.mkdir(mode=0o700)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(root, ns, rescan_s=None),
                         chunking=Chunking(PayloadOrder.CHUNK, BLOCK), layout=RankLayout(), cipher=check,
                         ciphers=cipher_lookup(check), io_threads=io_threads)
    config = SimpleNamespace(num_blocks=CHUNKS * 4, kv_cache_groups=[SimpleNamespace(layer_names=["l0"])])
    keys = svc.keys(list(range(CHUNKS * 64 + 1)), svc.seed())
    entries = [EntryRef(keys[svc.chunking.key_index(s.end)].raw, s.start, s.end,
                        (tuple(range(s.start // BLOCK, s.end // BLOCK)),)) for s in svc.chunking.save_spans(CHUNKS * 64)]
    worker = GalahadWorker(svc, 0, RankLayout(), config, BLOCK)
    worker.register({"l0": torch.randn(CHUNKS * 4, 2, BLOCK, 64)})
    return svc, worker, entries


def _save(worker: GalahadWorker, entries: list[EntryRef]) -> None:
    meta = GalahadMetadata()
    meta.saves.append(SaveJob("r", tuple(entries)))
    worker.save(meta)


def _acks(worker: GalahadWorker, n: int, timeout: float = 30.0) -> list[tuple[bytes, bool]]:
    got: list[tuple[bytes, bool]] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} saves acknowledged"
        got += worker.saver.take_acks()
        time.sleep(0.01)
    return got


def test_a_save_beyond_the_backlog_is_skipped_and_counted_not_queued(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc, worker, entries = saving_worker(tmp_path / "store")
    gate = tmp_path / "slow"
    gate.touch()
    worker.saver.backlog = 3 * ENTRY_BYTES  # three entries' copies may wait to be written
    worker.saver.delay = (3.0, str(gate))  # the disk: each part waits 3 s while the gate exists
    try:
        with caplog.at_level(logging.WARNING, logger="galahad"):
            _save(worker, entries[:8])
        # the hook returned with every copy beyond the bound skipped at once, none written yet
        skipped = worker.saver.take_acks()
        assert sorted(skipped) == sorted((e.key, False) for e in entries[3:8])
        assert worker.saver.waiting == 3 * ENTRY_BYTES
        counts = svc.snapshot_counters()
        assert counts.saves == 0 and counts.saves_skipped == 5 and counts.skipped == {"backlog": 5}
        assert counts.as_dict()["saves_skipped_backlog"] == 5
        (said,) = [r.getMessage() for r in caplog.records if "saves skipped while the disk catches up" in r.getMessage()]
        assert "the engine does not wait for them" in said and said.endswith("counted as saves_skipped_backlog")
    finally:
        gate.unlink()  # the disk catches up: the three waiting are written
    worker.saver.delay = (0.0, None)
    written = _acks(worker, 3)
    assert sorted(written) == sorted((e.key, True) for e in entries[:3])
    assert worker.saver.waiting == 0
    _save(worker, entries[3:6])  # room again: saved, none skipped
    assert sorted(_acks(worker, 3)) == sorted((e.key, True) for e in entries[3:6])
    counts = svc.snapshot_counters()
    assert counts.saves == 6 and counts.skipped == {"backlog": 5}
    assert len(list((tmp_path / "store").rglob("*.blk"))) == 6
    svc.close()


def test_an_entry_larger_than_the_backlog_is_saved_when_nothing_else_waits(tmp_path: Path) -> None:
    svc, worker, entries = saving_worker(tmp_path / "store")
    worker.saver.backlog = ENTRY_BYTES // 2
    _save(worker, entries[:1])
    assert _acks(worker, 1) == [(entries[0].key, True)]
    assert svc.snapshot_counters().saves_skipped == 0
    svc.close()


def test_the_backlog_is_an_eighth_of_available_memory_within_its_bounds() -> None:
    assert backlog_bytes(64 << 30) == 4 << 30  # at most 4 GiB
    assert backlog_bytes(16 << 30) == 2 << 30
    assert backlog_bytes(1 << 30) == 256 << 20  # at least 256 MiB
    assert backlog_bytes(0) == 1 << 30  # unknown

def test_once_a_requests_save_is_skipped_its_later_entries_in_the_step_are_skipped_too(tmp_path: Path) -> None:
    """A prompt loads its entries in order up to the first one missing: entries behind a skipped
    one could not be loaded, so the disk's time goes to other requests' saves instead."""
    svc, worker, entries = saving_worker(tmp_path / "store")
    gate = tmp_path / "slow"
    gate.touch()
    worker.saver.backlog = ENTRY_BYTES + ENTRY_BYTES // 4  # one entry's copy, and a quarter of another
    worker.saver.delay = (3.0, str(gate))  # nothing is written while the hook runs

    def quarter(entry: EntryRef) -> EntryRef:  # an entry whose copy is a quarter of the others'
        return dataclasses.replace(entry, blocks=(entry.blocks[0][:1],))

    behind, other = quarter(entries[2]), quarter(entries[3])
    meta = GalahadMetadata()
    meta.saves += [SaveJob("a", (entries[0], entries[1], behind)), SaveJob("b", (other,))]
    try:
        worker.save(meta)
        # a's second entry finds no room; the small one behind it would fit, and is skipped with
        # it; request b's entry fits and is saved
        assert sorted(worker.saver.take_acks()) == sorted([(entries[1].key, False), (behind.key, False)])
        assert worker.saver.waiting == ENTRY_BYTES + ENTRY_BYTES // 4
    finally:
        gate.unlink()
    assert sorted(_acks(worker, 2)) == sorted([(entries[0].key, True), (other.key, True)])
    assert svc.snapshot_counters().skipped == {"backlog": 2}
    svc.close()


def test_the_pinned_arena_holds_the_longest_prompts_save_beside_saves_being_written() -> None:
    GiB = 1 << 30
    assert arena_bytes(16 * GiB, 1 * GiB) == 6 * GiB  # short prompts: the usual 6 GiB
    # a 33k-token prompt of an 8B model (4.9 GB): room for it and 2 GiB of earlier saves
    assert arena_bytes(16 * GiB, 4_907_335_680) == 4_907_335_680 + 2 * GiB
    assert arena_bytes(3 * GiB, 4_907_335_680) == 3 * GiB  # never more than the KV cache
    assert arena_bytes(64 * GiB, 19 * GiB) == 12 * GiB  # nor more than 12 GiB
