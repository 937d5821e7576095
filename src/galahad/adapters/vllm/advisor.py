"""Load or recompute, per request, from what this deployment measured (`GALAHAD_LOAD_POLICY=auto`).

The scheduler side asks `LoadAdvisor.choose` before it offers a disk hit to vLLM. The figures
come from the workers' reports: the time of each forward step that loaded nothing (tokens
computed, seconds: the engine's prefill profile) and the time of each load (bytes, seconds:
the store's delivered bandwidth, kept apart for loads that found their bytes in the page cache
and loads that went to the disk). Until a figure exists the advisor assumes loading wins (there
is no evidence against it), except for bytes on the disk, which it prices at a conservative
prior bandwidth. Loads under 32 MiB are always made: they cost milliseconds on any local medium.
The decision itself is the domain's `CostModel`.
"""

from __future__ import annotations

import logging

from galahad.domain.cost import Choice, CostModel, PrefillProfile, StoreSpeed

__all__ = ["LoadAdvisor"]

log = logging.getLogger(__name__)

_ALPHA = 0.3  # weight of a new observation in the running averages
_MIN_STEP_TOKENS = 128  # shorter steps tell little about prefill (decode-dominated)
_WARM_PRIOR = 8e9  # bytes/s: page cache into engine memory, before any load was measured
_COLD_PRIOR = 1.0e9  # bytes/s: an uncached local disk (the H200 machine's measured about 1.4)
_WARM_SHARE = 0.5  # a load with at least this share resident counts as a warm one
_MIN_BYTES = 32 << 20  # smaller loads cost a few ms whatever the medium: always loaded, and not
# used to measure bandwidth (their time is mostly fixed costs, which would make a fast medium
# look slow)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


class LoadAdvisor:
    """Running figures of one engine and store, and the choice they give for a hit."""

    def __init__(self, *, safety: float = 1.1) -> None:
        self.safety = safety
        self._prefill: dict[int, tuple[float, float]] = {}  # size class -> (tokens, seconds)
        self._warm: float | None = None
        self._cold: float | None = None

    # -- observations ---------------------------------------------------------------------------

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A forward step that computed `tokens` tokens and loaded nothing took `seconds`."""
        if tokens < _MIN_STEP_TOKENS or seconds <= 0:
            return
        cls = tokens.bit_length()
        old = self._prefill.get(cls)
        self._prefill[cls] = (tokens, seconds) if old is None else (
            _blend(old[0], tokens), _blend(old[1], seconds))

    def observe_load(self, nbytes: int, seconds: float, share: float | None) -> None:
        """A load of `nbytes` took `seconds`; `share` of its bytes were resident when chosen."""
        if nbytes < _MIN_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        if share is not None and share >= _WARM_SHARE:
            self._warm = _blend(self._warm, rate)
        else:
            self._cold = _blend(self._cold, rate)

    # -- the choice -----------------------------------------------------------------------------

    def model(self) -> CostModel | None:
        """The cost model of the figures so far; None before any prefill step was measured."""
        if not self._prefill:
            return None
        prefill = PrefillProfile(tuple(self._prefill.values()))
        store = StoreSpeed(self._warm or _WARM_PRIOR, self._cold or _COLD_PRIOR)
        return CostModel(prefill, store, self.safety)

    def choose(self, tokens: int, nbytes: int, share: float | None) -> Choice | None:
        """The choice for a hit sparing `tokens` tokens by reading `nbytes`; None: load (no figures)."""
        model = self.model()
        if model is None or nbytes < _MIN_BYTES:
            return None
        return model.choose(tokens, nbytes, 1.0 if share is None else share)

    def describe(self) -> str:
        pts = ", ".join(f"{int(n)} tok {s * 1e3:.1f} ms" for n, s in sorted(self._prefill.values()))
        warm = f"{self._warm / 1e9:.1f}" if self._warm else f"prior {_WARM_PRIOR / 1e9:.1f}"
        cold = f"{self._cold / 1e9:.1f}" if self._cold else f"prior {_COLD_PRIOR / 1e9:.1f}"
        return f"prefill [{pts}]; load GB/s warm {warm}, cold {cold}"
