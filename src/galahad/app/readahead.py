"""What the store can tell before anything is read: how much of a hit a load would find in memory
(`residency`: the scheduler prices a load against recomputing), and which parts a restarted
worker reads ahead (`recent_parts`, `GALAHAD_PRELOAD_BYTES`)."""

from __future__ import annotations

from collections.abc import Callable

from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.ports.store import BlockStore, KnowsRecency
from galahad.app.lookup import Hit
from galahad.app.tally import Tally

__all__ = ["RECENT_WAIT_S", "recent_parts", "residency"]

RECENT_WAIT_S = 30.0  # `recent_parts` waits this long at most for the store's scan at open
_RECENT_ASKED = 10_000  # entries `recent_parts` looks at, newest first, at most
_RESIDENCY_SAMPLES = 8  # entries of a hit asked whether the page cache holds them (spread)


def residency(store: BlockStore, part: int, hit: Hit,
              held: Callable[[ChainKey], bool] | None = None) -> tuple[int, float | None]:
    """Bytes of `part` one rank reads to load `hit`, and the share of them in memory now (None:
    unknown). Entries `held` (loaded from the copy of a save still being written) read nothing.

    Reads nothing: sizes and page-cache residency come from the store (`resident_share`).
    A hit of many entries (chunk order: one per 64 tokens) is asked about at most
    `_RESIDENCY_SAMPLES` of them, spread evenly from its first to its last: this runs on the
    engine's thread for every hit, and each ask maps a file (about 80 us on a GPU host).
    """
    entries = hit.entries if held is None else tuple(e for e in hit.entries if not held(e[1]))
    asked = set(_spread(len(entries), _RESIDENCY_SAMPLES))
    total, sampled, resident = 0, 0, 0.0
    try:
        for i, (_span, key) in enumerate(entries):
            size = store.part_size(key, part)
            if size is None:
                return total, None
            total += size
            if i in asked:
                share = store.resident_share(key, part)
                if share is None:
                    return total, None
                sampled += size
                resident += size * share
    except StoreUnavailable:
        return total, None
    return total, (resident / sampled if sampled else None)


def recent_parts(store: BlockStore, part: int, budget: int, *, wait_s: float, tally: Tally,
                 cost: Callable[[int], int] | None = None) -> list[tuple[ChainKey, int]]:
    """Parts `part` of the most recently used committed entries, newest first, with their
    files' sizes, as many as fit in `budget` bytes (each taking `cost(size)` of it, the size
    itself by default). A part too large for what is left is passed over for the next; at most
    `_RECENT_ASKED` entries are looked at. Empty when the store does not know recency; those
    found so far when it cannot be read (said once through `tally`); waits up to `wait_s` for
    the store's scan at open."""
    if budget <= 0 or not isinstance(store, KnowsRecency):
        return []
    weigh = cost or (lambda n: n)
    chosen: list[tuple[ChainKey, int]] = []
    try:
        for asked, (key, parts) in enumerate(store.recent(wait_s)):
            size = parts.get(part)
            if asked >= _RECENT_ASKED or budget <= 0:
                break
            if size is None or weigh(size) > budget or not store.is_committed(key):
                continue
            chosen.append((key, size))
            budget -= weigh(size)
    except StoreUnavailable as exc:
        tally.warn_once("recent", "[galahad] cannot list the store's recent entries: %s", exc)
    return chosen


def _spread(n: int, k: int) -> list[int]:
    """At most k indices of range(n), evenly spread, the first and the last included."""
    if n <= k:
        return list(range(n))
    if k <= 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
