"""Galahad's counters as vLLM connector stats: the `KV Transfer metrics:` log line and Prometheus.

Each report is a delta (the counts since the last report, `KVCacheService.take_counters`); vLLM
merges workers and the scheduler side with `aggregate` and the frontend sums reports over a
logging interval, then prints `reduce()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from galahad.domain.counter import Counters

__all__ = ["GalahadPromMetrics", "GalahadStats", "LINE_ORDER"]

# The first keys of the log line, in this order (the product page's example line starts
# `hits_disk=3, loads=3, saver_chain_saved=1, chain_hits=3, hit_rate=25.0`); every other counter follows.
LINE_ORDER = (
    "hits_disk", "loads", "saver_chain_saved", "chain_hits", "hit_rate", "saver_chain_fallback",
    "lookups", "saves", "saves_skipped", "bytes_loaded", "bytes_saved", "load_seconds",
    "save_seconds", "load_failures", "quarantined", "committed",
)  # fmt: skip
_EXTRA = ("committed", "errors")  # adapter-only counters (not in `Counters`)


def counters_of(data: dict[str, Any] | None) -> tuple[Counters, dict[str, int]]:
    data = data or {}
    extra = {name: int(data.get(name, 0)) for name in _EXTRA}
    return Counters.from_dict(dict(data)), extra


def to_data(counters: Counters, extra: dict[str, int] | None = None) -> dict[str, Any]:
    data = counters.as_dict()
    for name in _EXTRA:
        data[name] = int((extra or {}).get(name, 0))
    return data


@dataclass
class GalahadStats(KVConnectorStats):
    """`data` is `Counters.as_dict()` plus adapter-only counters: plain ints and floats."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # every value is a count (`to_data`; a per-reason one under a name of its own): adding
        # them name by name is what merging the `Counters` is, without rebuilding them (vLLM
        # merges the workers' and the scheduler side's reports on its engine thread every step)
        theirs = other.data if other is not None else None
        if theirs:
            mine = self.data
            for name, value in theirs.items():
                mine[name] = mine.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        counters, extra = counters_of(self.data)
        flat = counters.as_dict()
        flat["hit_rate"] = round(counters.hit_rate, 1)
        flat.update(extra)
        out: dict[str, int | float] = {}
        for key in LINE_ORDER:
            out[key] = _round(flat.pop(key, 0))
        for key in sorted(flat):
            out[key] = _round(flat[key])
        return out

    def is_empty(self) -> bool:
        # `data` holds only counts (`to_data`): asked twice a step on the engine's thread, so the
        # counts are looked at as they are, not rebuilt into `Counters` first
        return not any(self.data.values())


def _round(value: Any) -> int | float:
    return round(value, 4) if isinstance(value, float) else int(value)


_PROM_COUNTERS = (
    ("hits_disk", "Requests that loaded a prefix from Galahad's disk store"),
    ("lookups", "Requests Galahad looked up"),
    ("loads", "Requests whose disk load completed without error"),
    ("chain_hits", "Requests that reused a shared beginning (chunk order)"),
    ("saves", "Entry parts written"),
    ("saves_skipped", "Entry parts not written (by reason on the log line: saves_skipped_<reason>)"),
    ("bytes_loaded", "Bytes read from the store"),
    ("bytes_saved", "Bytes written to the store"),
    ("load_failures", "Parts refused on load"),
    ("quarantined", "Entries quarantined"),
    ("namespace_misses", "Lookups that missed while another TP x PP layout of the model holds the prompt"),
    ("committed", "Entries committed: every rank's part durable"),
    ("held_loads", "Entries loaded from a save's copy before their part was durable"),
    ("preloaded", "Parts read ahead into memory when the worker started (GALAHAD_PRELOAD_BYTES)"),
    ("preloaded_loads", "Entries loaded from parts read ahead at startup, nothing read at the request"),
    ("bypassed", "Requests not looked up, and hits recomputed because loading would be slower"),
    ("hits_recomputed", "Hits recomputed because the measured figures priced loading them slower"),
    ("evicted", "Entries evicted to stay under GALAHAD_MAX_BYTES"),
    ("errors", "Exceptions caught at a vLLM hook (the request degraded to a miss); should stay 0"),
)


class GalahadPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters `vllm:galahad_<name>_total`, one per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in _PROM_COUNTERS:
            metric = self._counter_cls(name=f"vllm:galahad_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._counters[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
