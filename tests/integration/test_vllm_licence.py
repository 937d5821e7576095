"""The licence in vLLM: checked again while serving by the scheduler side and by every worker,
each deciding for its own process; and counted over every GPU rank of the deployment, the
data-parallel engines included.

No engine is started: the connector's scheduler and worker objects run over real services
opened by `open_cache` on a real store, with real licence files signed by the project's issuer
code, and the licence watch's clock moved to a few seconds before the licence's expiry (a
licence expires at 00:00 UTC of a date: it cannot be issued for a few seconds).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("vllm")

from galahad.adapters.vllm.connector import GalahadConnector  # noqa: E402
from galahad.adapters.vllm.metadata import GalahadMetadata, GalahadWorkerMetadata, SaveJob  # noqa: E402
from galahad.adapters.vllm.scheduler import GalahadScheduler  # noqa: E402
from galahad.adapters.vllm.worker import GalahadWorker  # noqa: E402
from galahad.bootstrap import CacheHandle, open_cache  # noqa: E402
from galahad.config import Settings, read_settings  # noqa: E402
from galahad.domain.chain import ChainKey  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from test_vllm_scheduler_saves import _prefill, _request  # noqa: E402
from test_vllm_worker_reads import BLOCK, _caches, _config  # noqa: E402
from vllm_support.licence import make_licence  # noqa: E402

pytestmark = pytest.mark.vllm

NAMESPACE = Namespace(model="licence", model_fingerprint="licence", dtype="float32", kv_cache_dtype="auto",
                      block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),), payload_order=PayloadOrder.CHUNK)
PROMPT = list(range(5 * 64 + 1))


def _settings(tmp_path: Path, lic: str, pub: str) -> Settings:
    return read_settings({"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
                          "GALAHAD_LICENCE_ISSUER_KEY": pub, "GALAHAD_PAYLOAD_ORDER": "chunk"})


def _wait(condition: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def _stop_with(handle: CacheHandle, scheduler: GalahadScheduler | None, worker: GalahadWorker | None) -> None:
    """Start the handle's licence watch as the connector does, with the connector's own stop."""
    assert handle.licence is not None
    handle.licence.start(functools.partial(GalahadConnector._licence_refused,  # noqa: SLF001
                                           NS(_scheduler=scheduler, _worker=worker)))


def _saved_by(worker: GalahadWorker, entries: list) -> GalahadWorkerMetadata:
    """Ship `entries` to the worker as one save job; its report once every part is acknowledged."""
    worker.save(GalahadMetadata(saves=[SaveJob("r", tuple(entries))]))
    report = GalahadWorkerMetadata()
    end = time.monotonic() + 30
    while len(report.saved) < len(entries) and time.monotonic() < end:
        more = worker.take_report()
        if more is not None:
            report.aggregate(more)
        time.sleep(0.01)
    return report


def test_a_licence_that_expires_while_vllm_serves_stops_every_process_and_keeps_the_entries(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At the expiry the scheduler side's watch stops it offering hits and shipping saves, and the
    worker's stops it writing: a save shipped before the expiry and reaching the worker after is
    acknowledged not written, and nothing of it lands on disk. The worker's report says it
    cannot cache, so a scheduler side whose own check has not refused (another view of the
    licence file) stops too, before offering a hit the worker could only fail. What was stored
    before stays committed."""
    lic, pub = make_licence(tmp_path / "lic", days=1)  # expires at the next 00:00 UTC
    expires = dt.datetime.combine(dt.date.today() + dt.timedelta(days=1), dt.time(0), tzinfo=dt.timezone.utc)
    offset = expires - dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=4)

    def clock() -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc) + offset

    settings = _settings(tmp_path, lic, pub)
    sched_side = open_cache(settings, NAMESPACE, RankLayout(), role="scheduler", lookups=True, clock=clock)
    worker_side = open_cache(settings, NAMESPACE, RankLayout(), role="worker rank 0", clock=clock)
    other_side = open_cache(settings, NAMESPACE, RankLayout(), role="scheduler")  # never refuses
    assert sched_side.service and worker_side.service and other_side.service
    sched = GalahadScheduler(sched_side.service, async_load=False, single_group=True)
    other = GalahadScheduler(other_side.service, async_load=False, single_group=True)
    worker = GalahadWorker(worker_side.service, 0, RankLayout(), _config(), BLOCK)
    worker.register(_caches("cpu"))
    try:
        first = _prefill(sched, _request("a", PROMPT))
        sched.update(NS(kv_connector_worker_meta=_saved_by(worker, first)))
        assert _wait(lambda: sched.pending_commits() == 0, 30)
        assert sched.matched(_request("b", PROMPT), 0)[0] > 0  # committed: offered
        late = _prefill(sched, _request("c", list(range(9000, 9000 + 5 * 64 + 1))))  # shipped before the expiry
        assert late

        with caplog.at_level(logging.INFO, logger="galahad"):
            _stop_with(sched_side, sched, None)
            _stop_with(worker_side, None, worker)
            assert _wait(lambda: bool(sched.off and worker.off), 15)
            report = _saved_by(worker, late)  # reaches the worker after the expiry
            other.update(NS(kv_connector_worker_meta=report))
        assert clock() >= expires
        said = [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()]
        reason = (f"licence refused (expired): licence {lic} for galahad tests expired on "
                  f"{expires.date().isoformat()}; ask your vendor for a renewed licence and replace the file")
        tail = ("; nothing more is saved or loaded (the stored entries are kept) and the engine keeps serving; "
                "caching resumes when the server restarts with a valid licence")
        assert sorted(said) == sorted([
            f"[galahad] (scheduler) NOT CACHING from now on: {reason}{tail}",
            f"[galahad] (worker rank 0) NOT CACHING from now on: {reason}{tail}",
            f"[galahad] (scheduler) NOT CACHING from now on: worker rank 0 cannot cache: {reason}; no more hits "
            "are offered and nothing more is saved (the stored entries are kept); fix that rank's cause and restart",
        ]), said

        assert sched.matched(_request("d", PROMPT), 0) == (0, False)  # no hit offered
        assert _prefill(sched, _request("e", list(range(20000, 20000 + 5 * 64 + 1)))) == []  # no save shipped
        assert report.off == {0: reason}
        assert report.saved == {e.key: [(0, False)] for e in late}  # not written, and said so at once
        assert not any(worker_side.service.has_part(ChainKey(e.key), 0) for e in late)
        assert other.matched(_request("f", PROMPT), 0) == (0, False)  # the worker's word stopped it
        assert all(other_side.service.is_committed(ChainKey(e.key)) for e in first)  # kept
    finally:
        for handle in (sched_side, worker_side, other_side):
            if handle.licence is not None:
                handle.licence.close()
            if handle.service is not None:
                handle.service.close()


def test_vllm_data_parallel_engines_count_for_the_licence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each data-parallel engine has its own connector, and each counts the whole deployment:
    vLLM's ParallelConfig of tp 2 x dp 2 is four GPU ranks, so a two-point licence is refused
    in the connector's own startup path, and a four-point one allowed."""
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from galahad.adapters.vllm import connector

    parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    vllm_config = NS(parallel_config=parallel, model_config=NS(use_mla=False, get_total_num_kv_heads=lambda: 2))
    assert connector.data_parallel_size(vllm_config) == 2
    assert connector.data_parallel_size(NS(parallel_config=ParallelConfig())) == 1
    monkeypatch.setattr(connector, "namespace_of", lambda *_: NAMESPACE)  # no model behind this config
    two, pub = make_licence(tmp_path / "lic", points=2, name="two.lic")
    four, _ = make_licence(tmp_path / "lic", points=4, name="four.lic")

    me = NS(_off="", _licence=None)
    service, _ = GalahadConnector._open(me, _settings(tmp_path, two, pub), vllm_config, NS(),  # noqa: SLF001
                                        KVConnectorRole.SCHEDULER)
    assert service is None and "no licence for 4 GPU ranks" in me._off, me._off
    service, _ = GalahadConnector._open(me, _settings(tmp_path, four, pub), vllm_config, NS(),  # noqa: SLF001
                                        KVConnectorRole.SCHEDULER)
    assert service is not None, me._off
    assert (service.layout.world_size, service.layout.gpu_ranks) == (2, 4)
    assert me._licence is not None
    service.close()
