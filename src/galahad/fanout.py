"""Fanning the frames of one part out over a thread pool, the calling thread taking its share.

`codec.open_part` and `codec.open_part_from` hand every frame of a part to `run_frames`. The
frames' work (reads and hashes outside the interpreter lock) runs on the caller and on up to one
pool task per core left over: a second thread helps a lone load, and threads that already fill
the cores are not joined by more that would only take turns with them, not even in the moment
between two of their parts. A core that is left over for good while a part is under way (the
last part of a batch) gets a helper for that part's remaining frames, which leaves again as soon
as the cores are oversubscribed.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["run_frames", "usable_cores"]

_F = TypeVar("_F")

LATE_HELPER_IDLE_S = 0.5e-3
"""How long fewer threads than cores must have been opening parts before a helper takes a core.
Longer than a thread opening parts one after another leaves its core between two of them
(closing a reader, opening the next, reading and checking its header: well under 0.2 ms here),
so that its next part does not find the core taken by another part's helper."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _Cores:
    """Threads running frames now, against the cores this process may use: the callers of
    `run_frames` (one part each) and the pool tasks helping them.

    A helper is only worth starting on a core that no caller will want back soon. Callers that
    fill the cores leave one free for a moment between two of their parts, so a core counts as
    left over only once fewer callers than cores have been running for `LATE_HELPER_IDLE_S`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cores = 0  # counted at first use, not at import
        self._callers = 0
        self._busy = 0  # callers and helpers
        self._short_since = 0.0  # time.monotonic() when _callers last fell below _cores (0: at start)

    def enter(self) -> int:
        """Count a caller in; returns how many helpers it may start now (0 or more)."""
        with self._lock:
            if not self._cores:
                self._cores = usable_cores()
            self._callers += 1
            self._busy += 1
            return self._cores - self._busy if self._left_over() else 0

    def leave(self) -> None:
        with self._lock:
            if self._callers == self._cores:
                self._short_since = time.monotonic()
            self._callers -= 1
            self._busy -= 1

    def take_helper(self) -> bool:
        """Count a helper in if a core has been left over for a while; whether it was."""
        with self._lock:
            if self._busy < self._cores and self._left_over():
                self._busy += 1
                return True
            return False

    def add_helper(self) -> None:
        with self._lock:
            self._busy += 1

    def drop_helper(self) -> None:
        with self._lock:
            self._busy -= 1

    def oversubscribed(self) -> bool:
        """More threads run frames than there are cores (no lock: a hint)."""
        return self._busy > self._cores

    def left_over_hint(self) -> bool:
        """`take_helper` would likely say yes (no lock: checked between frames, kept cheap)."""
        return self._busy < self._cores and self._left_over()

    def _left_over(self) -> bool:
        return self._callers < self._cores and time.monotonic() - self._short_since >= LATE_HELPER_IDLE_S


_CORES = _Cores()


def run_frames(work: Callable[[_F], None], frames: Sequence[_F], pool: cf.Executor | None) -> None:
    """Run `work` on every frame; with a pool, all have ended before the first failure is raised.

    With a pool, the calling thread takes frames too, from the same counter as the pool's tasks,
    and the pool gets at most one task per core left over (see `_Cores`): a busy pool (other
    parts' frames) never leaves the caller waiting with frames to do, and the tasks that had not
    started when the frames ran out are cancelled, not waited for. Between two of its frames the
    caller adds a task when a core has come to be left over (the last part of a batch); a task
    stops taking frames while more threads run frames than there are cores. A pool that is shut
    down is not used.
    """
    spare = _CORES.enter()
    try:
        if pool is None or len(frames) < 2:
            for frame in frames:
                work(frame)
            return
        _share(work, frames, pool, min(spare, len(frames) - 1))
    finally:
        _CORES.leave()


def _share(work: Callable[[_F], None], frames: Sequence[_F], pool: cf.Executor, helpers: int) -> None:
    take = itertools.count().__next__  # atomic: each frame goes to exactly one thread
    failures: list[BaseException] = []
    tasks: list[cf.Future[None]] = []

    def run(i: int) -> None:
        try:
            work(frames[i])
        except BaseException as exc:  # handed to the caller below, after all have ended
            failures.append(exc)

    def helper() -> None:
        try:
            while not failures and not _CORES.oversubscribed():
                i = take()
                if i >= len(frames):
                    return
                run(i)
        finally:
            _CORES.drop_helper()

    def submit() -> bool:
        try:
            tasks.append(pool.submit(helper))
        except RuntimeError:  # the pool is shut down: this thread does the rest
            _CORES.drop_helper()
            return False
        return True

    for _ in range(helpers):
        _CORES.add_helper()  # counted from now: the next caller sees this core taken
        if not submit():
            break
    late = True  # a helper may still be added (not once the pool refused one)
    while not failures:
        i = take()
        if i >= len(frames):
            break
        if late and i + 1 < len(frames) and _CORES.left_over_hint() and _CORES.take_helper():
            late = submit()
        run(i)
    for task in tasks:
        if task.cancel():  # never ran: its `finally` will not count it out
            _CORES.drop_helper()
    cf.wait([task for task in tasks if not task.cancelled()])
    if failures:
        raise failures[0]
