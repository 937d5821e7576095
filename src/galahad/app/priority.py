"""Loads before saves: a save waits, a bounded while, for the loads running now to end.

A load is on a request's path (vLLM's forward pass waits for a load inside the step, a user for
an asynchronous one); a save is not. Both want the same cores, memory bandwidth and interpreter
lock, and on a GPU host a save backlog (a burst of new prompts written behind the engine) cuts
a step's loads to between a third and two thirds of their rate. So each part's save first waits
until no load is running, at most a bounded while (`bootstrap.SAVE_YIELD_S`, 400 ms): saves
still go on under loads that never stop, only slower, and a save never waits for anything but
time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LoadsFirst"]


class LoadsFirst:
    """Counts the loads running; `wait` holds a save back while there are any (thread-safe)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = max(0.0, limit_s)
        self._cond = threading.Condition()
        self._running = 0

    @contextmanager
    def loading(self) -> Iterator[None]:
        """A load runs inside this block (several may, from several threads)."""
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if not self._running:
                    self._cond.notify_all()

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    def wait(self) -> float:
        """Wait until no load runs, at most `limit_s`; the seconds waited (0.0 when none ran)."""
        if not self.limit_s:
            return 0.0
        with self._cond:
            if not self._running:
                return 0.0
            t0 = time.monotonic()
            self._cond.wait_for(lambda: not self._running, timeout=self.limit_s)
            return time.monotonic() - t0
