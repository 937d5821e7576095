"""Fanning the frames of one part out over a thread pool, the calling thread taking its share.

`codec.open_part` and `codec.open_part_from` hand every frame of a part to `run_frames`. The
frames' work (reads and hashes outside the interpreter lock) runs on the caller and on up to one
pool task per core that the threads opening parts now leave over: a second thread helps a lone
load, and threads that already fill the cores are not joined by more that would only take turns.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["run_frames"]

_F = TypeVar("_F")


class _Cores:
    """How many threads are running frames now, against the cores this process may use."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._cores = 0  # counted at first use, not at import

    def _total(self) -> int:
        if not self._cores:
            self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return self._cores

    def __enter__(self) -> int:
        """Count this thread in; returns the cores left over for helpers."""
        with self._cond:
            self._busy += 1
            return self._total() - self._busy

    def __exit__(self, *exc_info: object) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def join_when_free(self, done: threading.Event) -> bool:
        """Wait until a core is free, then count this thread in (True), or until `done` (False)."""
        with self._cond:
            while not done.is_set():
                if self._busy < self._total():
                    self._busy += 1
                    return True
                self._cond.wait()
            return False

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


_CORES = _Cores()


def run_frames(work: Callable[[_F], None], frames: Sequence[_F], pool: cf.Executor | None) -> None:
    """Run `work` on every frame; with a pool, all have ended before the first failure is raised.

    With a pool, the calling thread takes frames too, from the same counter as the pool's tasks,
    and the pool gets at most one task per core left over: a busy pool (other parts' frames)
    never leaves the caller waiting with frames to do, and the tasks that had not started when
    the frames ran out are cancelled, not waited for. When no core is left over, one task stands
    by instead and joins in as soon as a core frees up (another part finished: the last part of
    a batch is not left to one core). A pool that is shut down is not used.
    """
    with _CORES as spare:
        if pool is None or len(frames) < 2:
            for frame in frames:
                work(frame)
            return
        _share(work, frames, pool, min(spare, len(frames) - 1))


def _share(work: Callable[[_F], None], frames: Sequence[_F], pool: cf.Executor, helpers: int) -> None:
    take = itertools.count().__next__  # atomic: each frame goes to exactly one thread
    failures: list[BaseException] = []
    done = threading.Event()  # every frame taken: a standing-by task has nothing left to join

    def drain() -> None:
        while not failures:
            i = take()
            if i >= len(frames):
                return
            try:
                work(frames[i])
            except BaseException as exc:  # handed to the caller below, after all have ended
                failures.append(exc)

    def standby() -> None:
        if _CORES.join_when_free(done):
            try:
                drain()
            finally:
                _CORES.__exit__()

    tasks: list[cf.Future[None]] = []
    for task in [drain] * helpers if helpers > 0 else [standby]:
        try:
            tasks.append(pool.submit(task))
        except RuntimeError:  # the pool is shut down: this thread does the rest
            break
    drain()
    done.set()
    _CORES.wake()
    started = [task for task in tasks if not task.cancel()]  # a cancelled task never runs
    cf.wait(started)
    if failures:
        raise failures[0]
