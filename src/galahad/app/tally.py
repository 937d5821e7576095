"""What the use cases count and say: one service's counters, and its warnings said once.

Every counter changes under one lock (the engine adapters add theirs from their own threads);
`take` hands the counts since the last take to a report and starts again from zero, adding what
the store evicted meanwhile where it counts that (`StoreStats`). A warning is logged at WARNING
the first time its topic comes up, then at DEBUG: a failing store says so once, not per block.
"""

from __future__ import annotations

import logging
import threading

from galahad.domain.counter import Counters
from galahad.ports.store import BlockStore, StoreStats

__all__ = ["Tally"]

log = logging.getLogger(__name__)


class Tally:
    """The counters of one service over `store` (thread-safe), and its warnings said once."""

    def __init__(self, store: BlockStore) -> None:
        self.counters = Counters()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._evictions_seen = 0  # the store's running count of evictions at the last take
        self._store_evictions = store.evictions if isinstance(store, StoreStats) else None  # looked up once
        self._counted = False  # something was counted since the last take

    def add(self, **deltas: int | float) -> None:
        """Add to counters by name."""
        with self._lock:
            self._counted = True
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def refused(self, reason: str) -> None:
        """Count a part not loaded, by reason (`load_failures`, `refused_<reason>`)."""
        with self._lock:
            self._counted = True
            self.counters.refuse(reason)
            self.counters.load_failures += 1

    def skipped(self, reason: str) -> None:
        """Count a part not saved, by reason (`saves_skipped`, `saves_skipped_<reason>`)."""
        with self._lock:
            self._counted = True
            self.counters.skip(reason)

    def take(self) -> Counters:
        """The counts since the last take, resetting them (per-report deltas). `evicted` is what
        the store evicted meanwhile (each service opens its own store)."""
        total = self._evictions()
        with self._lock:
            self._counted = False
            counters, self.counters = self.counters, Counters()  # handed over whole: asked every engine step
            counters.evicted += max(0, total - self._evictions_seen)
            self._evictions_seen = max(total, self._evictions_seen)
            return counters

    def idle(self) -> bool:
        """Whether a `take` now would give nothing: nothing counted and nothing evicted since the
        last one. What an engine asks every step: cheaper than a take that finds nothing."""
        return not self._counted and self._evictions() <= self._evictions_seen

    def _evictions(self) -> int:
        """The store's running count of evictions (0 where it does not count them)."""
        return self._store_evictions() if self._store_evictions is not None else 0

    def snapshot(self) -> Counters:
        """A copy of the counts so far, without resetting them."""
        with self._lock:
            return self.counters.copy()

    def warn_once(self, topic: str, msg: str, *args: object) -> None:
        """`msg % args` at WARNING the first time `topic` comes up, at DEBUG after."""
        with self._lock:
            first = topic not in self._warned
            self._warned.add(topic)
        (log.warning if first else log.debug)(msg, *args)
