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
from typing import Any, TypeVar

__all__ = ["LastingPool", "pools_stopped", "run_frames", "submit_all", "usable_cores"]

_F = TypeVar("_F")
_T = TypeVar("_T")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _Cores:
    """How many threads are running frames now, against the cores this process may use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0
        self._cores = 0  # counted at first use, not at import

    def __enter__(self) -> int:
        """Count this thread in; returns the cores left over for helpers."""
        with self._lock:
            if not self._cores:
                self._cores = usable_cores()
            self._busy += 1
            return self._cores - self._busy

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._busy -= 1

    def spare(self) -> int:
        """The cores the threads running frames now leave over (the caller counted in)."""
        with self._lock:
            return (self._cores or usable_cores()) - self._busy


_CORES = _Cores()


_STOPPED = threading.Event()  # a LastingPool found its threads stopped by the interpreter's exit


def pools_stopped() -> bool:
    """True once the interpreter's exit has stopped a `LastingPool`'s threads: the process is
    ending (its main thread may still be waiting for the threads of the pools)."""
    return _STOPPED.is_set()


class LastingPool(cf.ThreadPoolExecutor):
    """A thread pool whose tasks still run while the interpreter exits: in the caller's thread.

    When the interpreter exits, `concurrent.futures` stops every pool's idle threads, and a pool
    then refuses new tasks with "cannot schedule new futures after shutdown", while threads of
    other pools are still finishing work queued before (a save sealing its frames, writing its
    ranges, committing). A task such a pool is given then runs in the caller's thread, so that
    work ends as it would have, not with an exception (and `pools_stopped()` is true from then
    on). A pool closed with `shutdown` still refuses new tasks, as any pool does.
    """

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "") -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._closed = False

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> cf.Future[_T]:
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError:
            if self._closed:
                raise
        _STOPPED.set()
        done: cf.Future[_T] = cf.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed over in the future, as a pool does
            done.set_exception(exc)
        return done

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        super().shutdown(wait=wait, cancel_futures=cancel_futures)


def submit_all(pool: cf.Executor, fns: Sequence[Callable[[], _T]]) -> list[cf.Future[_T]]:
    """Run every one of `fns` on `pool`, each result in its own future, with one hand-over from
    the caller: the pool thread that takes it queues the others and runs the first. Handing a
    task to a pool costs its caller tens of microseconds (a future, a queue, a thread woken),
    and vLLM's engine thread hands over a step's parts, dozens at a time. A pool that refuses the
    first hand-over (shut down) raises here, as `submit` does; a task it refuses later runs on
    the thread queuing it, so every future gets its result."""
    futures: list[cf.Future[_T]] = [cf.Future() for _ in fns]

    def run(i: int) -> None:
        done = futures[i]
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fns[i]())
        except BaseException as exc:  # noqa: BLE001 - handed over in the future, as a pool does
            done.set_exception(exc)

    def fan_out() -> None:
        for i in range(1, len(fns)):
            try:
                pool.submit(run, i)
            except RuntimeError:  # the pool was shut down meanwhile
                run(i)
        run(0)

    if fns:
        pool.submit(fan_out)
    return futures


def run_frames(work: Callable[[_F], None], frames: Sequence[_F], pool: cf.Executor | None) -> None:
    """Run `work` on every frame; with a pool, all have ended before the first failure is raised.

    With a pool, the calling thread takes frames too, from the same counter as the pool's tasks,
    and the pool gets at most one task per core left over: a busy pool (other parts' frames)
    never leaves the caller waiting with frames to do, and the tasks that had not started when
    the frames ran out are cancelled, not waited for. Cores that free up while the caller works
    (another thread's part ended) get a task each after the caller's next frame: the last part
    of a batch is not left to one core. A pool that is shut down is not used.
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
    tasks: list[cf.Future[None]] = []

    def run(i: int) -> bool:
        if i >= len(frames):
            return False
        try:
            work(frames[i])
        except BaseException as exc:  # handed to the caller below, after all have ended
            failures.append(exc)
        return True

    def drain() -> None:
        while not failures and run(take()):
            pass

    def recruit(wanted: int) -> None:
        while len(tasks) < wanted:
            try:
                tasks.append(pool.submit(drain))
            except RuntimeError:  # the pool is shut down: this thread does the rest
                return

    recruit(max(0, helpers))
    while not failures:  # the caller's own share; one more helper per core freed meanwhile
        if not run(take()):
            break
        if len(tasks) < len(frames) - 1:
            recruit(min(_CORES.spare(), len(frames) - 1))
    started = [task for task in tasks if not task.cancel()]  # a cancelled task never runs
    cf.wait(started)
    if failures:
        raise failures[0]
