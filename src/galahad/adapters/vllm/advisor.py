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
store look 3-4x slower than it is (an H200 host) and every later hit recomputed.
After eight page-cache hits recomputed in a row the ninth is loaded anyway, to measure again.
The decision itself is the domain's `CostModel`.

A figure is checked before it is believed. A prefill step faster than any hardware runs this
model (`PrefillFloor`: zero, or beyond the peak arithmetic of any accelerator) is a broken clock:
it is refused, said once in the log, and hits keep loading (the default), never "recompute, it
is free". Each hit recomputed is itself a prefill step, measured: it corrects the figures that
chose it, so a deployment wrongly told to recompute loads again after a request or two.

The figures outlive the process: kept in a small JSON file beside the store (`figures-<namespace
digest>.json`, written atomically at most every 30 s and at shutdown, read at startup), so the
first requests after a restart, the ones a warm restart is for, are decided on the last run's
figures. That file is untrusted input like any other: each figure in it is checked as a
measurement is (a store bandwidth outside 1 MB/s to 10 TB/s is refused too), and it only stands
in until this process measured its own. A prefill step measured here replaces the file's figure
of its size and every file figure it contradicts (more than four times faster or slower per
token); a hit recomputed because of a store bandwidth from the file is loaded instead every
third time, until a load measured here replaces it. A missing, unreadable or wrong file so costs
a few requests at most.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
import time
from typing import Any

import attrs

from galahad.domain.cost import Choice, CostModel, PrefillFloor, PrefillProfile, StoreSpeed
from galahad.adapters.posix.regular_file import read_regular

__all__ = ["MIN_STEP_TOKENS", "LoadAdvisor", "prefill_floor_of"]

log = logging.getLogger(__name__)

_ALPHA = 0.3  # weight of a new observation in the running averages
MIN_STEP_TOKENS = 128  # shorter steps tell little about prefill (decode-dominated)
_WARM_PRIOR = 8e9  # bytes/s: page cache into engine memory, before any load was measured
_COLD_PRIOR = 1.0e9  # bytes/s: an uncached local disk (an H200 host's disk measured about 1.4)
_WARM_SHARE = 0.5  # a load with at least this share resident counts as a warm one
_MIN_BYTES = 32 << 20  # smaller loads cost a few ms whatever the medium: always loaded, and not
# used to measure bandwidth (their time is mostly fixed costs, which would make a fast medium
# look slow)
_EXPLORE_EVERY = 8  # after this many warm hits recomputed in a row, one is loaded to measure again
_EXPLORE_FILE = 2  # after this many hits recomputed on a bandwidth from the file, one is loaded
_MIN_BPS, _MAX_BPS = 1e6, 1e13  # a store bandwidth outside these is not a measurement
_MAX_FILE_BYTES = 64 << 10  # the figures file is a few hundred bytes: a larger one is not ours
_AGREE = 4.0  # file figures more than this many times off a step measured here, per token, are dropped


def _finite(value: Any) -> bool:
    """A real number that is not infinite nor NaN (json reads `Infinity` and `NaN`; a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


class LoadAdvisor:
    """Running figures of one engine and store, and the choice they give for a hit."""

    def __init__(self, *, safety: float = 1.1, path: str | None = None, warm_up: bool = True,
                 floor: PrefillFloor | None = None) -> None:
        self.safety = safety
        self.floor = floor
        self._warming = warm_up  # the next measurable load is the process's first: not measured
        self.path = path
        self._prefill: dict[int, tuple[float, float]] = {}  # size class -> (tokens, seconds), measured here
        self._warm: float | None = None
        self._cold: float | None = None
        # the figures file's, standing in until this process measured its own
        self._file_prefill: dict[int, tuple[float, float]] = {}
        self._file_warm: float | None = None
        self._file_cold: float | None = None
        self._dirty = False
        self._news = False  # a figure of a size not measured before: kept at once, not 30 s later
        self._saved_at = 0.0
        self._write_cv = threading.Condition()  # `save` hands the figures to `_writer`, which writes them
        self._queued: dict[str, Any] | None = None
        self._writing = False
        self._writer: threading.Thread | None = None
        self._declined = 0  # warm hits recomputed in a row (see `choose`)
        self._declined_on_file = 0  # hits recomputed on a bandwidth from the file since one was loaded
        self._told_refused = False
        if path is not None:
            self._read(path)

    # -- figures kept across restarts -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        prefill = {**self._file_prefill, **self._prefill}
        return {"version": 1, "prefill": sorted(prefill.values()), "warm_bps": self._warm or self._file_warm,
                "cold_bps": self._cold or self._file_cold}

    def _read(self, path: str) -> None:
        try:
            raw = read_regular(path, _MAX_FILE_BYTES, follow_links=False)  # a link, a FIFO: refused
            if len(raw) > _MAX_FILE_BYTES:
                raise ValueError(f"over {_MAX_FILE_BYTES} bytes")
            doc = json.loads(raw.decode("utf-8"))
            if not isinstance(doc, dict) or doc.get("version") != 1:
                return
            points = doc.get("prefill", [])
            if not isinstance(points, list):
                raise ValueError("the prefill figures are not a list")
            for point in points:
                if not isinstance(point, list) or len(point) != 2:
                    raise ValueError(f"a prefill figure that is not a pair: {point!r}")
                tokens, seconds = point
                if not (_finite(tokens) and _finite(seconds)):
                    raise ValueError(f"a prefill figure that is not a finite number: {tokens!r}, {seconds!r}")
                if tokens >= MIN_STEP_TOKENS and self._plausible(int(tokens), float(seconds), path):
                    self._file_prefill[int(tokens).bit_length()] = (int(tokens), float(seconds))
            self._file_warm = self._bandwidth(doc.get("warm_bps"), path)
            self._file_cold = self._bandwidth(doc.get("cold_bps"), path)
            log.info("[galahad] load or recompute: figures of the last run: %s", self.describe())
        except FileNotFoundError:
            return
        # RecursionError: a deeply nested document (json's parser recurses); OverflowError: an
        # integer too large for a float. Every figure is checked above: no infinity or NaN from a
        # damaged file prices a load
        except (OSError, ValueError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
            log.warning("[galahad] load or recompute: ignoring the figures file %s (%s); starting "
                        "without figures", path, exc)
            self._file_prefill, self._file_warm, self._file_cold = {}, None, None

    def _bandwidth(self, value: Any, path: str) -> float | None:
        if value is None:
            return None
        if _finite(value) and _MIN_BPS <= value <= _MAX_BPS:
            return float(value)
        self._refused(f"a store bandwidth of {value!r} bytes/s in {path}")
        return None

    def save(self, *, force: bool = False) -> None:
        """Write the figures (atomically, on a thread of their own; `force` waits for it) if they
        changed: at once when a figure of a new size (or a first bandwidth) was measured, else at
        most every 30 s unless `force`. vLLM's CPU build may kill the engine before its shutdown
        hooks run: the figures the next start needs are kept when measured, not at the exit."""
        now = time.monotonic()
        if self.path is None or not self._dirty or (not (force or self._news) and now - self._saved_at < 30.0):
            return
        self._saved_at, self._dirty, self._news = now, False, False
        # Written on a thread of its own: this runs on vLLM's engine thread after a step, and a
        # write (a new file, then a rename) took about a millisecond there on a GPU host.
        with self._write_cv:
            self._queued = self.to_dict()
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="galahad-figures", daemon=True)
                self._writer.start()
            self._write_cv.notify_all()
        if force:
            self.written()

    def written(self, timeout: float = 5.0) -> bool:
        """Wait until the figures handed to `save` are in the file (False: not within `timeout`)."""
        with self._write_cv:
            return self._write_cv.wait_for(lambda: self._queued is None and not self._writing, timeout)

    def _write_loop(self) -> None:
        while True:
            with self._write_cv:
                self._write_cv.wait_for(lambda: self._queued is not None)
                doc, self._queued, self._writing = self._queued, None, True
            try:
                self._write(doc)
            finally:
                with self._write_cv:
                    self._writing = False
                    self._write_cv.notify_all()

    def _write(self, doc: dict[str, Any]) -> None:
        if self.path is None:
            return
        # a new name of its own, never an existing file nor a link followed (the store folder is
        # not trusted: a name planted there must not make the server write elsewhere)
        tmp = f"{self.path}.tmp-{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.debug("[galahad] could not keep the load figures in %s: %s", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    # -- observations ---------------------------------------------------------------------------

    def _plausible(self, tokens: int, seconds: float, source: str) -> bool:
        if seconds > 0 and (self.floor is None or self.floor.plausible(tokens, seconds)):
            return True
        least = f" (this model needs at least {self.floor.seconds(tokens) * 1e3:.3f} ms on any hardware)" \
            if self.floor is not None else ""
        self._refused(f"a prefill step of {tokens} tokens in {seconds * 1e3:.3f} ms{least}, from {source}")
        return False

    def _refused(self, what: str) -> None:
        if self._told_refused:
            log.debug("[galahad] load or recompute: refused %s", what)
            return
        self._told_refused = True
        log.warning("[galahad] load or recompute: refused %s: not a real measurement (a broken clock "
                    "or a damaged figures file); hits load, the default, until this server measured "
                    "its own figures (said once)", what)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A forward step that computed `tokens` tokens and loaded nothing took `seconds`."""
        if tokens < MIN_STEP_TOKENS or not self._plausible(tokens, seconds, "the engine"):
            return
        self._dirty = True
        cls = tokens.bit_length()
        old = self._prefill.get(cls)
        self._news |= old is None
        self._prefill[cls] = (tokens, seconds) if old is None else (
            _blend(old[0], tokens), _blend(old[1], seconds))
        rate = seconds / tokens
        self._file_prefill = {c: (n, s) for c, (n, s) in self._file_prefill.items()
                              if c != cls and 1 / _AGREE <= (s / n) / rate <= _AGREE}

    def observe_load(self, nbytes: int, seconds: float, share: float | None) -> None:
        """A load of `nbytes` took `seconds`; `share` of its bytes were resident when chosen."""
        if nbytes < _MIN_BYTES or seconds <= 0:
            return
        if self._warming:
            self._warming = False
            return
        self._dirty = True
        rate = nbytes / seconds
        warm = share is not None and share >= _WARM_SHARE
        self._news |= (self._warm if warm else self._cold) is None
        if warm:
            self._warm = _blend(self._warm, rate)
        else:
            self._cold = _blend(self._cold, rate)

    # -- the choice -----------------------------------------------------------------------------

    def model(self) -> CostModel | None:
        """The cost model of the figures so far; None before any prefill figure."""
        points = {**self._file_prefill, **self._prefill}
        if not points:
            return None
        prefill = PrefillProfile(tuple(points.values()))
        store = StoreSpeed(self._warm or self._file_warm or _WARM_PRIOR, self._cold or self._file_cold or _COLD_PRIOR)
        return CostModel(prefill, store, self.safety)

    def choose(self, tokens: int, nbytes: int, share: float | None) -> Choice | None:
        """The choice for a hit sparing `tokens` tokens by reading `nbytes`; None: load, unpriced
        (no figures yet, or a small load).

        A warm figure taken at a bad moment (the first loads of a process pin their buffers)
        would otherwise never be corrected once it says "recompute": no load is made, so none
        is measured. So after `_EXPLORE_EVERY` warm hits recomputed in a row, the next one is
        loaded, and its time updates the figures. Cold hits are not re-tried once this process
        measured the disk: a cold load that loses costs several prefills. A bandwidth read from
        the figures file is re-tried sooner (`_EXPLORE_FILE`): it may be another machine's."""
        model = self.model()
        if model is None or nbytes < _MIN_BYTES:
            return None
        share = 1.0 if share is None else share
        choice = model.choose(tokens, nbytes, share)
        if choice.load:
            return choice
        warm = share >= _WARM_SHARE
        if (self._warm if warm else self._cold) is None and (self._file_warm if warm else self._file_cold):
            self._declined_on_file += 1
            if self._declined_on_file > _EXPLORE_FILE:
                self._declined_on_file = 0
                return attrs.evolve(choice, load=True)
            return choice
        if not warm:  # a cold load's figure is the disk's: not re-tried
            return choice
        self._declined += 1
        if self._declined > _EXPLORE_EVERY:
            self._declined = 0
            # loaded like a priced load (inside the step), so it measures the store, not the
            # store competing with a running engine for the interpreter
            return attrs.evolve(choice, load=True)
        return choice

    def describe(self) -> str:
        points = {**self._file_prefill, **self._prefill}
        pts = ", ".join(f"{int(n)} tok {s * 1e3:.1f} ms" for n, s in sorted(points.values()))

        def speed(live: float | None, kept: float | None, prior: float) -> str:
            value = live or kept
            return f"{value / 1e9:.1f}" if value else f"prior {prior / 1e9:.1f}"

        return (f"prefill [{pts}]; load GB/s warm {speed(self._warm, self._file_warm, _WARM_PRIOR)}, "
                f"cold {speed(self._cold, self._file_cold, _COLD_PRIOR)}")


def prefill_floor_of(vllm_config: Any) -> PrefillFloor | None:
    """The least prefill time of this engine's model on any hardware, per rank: the query and
    output projections of every layer (at most as wide as the model, so a low-rank or latent
    attention is not overcounted); None where the model config does not say (then only a zero
    or negative figure is refused)."""
    try:
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        hidden = int(model.get_hidden_size())
        width = min(hidden, int(model.get_num_attention_heads(parallel)) * int(model.get_head_size()))
        layers = int(model.get_num_layers(parallel))
    except Exception:  # noqa: BLE001 - a model config of another shape: no floor
        log.debug("[galahad] no prefill floor for this model", exc_info=True)
        return None
    if hidden <= 0 or width <= 0 or layers <= 0:
        return None
    return PrefillFloor(flops_per_token=2.0 * 2 * layers * hidden * width, layers=layers)
