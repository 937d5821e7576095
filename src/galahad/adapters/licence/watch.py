"""The licence checked again while a server runs: at its expiry instant and every few minutes.

The startup check (`bootstrap.open_cache`) decides whether a process caches at all; this one
decides whether it goes on. Each check reads the licence file and the issuer keys afresh and
verifies the signature, the expiry and the points (`Licence.check`), on a thread of its own:
the engine's threads never read a file for it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable

from galahad.domain.licence import LicenceStatus
from galahad.ports.licence import Licence

__all__ = ["CHECK_EVERY_S", "CONFIRM_S", "LicenceWatch", "utc_now"]

_log = logging.getLogger(__name__)

CHECK_EVERY_S = 300.0  # the licence is checked again this often, and at its expiry instant
CONFIRM_S = 1.0  # a refusal is checked once more after this pause (a file caught while `cp` rewrites it)
_PAST_S = 0.01  # woken this long after the expiry instant, so that the check finds it passed


def utc_now() -> dt.datetime:
    """The time a licence is judged at (the watch's default clock)."""
    return dt.datetime.now(dt.timezone.utc)


class LicenceWatch:
    """Checks `licence` for `ranks` GPU ranks again while the server runs, once `start`ed;
    `valid` is the status the startup check found.

    A check runs at the expiry instant of the licence last found valid (`expires`) and every
    `every_s` seconds. A file replaced by another valid licence is taken: its expiry counts from
    then on, and one INFO line says so. A refusal is checked once more `confirm_s` later; then it
    is final: one `[galahad] NOT CACHING from now on` WARNING says what, why and the fix,
    `refused` holds the reason, `on_refused(reason)` is called once (on the watch's thread, to
    stop the engine adapter's caching), and the watch ends. Caching resumes only at the next
    start. `close` ends the watch. `clock` gives the time checks judge at (tests move it).
    """

    def __init__(self, licence: Licence, ranks: int, valid: LicenceStatus, *, who: str = "",
                 every_s: float | None = None, confirm_s: float = CONFIRM_S,
                 clock: Callable[[], dt.datetime] | None = None) -> None:
        self.licence = licence
        self.ranks = ranks
        self.expires = valid.expires
        self.who = who  # " (scheduler)": the startup lines' role
        self.every_s = CHECK_EVERY_S if every_s is None else every_s
        self.confirm_s = confirm_s
        self._clock = clock or utc_now
        self._said = valid.describe()  # the last valid status, as its line says it
        self._refused = ""
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"LicenceWatch({self.licence!r}, ranks={self.ranks}, every {self.every_s:g} s)"

    @property
    def refused(self) -> str:
        """Why caching stopped ("" while the licence holds)."""
        return self._refused

    def start(self, on_refused: Callable[[str], None]) -> None:
        """Begin watching; `on_refused(reason)` stops caching when a re-check refuses."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(on_refused,), name="galahad-licence",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """End the watch (at shutdown); waits `timeout` seconds at most for its thread."""
        self._closed.set()
        thread = self._thread
        if thread is not None and timeout and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self, on_refused: Callable[[str], None]) -> None:
        try:
            status = self._until_refused()
        except Exception:  # noqa: BLE001 - thread boundary: the engine goes on as it started
            _log.warning("[galahad]%s the licence re-check failed; caching goes on as licensed at "
                         "startup", self.who, exc_info=True)
            return
        if status is None:
            return
        self._refused = status.describe()
        _log.warning("[galahad]%s NOT CACHING from now on: %s; nothing more is saved or loaded (the "
                     "stored entries are kept) and the engine keeps serving; caching resumes when the "
                     "server restarts with a valid licence", self.who, self._refused)
        try:
            on_refused(self._refused)
        except Exception:  # noqa: BLE001 - thread boundary
            _log.warning("[galahad]%s stopping the cache after the licence refusal failed", self.who,
                         exc_info=True)

    def _until_refused(self) -> LicenceStatus | None:
        """The confirmed refusal; None once closed."""
        while not self._closed.wait(self._pause()):
            status = self._check()
            if not status.valid and not self._closed.wait(self.confirm_s):
                status = self._check()  # a file caught half-written is valid again by now
            if self._closed.is_set():
                return None
            if not status.valid:
                return status
        return None

    def _check(self) -> LicenceStatus:
        status = self.licence.check(self.ranks, now=self._clock())
        if status.valid:
            said = status.describe()
            if said != self._said:
                _log.info("[galahad]%s the licence file changed and is valid: %s", self.who, said)
            self._said, self.expires = said, status.expires
        return status

    def _pause(self) -> float:
        """Seconds to the next check: `every_s`, or less to wake just past the expiry instant."""
        if self.expires is None:
            return self.every_s
        until = (self.expires - self._clock()).total_seconds() + _PAST_S
        return max(0.0, min(self.every_s, until))
