"""What the SGLang backend counts, and SGLang's `StorageMetrics` for `get_stats`.

Store-level counts (loads, saves, bytes, refusals by reason, quarantined) live in the service's
`Counters`. The backend adds what only it sees: calls, pages asked and found, calls that failed
(caught and answered "not found") and calls that ran out of time.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

__all__ = ["BackendCounters", "TransferLog"]


@attrs.define
class BackendCounters:
    """Monotonic counts of one backend instance (never reset; `get_stats` drains `TransferLog`)."""

    calls: int = 0
    pages_asked: int = 0
    pages_found: int = 0
    pages_read: int = 0
    pages_written: int = 0
    pages_present: int = 0
    pages_refused: int = 0
    errors: int = 0
    timeouts: int = 0
    disabled_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


class TransferLog:
    """Pages and bandwidth of each read and write call since the last `drain`, as SGLang wants them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: list[tuple[int, float]] = []
        self._writes: list[tuple[int, float]] = []

    def read(self, pages: int, nbytes: int, seconds: float) -> None:
        if pages:
            with self._lock:
                self._reads.append((pages, _gbps(nbytes, seconds)))

    def write(self, pages: int, nbytes: int, seconds: float) -> None:
        if pages:
            with self._lock:
                self._writes.append((pages, _gbps(nbytes, seconds)))

    def drain(self) -> Any:
        """SGLang's `StorageMetrics` with everything since the last call (None without SGLang's metrics)."""
        with self._lock:
            reads, self._reads = self._reads, []
            writes, self._writes = self._writes, []
        cls = _storage_metrics_class()
        if cls is None:
            return None
        metrics = cls()
        metrics.prefetch_pgs.extend(p for p, _ in reads)
        metrics.prefetch_bandwidth.extend(b for _, b in reads)
        metrics.backup_pgs.extend(p for p, _ in writes)
        metrics.backup_bandwidth.extend(b for _, b in writes)
        return metrics


_METRICS: list[Any] = []


def _storage_metrics_class() -> Any:
    """SGLang's `StorageMetrics`, imported once on first use (it pulls in much of SGLang)."""
    if not _METRICS:
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # noqa: BLE001 - an SGLang without it simply gets no metrics
            StorageMetrics = None  # noqa: N806
        _METRICS.append(StorageMetrics)
    return _METRICS[0]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
