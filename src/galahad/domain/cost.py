"""Load or recompute: whether reading a stored prefix beats computing it again, per request.

A cache that always loads makes the server slower wherever the medium is slow: on the H200
machine, recomputing a 2k-token prompt of an 8B model takes about 53 ms, while reading its 302 MB
from the uncached disk (about 1.4 GB/s) takes over 200 ms. The deployment's own figures decide:

- `PrefillProfile`: the engine's measured prefill time at a few prompt lengths (interpolated;
  prefill grows faster than linearly with attention, so one rate would mislead);
- `StoreSpeed`: the bandwidth the store delivered into the engine with the page cache warm and
  cold, and a fixed cost per load (lookup, scheduling, the extra step of an asynchronous load);
- the share of the entry's bytes likely in the page cache (`cached_share`), from the adapter.

`CostModel.choose` compares the expected load time, with a safety factor for the estimate's
error, against the recompute time of the same tokens; a hit not loaded is counted `bypassed`.
Pure: no clock, no I/O; the caller measures and passes figures in.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from galahad.domain.counter import Counters

__all__ = ["Choice", "CostModel", "PrefillFloor", "PrefillProfile", "StoreSpeed", "cached_share_since_boot"]

# No accelerator computes faster than this in any precision (the fastest dense peak, an NVIDIA
# B300 in FP4, is 1.5e16 FLOP/s), nor runs a transformer layer's forward in under a microsecond
_PEAK_FLOPS = 2e16
_LAYER_S = 1e-6


def _points(value: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    pts = tuple(sorted((int(n), float(s)) for n, s in value))
    if not pts:
        raise ValueError("a prefill profile needs at least one (tokens, seconds) point")
    if any(n <= 0 or s <= 0 for n, s in pts):
        raise ValueError("prefill points must have positive tokens and seconds")
    return pts


@attrs.frozen
class PrefillProfile:
    """Measured prefill seconds at some prompt lengths; `seconds(n)` interpolates linearly.

    Below the first point the time scales with the tokens from zero. Beyond the last it follows
    the slope of the last two points, and never falls below the last point's rate: the points are
    forward steps, and a prompt longer than the longest step measured is computed in several
    steps of it, each costing at least that step's time (attention over the longer context only
    adds). Two short steps' slope alone leaves out each step's fixed cost: from steps of 1024
    and 2048 tokens taking 38.4 and 49.8 ms (an H100) it gives a 32k-token prompt 0.39 s, where
    the prompt takes 1.27 s and the rate gives 0.80 s.
    """

    points: tuple[tuple[int, float], ...] = attrs.field(converter=_points)

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        pts = self.points
        n0, s0 = pts[0]
        if tokens <= n0:
            return s0 * tokens / n0
        for (a, sa), (b, sb) in zip(pts, pts[1:]):
            if tokens <= b:
                return sa + (sb - sa) * (tokens - a) / (b - a)
        (b, sb) = pts[-1]
        rate = sb * tokens / b
        if len(pts) == 1:
            return rate
        a, sa = pts[-2]
        return max(rate, sb + (sb - sa) * (tokens - b) / (b - a))


@attrs.frozen
class PrefillFloor:
    """The least time any hardware takes to prefill tokens of one model: a measured figure below
    it is a broken clock, not a fast engine.

    `flops_per_token`: a lower bound of one rank's arithmetic per token (the attention projections
    alone, two operations per weight), `layers` the layers a rank runs."""

    flops_per_token: float
    layers: int

    def seconds(self, tokens: int) -> float:
        return max(tokens * self.flops_per_token / _PEAK_FLOPS, self.layers * _LAYER_S)

    def plausible(self, tokens: int, seconds: float) -> bool:
        return seconds >= self.seconds(tokens)


@attrs.frozen
class StoreSpeed:
    """What the store delivered into the engine: bytes/s warm (page cache) and cold, plus a fixed cost."""

    warm_bytes_per_s: float
    cold_bytes_per_s: float
    overhead_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.warm_bytes_per_s <= 0 or self.cold_bytes_per_s <= 0 or self.overhead_s < 0:
            raise ValueError("store speeds must be positive and the overhead not negative")

    def seconds(self, nbytes: int, cached_share: float) -> float:
        share = min(1.0, max(0.0, cached_share))
        return self.overhead_s + nbytes * (share / self.warm_bytes_per_s
                                           + (1.0 - share) / self.cold_bytes_per_s)


@attrs.frozen
class Choice:
    """The decision for one hit: load it or recompute it, with the two estimates behind it."""

    load: bool
    load_s: float
    recompute_s: float

    def record(self, counters: Counters) -> None:
        """Count a hit that is recomputed instead of loaded as `bypassed` and `hits_recomputed`."""
        if not self.load:
            counters.bypassed += 1
            counters.hits_recomputed += 1


@attrs.frozen
class CostModel:
    """Load a hit only when its expected load time, times `safety`, is below recomputing it."""

    prefill: PrefillProfile
    store: StoreSpeed
    safety: float = 1.1

    def __attrs_post_init__(self) -> None:
        if self.safety < 1.0:
            raise ValueError("the safety factor must be at least 1")

    def choose(self, tokens: int, nbytes: int, cached_share: float) -> Choice:
        """`tokens` the hit would spare computing, `nbytes` it would read, share likely cached."""
        load_s = self.store.seconds(nbytes, cached_share)
        recompute_s = self.prefill.seconds(tokens)
        return Choice(load_s * self.safety < recompute_s, load_s, recompute_s)


def cached_share_since_boot(written_or_read_at: float, boot_at: float) -> float:
    """1.0 when the file was written or read since the machine booted (likely in the page cache,
    e.g. after a process restart), else 0.0 (after a reboot nothing is cached). Timestamps in s."""
    return 1.0 if written_or_read_at >= boot_at else 0.0
