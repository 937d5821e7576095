"""`GalahadConnector`: vLLM's KV connector API (0.32) over Galahad's service.

vLLM creates one instance per role: the scheduler side in the EngineCore process and one
worker side per TP/PP rank. This class only adapts the hooks; the logic is in `scheduler.py`
and `worker/`. Every hook runs inside `boundary`: vLLM never sees a Galahad exception. A
malformed `GALAHAD_*` setting is the one error raised on purpose, at construction, so that the
server refuses to start with a message naming the setting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from galahad.adapters.vllm import compat

compat.install_names()  # vLLM 0.26 lacks names imported below (a no-op on 0.32)

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from galahad.adapters.vllm.advisor import LoadAdvisor, prefill_floor_of
from galahad.adapters.vllm.diagnostics import Diagnostics
from galahad.adapters.vllm.guard import ErrorCount, boundary
from galahad.adapters.vllm.metadata import GalahadHandshake, GalahadMetadata
from galahad.adapters.vllm.namespace import HybridPlanUnavailable, cannot_resume, namespace_of, rank_layout_of
from galahad.adapters.vllm.registration import route_logs
from galahad.adapters.vllm.scheduler import GalahadScheduler
from galahad.adapters.vllm.stats import GalahadPromMetrics, GalahadStats, to_data
from galahad.adapters.vllm.worker import GalahadWorker
from galahad.bootstrap import open_cache
from galahad.config import Settings, read_settings
from galahad.domain.counter import Counters
from galahad.domain.namespace import PayloadOrder
from galahad.domain.plan import StatePlan
from galahad.app.service import KVCacheService

try:  # vLLM >= 0.3x: per-tier hit metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _DISK: Any = CacheHitSource.DISK
except ImportError:  # pragma: no cover - older vLLM
    _DISK = None

if TYPE_CHECKING:
    import torch

    from galahad.adapters.licence import LicenceWatch

__all__ = ["GalahadConnector", "data_parallel_size"]

log = logging.getLogger(__name__)


def _results() -> KVConnectorTransferResults:
    return KVConnectorTransferResults()


class GalahadConnector(KVConnectorBase_V1, SupportsHMA):
    """Galahad's disk tier for vLLM: `--kv-transfer-config '{"kv_connector":"GalahadConnector",...}'`."""

    if _DISK is not None:
        _cache_hit_source = _DISK

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_logs()
        self._errors = ErrorCount()
        self._scheduler: GalahadScheduler | None = None
        self._worker: GalahadWorker | None = None
        self._off = ""  # why this process does not cache (a worker reports it to the scheduler side)
        self._licence: LicenceWatch | None = None  # the licence checked again while serving
        settings = read_settings()  # ConfigError here stops the server, naming the setting
        self._diag = Diagnostics.of(settings.test)
        service, rank = self._open(settings, vllm_config, kv_cache_config, role)
        self._service = service
        if role != KVConnectorRole.SCHEDULER:
            self._diag.rank = rank or 0
        if role == KVConnectorRole.SCHEDULER:
            if service is not None:
                single = len(kv_cache_config.kv_cache_groups) == 1
                self._scheduler = GalahadScheduler(service, async_load=settings.async_load,
                                                   single_group=single,
                                                   advisor=_advisor(settings, service, vllm_config),
                                                   chain_fallback=settings.payload_order is not
                                                   service.namespace.payload_order,
                                                   pending_loads=True)
        else:
            block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
            layout = service.layout if service else rank_layout_of(vllm_config, kv_cache_config)
            self._worker = GalahadWorker(service, rank or 0, layout, kv_cache_config, block_size,
                                         perturb=self._diag.perturb_load,
                                         save_delay=self._diag.save_delay_of(rank or 0),
                                         pending_loads=True, preload_bytes=settings.preload_bytes,
                                         max_tokens=_max_model_len(vllm_config))
            if service is None:
                self._worker.cannot_cache(self._off or "the store did not open")
        if self._licence is not None:
            self._licence.start(self._licence_refused)

    def _licence_refused(self, reason: str) -> None:
        """The licence, checked again while serving, is refused (its watch said so, once): this
        process stops caching; a worker tells the scheduler side in its next report."""
        if self._scheduler is not None:
            self._scheduler.halt(reason)
        if self._worker is not None:
            self._worker.cannot_cache(reason)

    def _open(self, settings: Settings, vllm_config: Any, kv_cache_config: Any,
              role: KVConnectorRole) -> tuple[KVCacheService | None, int | None]:
        rank: int | None = None
        who, fallback = "scheduler", False
        try:
            layout = attrs.evolve(rank_layout_of(vllm_config, kv_cache_config),
                                  dp_size=data_parallel_size(vllm_config))
            if role == KVConnectorRole.WORKER:
                rank = _worker_rank(layout)
                who = f"worker rank {rank}"
            why = cannot_resume(vllm_config)
            if why:
                log.warning("[galahad] (%s) NOT CACHING: %s", who, why)
                self._off = why
                return None, rank
            namespace = namespace_of(vllm_config, kv_cache_config, settings.payload_order)
            if StatePlan(namespace.groups).is_hybrid and settings.payload_order is PayloadOrder.CHUNK:
                # vLLM keeps a sliding window or a state only near where a prefill ends, not at
                # every 64-token sharing point: hybrid models save one entry per prompt
                # (counted as saver_chain_fallback)
                namespace = namespace_of(vllm_config, kv_cache_config, PayloadOrder.LAYER)
                settings, fallback = attrs.evolve(settings, payload_order=PayloadOrder.LAYER), True
        except HybridPlanUnavailable as exc:
            log.warning("[galahad] (%s) hybrid KV plan unavailable: %s", who, exc)
            log.warning("[galahad] (%s) NOT CACHING: hybrid KV plan unavailable: %s", who, exc)
            self._off = f"hybrid KV plan unavailable: {exc}"
            return None, rank
        except Exception as exc:  # noqa: BLE001 - host boundary: serve without caching
            log.warning("[galahad] (%s) NOT CACHING: cannot describe this engine: %s", who, exc,
                        exc_info=True)
            self._off = f"cannot describe this engine: {exc}"
            return None, rank
        try:
            handle = open_cache(settings, namespace, layout, role=who,
                                lookups=role == KVConnectorRole.SCHEDULER)
        except Exception as exc:  # noqa: BLE001 - host boundary: serve without caching
            log.warning("[galahad] (%s) NOT CACHING: %s: %s", who, type(exc).__name__, exc,
                        exc_info=True)
            self._off = f"{type(exc).__name__}: {exc}"
            return None, rank
        self._off, self._licence = handle.reason, handle.licence
        if handle.service is not None and role == KVConnectorRole.WORKER:
            self._diag.announce(who)
        plan = StatePlan(namespace.groups)
        if handle.service is not None and role == KVConnectorRole.SCHEDULER and plan.is_hybrid:
            log.info("[galahad] (%s) hybrid KV manager ON: %d KV cache groups, an entry holds every "
                     "group's part and loads all or none; %s; saving points every %d tokens%s",
                     who, len(namespace.groups), plan.describe(), handle.service.chunking.step,
                     " (GALAHAD_PAYLOAD_ORDER=chunk falls back to one entry per prompt, counted "
                     "as saver_chain_fallback)" if fallback else "")
        return handle.service, rank

    # -- properties -----------------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a preempted request simply recomputes

    # -- scheduler side -------------------------------------------------------------------------

    @boundary(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.matched(request, num_computed_tokens)

    @boundary(lambda: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None and num_external_tokens > 0:
            self._scheduler.after_alloc(request, blocks, num_external_tokens)

    @boundary(GalahadMetadata)
    def build_connector_meta(self, scheduler_output: Any) -> GalahadMetadata:
        if self._scheduler is None:
            return GalahadMetadata()
        return self._scheduler.build_meta(scheduler_output)

    @boundary(lambda: None)
    def update_connector_output(self, connector_output: Any) -> None:
        self._diag.observe_workers(getattr(connector_output, "kv_connector_stats", None))
        if self._scheduler is not None:
            self._scheduler.update(connector_output)
            self._diag.set_pending(self._scheduler.pending_commits())

    @boundary(lambda: (False, None))
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._request_done(request)
        return False, None

    @boundary(lambda: (False, None))
    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._request_done(request)
        return False, None

    def _request_done(self, request: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.finished(request)
        if self._diag.counters_file:  # test only: the counters file says what has finished
            if self._scheduler is not None:
                # its save was shipped by now (the step its prefill completed): pending, so a test
                # reading the file waits for its commit (update_connector_output comes later)
                self._diag.set_pending(self._scheduler.pending_commits(reap=False))
            self._diag.note_finished()  # only ever called on the scheduler side

    @boundary(lambda: False)
    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending_commits(reap=False) > 0

    # -- worker side ----------------------------------------------------------------------------

    @boundary(lambda: None)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None and self._service is not None:
            self._worker.register(kv_caches)

    # -- handshake: after every worker registered its KV caches, before the first request -------

    @boundary(lambda: None)
    def get_handshake_metadata(self) -> GalahadHandshake | None:
        """A worker that cannot cache says so (vLLM hands it to the scheduler side at startup)."""
        if self._worker is None or not self._worker.off:
            return None
        return GalahadHandshake(rank=self._worker.rank, off=self._worker.off)

    @boundary(lambda: None)
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._workers_said(metadata.values())

    @boundary(lambda: None)
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._workers_said(metadata.values())  # every pipeline stage's workers (no P/D here)

    def _workers_said(self, said: Iterable[Any]) -> None:
        off = {m.rank: m.off for m in said if isinstance(m, GalahadHandshake) and m.off}
        if off and self._scheduler is not None:
            self._scheduler.stop(off)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Nothing to flush: saves copy their blocks out inside the step that computed them."""

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Bound before the step's forward on every vLLM build (0.32 starts the loads of a step
        without synchronous ones only after its forward): the step's clock starts here and stops
        in `wait_for_save`, after the forward, so the prefill figures time the forward itself."""
        super().bind_connector_metadata(connector_metadata)
        self._step_started(connector_metadata)

    @boundary(lambda: None)
    def _step_started(self, meta: Any) -> None:
        if self._worker is not None and isinstance(meta, GalahadMetadata):
            self._worker.step_started(meta)

    @boundary(lambda: None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, GalahadMetadata):
                self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete before the forward (sync) or before the request is scheduled (async)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves copy whole blocks in `wait_for_save`, after every layer wrote them."""

    @boundary(lambda: None)
    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, GalahadMetadata):
                self._worker.step_ended()
                self._worker.save(meta)

    @boundary(_results)
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return _results()
        finished, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    @boundary(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_blocks() if self._worker is not None else set()

    @boundary(lambda: None)
    def build_connector_worker_meta(self) -> Any:
        return self._worker.take_report() if self._worker is not None else None

    # -- stats ----------------------------------------------------------------------------------

    @boundary(lambda: None)
    def get_kv_connector_stats(self) -> GalahadStats | None:
        # asked twice a step on the engine's thread: a step that counted nothing builds nothing
        extra = {"errors": self._errors.take()}
        if self._scheduler is not None:
            extra["committed"], self._scheduler.committed = self._scheduler.committed, 0
        if not any(extra.values()) and (self._service is None or not self._service.counted()):
            return None
        counters = self._service.take_counters() if self._service is not None else Counters()
        stats = GalahadStats(data=to_data(counters, extra))
        if stats.is_empty():
            return None
        if self._scheduler is not None or self._diag.rank is not None:
            self._diag.observe_own(stats)
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> GalahadStats:
        return GalahadStats(data=dict(data)) if data is not None else GalahadStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> GalahadPromMetrics:
        return GalahadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        try:
            if self._licence is not None:
                self._licence.close()
            if self._scheduler is not None:
                self._diag.log_totals()
                self._scheduler.close()
            if self._worker is not None:
                self._worker.stop_saving()  # queued saves could no longer be committed
                self._worker.wait_idle()
            if self._service is not None:
                self._service.close()
            self._diag.flush()
        except Exception:  # noqa: BLE001 - host boundary
            log.debug("[galahad] shutdown", exc_info=True)


compat.route_block_state(GalahadConnector)  # vLLM 0.26: the block table rebuilt (no-op on 0.32)


def _advisor(settings: Settings, service: KVCacheService, vllm_config: Any) -> LoadAdvisor | None:
    """The load-or-recompute advisor (`GALAHAD_LOAD_POLICY=auto`), its figures kept beside the store."""
    if settings.load_policy != "auto":
        return None
    path = os.path.join(settings.cache_dir, f"figures-{service.digest.hex()[:16]}.json")
    return LoadAdvisor(path=path, floor=prefill_floor_of(vllm_config))


def data_parallel_size(vllm_config: Any) -> int:
    """How many data-parallel engines serve beside this one (vLLM's `data_parallel_size`, across
    every node): each has its own connector, and all of them count for the licence."""
    return max(1, int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1))


def _max_model_len(vllm_config: Any) -> int:
    """The longest prompt the engine takes, in tokens (0: not said)."""
    try:
        return max(0, int(getattr(vllm_config.model_config, "max_model_len", 0) or 0))
    except (AttributeError, TypeError, ValueError):
        return 0


def _worker_rank(layout: Any) -> int:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return int(layout.rank_of(get_tensor_model_parallel_rank(), get_pp_group().rank_in_group))
