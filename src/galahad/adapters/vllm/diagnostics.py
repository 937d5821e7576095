"""Running totals of the counters, and two test-only hooks.

vLLM's `KV Transfer metrics:` line shows per-interval figures, and only while the engine is busy.
The scheduler side therefore also keeps totals since start (its own counters and every worker's)
and logs them at shutdown as `[galahad] totals since start: ...`.

Test-only settings, read here once (never set them in production; all are logged loudly):
- `GALAHAD_TEST_PERTURB_LOAD=1`: workers negate every loaded KV element before copying it in,
  so a test can show that wrong KV gives different tokens (a mamba state page, not one dtype,
  is zeroed instead). `=full`, `=sliding` or `=state`: only
  the layers of KV cache groups of that kind (hybrid models: each group's part matters).
- `GALAHAD_TEST_COUNTERS_FILE=PATH`: the scheduler side rewrites PATH with the totals as JSON
  whenever they change, with `pending_commits` and `test_requests_finished` (requests vLLM has
  finished since start: a snapshot that counts a test's requests finished and no commit pending
  holds all their work, whenever the file's writer gets to it); each worker rewrites
  `PATH.rank<N>` with its own totals (what that rank read, refused, saved), so a test can tell
  the ranks of a split model apart. The files are
  written on a thread of their own, the newest totals first: a rename costs milliseconds on some
  disks, and the engine's thread asks for the totals every step.
- `GALAHAD_TEST_SAVE_DELAY=RANK:SECONDS[:GATE]`: that worker waits SECONDS (on its I/O pool, vLLM
  is not held up) before writing each part, once the file GATE exists (always, without GATE), so
  a test can kill the server while one rank's parts are durable and another's are not.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import attrs

from galahad.adapters.vllm.stats import GalahadStats, counters_of

__all__ = ["Diagnostics"]

log = logging.getLogger(__name__)

_KINDS = {"full", "sliding", "state"}


@attrs.define
class Diagnostics:
    perturb_load: str = ""  # "", "all", or a group kind ("full", "sliding", "state")
    counters_file: str | None = None
    rank: int | None = None  # a worker's rank: its totals go to `counters_file.rank<N>`
    save_delay: tuple[int, float, str | None] | None = None  # GALAHAD_TEST_SAVE_DELAY
    _totals: dict[str, Any] = attrs.field(factory=dict)
    _pending: int = 0
    _finished: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Diagnostics:
        env = os.environ if environ is None else environ
        raw = env.get("GALAHAD_TEST_PERTURB_LOAD", "").strip().lower()
        perturb = "all" if raw in {"1", "true", "yes", "on"} else raw if raw in _KINDS else ""
        if raw and not perturb and raw not in {"0", "false", "no", "off"}:
            log.warning("[galahad] GALAHAD_TEST_PERTURB_LOAD=%r is not accepted (use 1, full, sliding or state); "
                        "the test hook stays off", raw)
        path = env.get("GALAHAD_TEST_COUNTERS_FILE", "").strip() or None
        if path:
            log.warning("[galahad] TEST HOOK ON: GALAHAD_TEST_COUNTERS_FILE=%s", path)
        return cls(perturb, path, save_delay=_save_delay(env.get("GALAHAD_TEST_SAVE_DELAY", "")))

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
            self._add(dict(stats.data))

    def observe_own(self, stats: GalahadStats) -> None:
        if stats.data:
            self._add(dict(stats.data))

    def _add(self, data: dict[str, Any]) -> None:
        with self._lock:
            total = GalahadStats(data=dict(self._totals))
            total.aggregate(GalahadStats(data=data))
            self._totals = total.data
        self._write()

    def set_pending(self, pending: int) -> None:
        if pending != self._pending:
            self._pending = pending
            self._write()

    def note_finished(self) -> None:
        """A request finished (scheduler side; written only with the counters file)."""
        if self.counters_file:
            self._finished += 1
            self._write()

    def _write(self) -> None:
        if self.counters_file:
            snapshot = dict(self.totals())
            if self.rank is None:
                snapshot["pending_commits"] = self._pending
                snapshot["test_requests_finished"] = self._finished
                _WRITER.put(self.counters_file, snapshot)
            else:
                _WRITER.put(f"{self.counters_file}.rank{self.rank}", snapshot)

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


def _save_delay(value: str) -> tuple[int, float, str | None] | None:
    if not value.strip():
        return None
    try:
        rank, seconds, *gate = value.split(":", 2)
        return int(rank), max(0.0, float(seconds)), (gate[0] if gate else None)
    except ValueError:
        log.warning("[galahad] GALAHAD_TEST_SAVE_DELAY=%r ignored: use RANK:SECONDS[:GATE]", value)
        return None


class _LatestWriter:
    """Writes the newest snapshot handed over for each path, on a daemon thread of its own
    (started at the first one, again in a forked child); older snapshots not yet written are
    replaced, never queued."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._writing = threading.Lock()  # a snapshot taken later is written later
        self._latest: dict[str, dict[str, Any]] = {}
        self._pid = 0  # the process whose thread writes

    def put(self, path: str, data: dict[str, Any]) -> None:
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

    def flush(self) -> None:
        with self._writing:
            with self._cv:
                batch, self._latest = self._latest, {}
            for path, data in batch.items():
                _write_json(path, data)


_WRITER = _LatestWriter()


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        log.debug("[galahad] cannot write %s", path, exc_info=True)
