"""Running totals of the counters, and the vLLM side of the test hooks.

vLLM's `KV Transfer metrics:` line shows per-interval figures, and only while the engine is busy.
The scheduler side therefore also keeps totals since start (its own counters and every worker's)
and logs them at shutdown as `[galahad] totals since start: ...`.

The test hooks (`config.TestHooks`, read with the settings; docs/configuration.md, "Testing"):
- `perturb_load` (GALAHAD_TEST_PERTURB_LOAD): workers negate every loaded KV element before
  copying it in (a mamba state page is zeroed instead), so a test can show that wrong KV gives
  different tokens; or only the layers of KV cache groups of one kind.
- `counters_file` (GALAHAD_TEST_COUNTERS_FILE=PATH): the scheduler side rewrites PATH with the
  totals as JSON whenever they change, with `pending_commits` and `test_requests_finished`
  (requests vLLM has finished since start: a snapshot that counts a test's requests finished and
  no commit pending holds all their work, whenever the file's writer gets to it); each worker
  rewrites `PATH.rank<N>` with its own totals, so a test can tell the ranks of a split model
  apart. The files are written on a thread of their own, the newest totals first, at most every
  20 ms a file: a rename costs milliseconds on some disks, and the engine's thread reports every
  step. That thread only hands over what changed; the totals are summed up when written.
- `save_delay` (GALAHAD_TEST_SAVE_DELAY=RANK:SECONDS[:GATE]): that worker waits SECONDS (on its
  save threads, vLLM is not held up) before writing each part, once the file GATE exists
  (always, without GATE), so a test can kill the server while one rank's parts are durable and
  another's are not.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from galahad.adapters.vllm.stats import GalahadStats, counters_of
from galahad.config import TestHooks

__all__ = ["Diagnostics"]

log = logging.getLogger(__name__)

_GAP_S = 0.02  # the counters files are rewritten at most this often


@attrs.define
class Diagnostics:
    perturb_load: str = ""  # "", "all", or a group kind ("full", "sliding", "state")
    counters_file: str | None = None
    rank: int | None = None  # a worker's rank: its totals go to `counters_file.rank<N>`
    save_delay: tuple[int, float, str | None] | None = None  # GALAHAD_TEST_SAVE_DELAY
    _totals: dict[str, Any] = attrs.field(factory=dict)
    _marks: tuple[int, int] = (0, 0)  # (pending commits, finished requests): one value, never read half-updated
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @classmethod
    def of(cls, hooks: TestHooks) -> Diagnostics:
        if hooks.counters_file:
            log.warning("[galahad] TEST HOOK ON: GALAHAD_TEST_COUNTERS_FILE=%s", hooks.counters_file)
        return cls(hooks.perturb_load, hooks.counters_file, save_delay=hooks.save_delay)

    def save_delay_of(self, rank: int) -> tuple[float, str | None]:
        """Seconds the worker of `rank` waits before writing each part once its gate file exists
        (test hook; (0, None) normally)."""
        if self.save_delay is None or self.save_delay[0] != rank:
            return 0.0, None
        _rank, seconds, gate = self.save_delay
        log.warning("[galahad] (worker rank %d) TEST HOOK ON: GALAHAD_TEST_SAVE_DELAY: parts are "
                    "written %.2f s late%s. Never set this in production.", rank, seconds,
                    f" once {gate} exists" if gate else "")
        return seconds, gate

    def announce(self, who: str) -> None:
        if self.perturb_load:
            what = "" if self.perturb_load == "all" else f" of the {self.perturb_load} groups"
            log.warning("[galahad] (%s) TEST HOOK ON: GALAHAD_TEST_PERTURB_LOAD=%s: every loaded KV "
                        "block%s is deliberately CORRUPTED (negated, a state zeroed). Answers WILL be wrong. Never "
                        "set this in production.", who,
                        "1" if self.perturb_load == "all" else self.perturb_load, what)

    def observe_workers(self, stats: Any) -> None:
        if stats is not None and getattr(stats, "data", None):
            self._add(stats.data)

    def observe_own(self, stats: GalahadStats) -> None:
        if stats.data:
            self._add(stats.data)

    def _add(self, data: dict[str, Any]) -> None:
        """Add a report's counts to the totals, in place (twice a step on the engine's thread:
        the totals are not copied; `totals()` copies them)."""
        with self._lock:
            GalahadStats(data=self._totals).aggregate(GalahadStats(data=data))
        self._write()

    def set_pending(self, pending: int) -> None:
        if pending != self._marks[0]:
            self._marks = (pending, self._marks[1])
            self._write()

    def note_finished(self) -> None:
        """A request finished (scheduler side; written only with the counters file)."""
        if self.counters_file:
            self._marks = (self._marks[0], self._marks[1] + 1)
            self._write()

    def _write(self) -> None:
        if self.counters_file:
            path = self.counters_file if self.rank is None else f"{self.counters_file}.rank{self.rank}"
            _WRITER.put(path, self._snapshot)

    def _snapshot(self) -> dict[str, Any]:
        """What the file holds, taken when it is written (on the writer's thread): the totals
        then, and on the scheduler side the pending commits and finished requests last handed
        over (read first: the totals taken after them hold at least their work)."""
        pending, finished = self._marks
        snapshot = dict(self.totals())
        if self.rank is None:
            snapshot["pending_commits"] = pending
            snapshot["test_requests_finished"] = finished
        return snapshot

    def flush(self) -> None:
        """Write what is waiting now (at shutdown)."""
        _WRITER.flush()

    def totals(self) -> dict[str, int | float]:
        with self._lock:
            return GalahadStats(data=dict(self._totals)).reduce()

    def log_totals(self) -> None:
        counters, _ = counters_of(self._totals)
        if counters.is_empty():
            return
        line = ", ".join(f"{k}={v}" for k, v in self.totals().items() if v)
        log.info("[galahad] totals since start: %s", line)


class _LatestWriter:
    """Writes each path with the snapshot (taken when written) of the last source handed over for
    it, on a daemon thread of its own (started at the first one, again in a forked child), at most
    every `_GAP_S`; sources handed over before it gets to them are replaced, never queued."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._writing = threading.Lock()  # a snapshot taken later is written later
        self._latest: dict[str, Callable[[], dict[str, Any]]] = {}
        self._pid = 0  # the process whose thread writes

    def put(self, path: str, data: Callable[[], dict[str, Any]]) -> None:
        with self._cv:
            self._latest[path] = data
            if self._pid != os.getpid():
                if not self._pid:
                    atexit.register(self.flush)  # the last totals outlive the process
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="galahad-diag", daemon=True).start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._latest:
                    self._cv.wait()
            self.flush()
            time.sleep(_GAP_S)

    def flush(self) -> None:
        with self._writing:
            with self._cv:
                batch, self._latest = self._latest, {}
            for path, data in batch.items():
                _write_json(path, data())


_WRITER = _LatestWriter()


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        log.debug("[galahad] cannot write %s", path, exc_info=True)
