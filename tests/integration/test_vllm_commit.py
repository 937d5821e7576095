"""The commit rule on the scheduler side, without an engine: a real service over the filesystem
store; the workers' acknowledgements are given as vLLM would deliver them. The commit marker is
written on the service's save threads, never in the engine's step, and counted as pending until
it is on disk."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from galahad.adapters.fs.store import FilesystemBlockStore  # noqa: E402
from galahad.adapters.vllm.metadata import GalahadWorkerMetadata  # noqa: E402
from galahad.adapters.vllm.scheduler import GalahadScheduler, _Inflight  # noqa: E402
from galahad.codec import cipher_lookup  # noqa: E402
from galahad.domain.chain import ChainKey  # noqa: E402
from galahad.domain.chunking import Chunking, Span  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.service import KVCacheService, SegmentSpec  # noqa: E402

pytestmark = pytest.mark.vllm


def _service(root: Path, layout: RankLayout) -> KVCacheService:
    ns = Namespace(model="commit", model_fingerprint="commit", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 1),), tp_size=layout.tp_size)
    root.mkdir(mode=0o700)
    check = Xxh3FrameCheck()
    return KVCacheService(namespace=ns, store=FilesystemBlockStore(root, ns, rescan_s=None),
                          chunking=Chunking(PayloadOrder.LAYER, 16), layout=layout, cipher=check,
                          ciphers=cipher_lookup(check))


def _acks(key: ChainKey, *ranks: int) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_worker_meta=GalahadWorkerMetadata(saved={key.raw: [(r, True) for r in ranks]}))


def test_the_marker_is_written_off_the_engine_thread_and_pending_until_it_is(tmp_path: Path) -> None:
    layout = RankLayout(tp_size=2)
    svc = _service(tmp_path / "store", layout)
    sched = GalahadScheduler(svc, async_load=True, single_group=True)
    key = ChainKey(bytes(range(32)))
    for rank in (0, 1):  # both ranks' parts are durable
        assert svc.save_part(key, Span(0, 16), rank, [SegmentSpec(0, 0, 0, "bfloat16", (1, 2, 16, 64))], [bytes(4096)])
    gate, threads = threading.Event(), []
    real_commit = svc.commit

    def slow_commit(k: ChainKey) -> bool:  # a disk that takes its time
        threads.append(threading.current_thread().name)
        gate.wait(10)
        return real_commit(k)

    svc.commit = slow_commit  # type: ignore[method-assign]
    sched._inflight[key.raw] = _Inflight(time.monotonic())  # the save job vLLM shipped
    sched.update(_acks(key, 0))  # one rank of two: nothing to commit yet
    assert not threads and sched.pending_commits() == 1
    sched.update(_acks(key, 1))  # returns at once, the marker still being written
    assert sched.pending_commits() == 1 and not svc.is_committed(key)
    gate.set()
    svc._saves.shutdown(wait=True)
    assert threads and threads[0].startswith("galahad-save")
    assert svc.is_committed(key) and sched.pending_commits() == 0 and sched.take_committed() == 1
    assert sched.take_committed() == 0  # counted once
    svc.store.close()


def test_an_entry_a_rank_could_not_write_is_never_committed(tmp_path: Path) -> None:
    layout = RankLayout(tp_size=2)
    svc = _service(tmp_path / "store", layout)
    sched = GalahadScheduler(svc, async_load=True, single_group=True)
    key = ChainKey(bytes(32))
    sched._inflight[key.raw] = _Inflight(time.monotonic())
    sched.update(SimpleNamespace(kv_connector_worker_meta=GalahadWorkerMetadata(saved={key.raw: [(0, True), (1, False)]})))
    svc._saves.shutdown(wait=True)
    assert sched.pending_commits() == 0 and not svc.is_committed(key) and sched.take_committed() == 0
    svc.store.close()
