"""Load or recompute, per request, from what this deployment measured (`GALAHAD_LOAD_POLICY=auto`).

The scheduler side asks `LoadAdvisor.choose` before it offers a disk hit to vLLM. The figures
come from the workers' reports: the time of each forward step that loaded nothing (tokens
computed, seconds: the engine's prefill profile) and the time of each load (bytes, seconds:
the store's delivered bandwidth, kept apart for loads that found their bytes in the page cache
and loads that went to the disk). Until a figure exists the advisor assumes loading wins (there
is no evidence against it), except for bytes on the disk, which it prices at a conservative
prior bandwidth. Loads under 32 MiB are always made: they cost milliseconds on any local medium.
The first load of a process is not measured: it pays once for what later loads find ready (the
I/O threads started, the cipher library loaded, the first pinned copies), which made a sealed
store look 3-4x slower than it is on the H200 machine and every later hit recomputed.
After eight page-cache hits recomputed in a row the ninth is loaded anyway, to measure again.
The decision itself is the domain's `CostModel`.

The figures outlive the process: kept in a small JSON file beside the store (`figures-<namespace
digest>.json`, written atomically at most every 30 s and at shutdown, read at startup), so the
first requests after a restart, the ones a warm restart is for, are decided on the last run's
figures. A missing or unreadable file only means starting without figures.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import attrs

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
_EXPLORE_EVERY = 8  # after this many warm hits recomputed in a row, one is loaded to measure again


def _finite(value: Any) -> bool:
    """A real number that is not infinite nor NaN (json reads `Infinity` and `NaN`; a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


class LoadAdvisor:
    """Running figures of one engine and store, and the choice they give for a hit."""

    def __init__(self, *, safety: float = 1.1, path: str | None = None, warm_up: bool = True) -> None:
        self.safety = safety
        self._warming = warm_up  # the next measurable load is the process's first: not measured
        self.path = path
        self._prefill: dict[int, tuple[float, float]] = {}  # size class -> (tokens, seconds)
        self._warm: float | None = None
        self._cold: float | None = None
        self._dirty = False
        self._saved_at = 0.0
        self._declined = 0  # warm hits recomputed in a row (see `choose`)
        if path is not None:
            self._read(path)

    # -- figures kept across restarts -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "prefill": sorted(self._prefill.values()), "warm_bps": self._warm,
                "cold_bps": self._cold}

    def _read(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if doc.get("version") != 1:
                return
            for tokens, seconds in doc.get("prefill", []):
                if not (_finite(tokens) and _finite(seconds)):
                    raise ValueError(f"a prefill figure that is not a finite number: {tokens!r}, {seconds!r}")
                self.observe_step(int(tokens), float(seconds))
            warm, cold = doc.get("warm_bps"), doc.get("cold_bps")
            self._warm = float(warm) if _finite(warm) and warm > 0 else None
            self._cold = float(cold) if _finite(cold) and cold > 0 else None
            self._dirty = False
            log.info("[galahad] load or recompute: figures of the last run: %s", self.describe())
        except FileNotFoundError:
            return
        # RecursionError: a deeply nested document (json's parser recurses); OverflowError: an
        # integer too large for a float. Every figure is checked above: no infinity or NaN from a
        # damaged file prices a load
        except (OSError, ValueError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
            log.warning("[galahad] load or recompute: ignoring the figures file %s (%s); starting "
                        "without figures", path, exc)
            self._prefill, self._warm, self._cold = {}, None, None

    def save(self, *, force: bool = False) -> None:
        """Write the figures (atomically) if they changed, at most every 30 s unless `force`."""
        now = time.monotonic()
        if self.path is None or not self._dirty or (not force and now - self._saved_at < 30.0):
            return
        self._saved_at, self._dirty = now, False
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.debug("[galahad] could not keep the load figures in %s: %s", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    # -- observations ---------------------------------------------------------------------------

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A forward step that computed `tokens` tokens and loaded nothing took `seconds`."""
        if tokens < _MIN_STEP_TOKENS or seconds <= 0:
            return
        self._dirty = True
        cls = tokens.bit_length()
        old = self._prefill.get(cls)
        self._prefill[cls] = (tokens, seconds) if old is None else (
            _blend(old[0], tokens), _blend(old[1], seconds))

    def observe_load(self, nbytes: int, seconds: float, share: float | None) -> None:
        """A load of `nbytes` took `seconds`; `share` of its bytes were resident when chosen."""
        if nbytes < _MIN_BYTES or seconds <= 0:
            return
        if self._warming:
            self._warming = False
            return
        self._dirty = True
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
        """The choice for a hit sparing `tokens` tokens by reading `nbytes`; None: load, unpriced
        (no figures yet, or a small load).

        A warm figure taken at a bad moment (the first loads of a process pin their buffers)
        would otherwise never be corrected once it says "recompute": no load is made, so none
        is measured. So after `_EXPLORE_EVERY` warm hits recomputed in a row, the next one is
        loaded, and its time updates the figures. Cold hits are not re-tried: their figure is
        the disk's, and a cold load that loses costs several prefills."""
        model = self.model()
        if model is None or nbytes < _MIN_BYTES:
            return None
        share = 1.0 if share is None else share
        choice = model.choose(tokens, nbytes, share)
        if choice.load or share < _WARM_SHARE:  # a cold load's figure is the disk's: not re-tried
            return choice
        self._declined += 1
        if self._declined > _EXPLORE_EVERY:
            self._declined = 0
            # loaded like a priced load (inside the step), so it measures the store, not the
            # store competing with a running engine for the interpreter
            return attrs.evolve(choice, load=True)
        return choice

    def describe(self) -> str:
        pts = ", ".join(f"{int(n)} tok {s * 1e3:.1f} ms" for n, s in sorted(self._prefill.values()))
        warm = f"{self._warm / 1e9:.1f}" if self._warm else f"prior {_WARM_PRIOR / 1e9:.1f}"
        cold = f"{self._cold / 1e9:.1f}" if self._cold else f"prior {_COLD_PRIOR / 1e9:.1f}"
        return f"prefill [{pts}]; load GB/s warm {warm}, cold {cold}"
