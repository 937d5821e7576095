"""Frames fanned out over a pool: every frame once, the caller never waits on a busy pool, and a
failure is raised only once every frame that started has ended. Tasks handed over at once
(`submit_all`): one hand-over from the caller, every task run once on the pool, each result or
failure in its own future."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest

from galahad.format import fanout
from galahad.format.fanout import run_frames, submit_all


@pytest.fixture(autouse=True)
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout._CORES, "_cores", 4)  # the same on any machine running the tests


def test_every_frame_runs_exactly_once_on_the_caller_and_the_pool() -> None:
    seen: list[tuple[int, str]] = []
    with cf.ThreadPoolExecutor(3) as pool:
        run_frames(lambda i: seen.append((i, threading.current_thread().name)) or time.sleep(0.01),
                   list(range(20)), pool)
    assert sorted(i for i, _ in seen) == list(range(20))
    assert len({name for _, name in seen}) > 1  # the work was shared


def test_a_busy_pool_never_makes_the_caller_wait() -> None:
    gate = threading.Event()
    with cf.ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(gate.wait, 10)  # the pool's only thread is taken
        done: list[int] = []
        t0 = time.perf_counter()
        run_frames(done.append, list(range(5)), pool)
        assert time.perf_counter() - t0 < 5 and done == [0, 1, 2, 3, 4]  # all in the caller, in order
        gate.set()
        blocker.result()


def test_threads_that_fill_the_cores_get_no_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout._CORES, "_cores", 1)
    names: set[str] = set()
    with cf.ThreadPoolExecutor(2) as pool:
        run_frames(lambda i: names.add(threading.current_thread().name), list(range(8)), pool)
    assert names == {threading.current_thread().name}


def test_a_failure_is_raised_after_every_started_frame_ended() -> None:
    ended: list[int] = []

    def work(i: int) -> None:
        if i == 0:
            raise ValueError("frame 0 is bad")
        time.sleep(0.05)
        ended.append(i)

    with cf.ThreadPoolExecutor(3) as pool:
        with pytest.raises(ValueError, match="frame 0"):
            run_frames(work, list(range(4)), pool)
        started_then = len(ended)
        time.sleep(0.2)
        assert len(ended) == started_then  # nothing still running after the raise


def test_a_pool_that_was_shut_down_leaves_the_work_to_the_caller() -> None:
    pool = cf.ThreadPoolExecutor(2)
    pool.shutdown()
    done: list[int] = []
    run_frames(done.append, list(range(3)), pool)
    assert done == [0, 1, 2]


def test_a_core_freed_while_a_part_runs_joins_its_remaining_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads fill two cores, so the second part starts without helpers; once the first
    part ends, its core takes frames of the second (the last part of a batch is not left to one
    core)."""
    monkeypatch.setattr(fanout._CORES, "_cores", 2)
    inside = threading.Event()

    def other_part() -> None:  # holds the other core for 0.2 s, then ends
        run_frames(lambda i: inside.set() or time.sleep(0.1), [0, 1], None)

    names: list[tuple[int, str]] = []
    with cf.ThreadPoolExecutor(2) as pool:
        other = threading.Thread(target=other_part)
        other.start()
        assert inside.wait(5)
        run_frames(lambda i: names.append((i, threading.current_thread().name)) or time.sleep(0.05),
                   list(range(16)), pool)
        other.join()
    assert sorted(i for i, _ in names) == list(range(16))
    caller = threading.current_thread().name
    assert names[0][1] == caller  # no helper while both cores were taken
    assert any(name != caller for _, name in names), names  # a helper once one was freed


_EXIT_SCRIPT = """
import concurrent.futures as cf, sys, threading, time
from galahad.format.fanout import LastingPool

lasting, plain = LastingPool(2), cf.ThreadPoolExecutor(2)
lasting.submit(int).result(), plain.submit(int).result()  # their threads started

def after_main() -> None:  # a thread still running when the main thread has ended
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    time.sleep(0.2)  # the interpreter's exit has stopped the pools' idle threads by now
    for name, pool in (("lasting", lasting), ("plain", plain)):
        try:
            print(name, pool.submit(lambda: threading.current_thread().name).result(), flush=True)
        except RuntimeError as exc:
            print(name, "refused:", exc, flush=True)

threading.Thread(target=after_main).start()
"""


def test_a_lasting_pool_runs_work_given_while_the_interpreter_exits_in_the_callers_thread() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["lasting"].startswith("Thread-")  # ran, in the caller's thread, not the pool's
    assert lines["plain"].startswith("refused:")  # what any other pool does: the failure it fixes


def test_a_lasting_pool_shut_down_on_purpose_still_refuses_work() -> None:
    pool = fanout.LastingPool(1)
    assert pool.submit(lambda: 7).result() == 7
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(lambda: 7)


class _Counting(cf.ThreadPoolExecutor):
    """A pool that counts the tasks handed to it, and by which thread."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.by: list[str] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        self.by.append(threading.current_thread().name)
        return super().submit(fn, *args, **kwargs)


def test_tasks_handed_over_at_once_run_each_once_on_the_pool_with_their_own_results() -> None:
    ran: list[tuple[int, str]] = []

    def task(i: int) -> int:
        ran.append((i, threading.current_thread().name))
        if i == 3:
            raise ValueError("three")
        return i * 10

    caller = threading.current_thread().name
    with _Counting(4) as pool:
        futures = submit_all(pool, [lambda i=i: task(i) for i in range(8)])
        results = [f.exception(timeout=10) or f.result() for f in futures]
    assert pool.by.count(caller) == 1  # one hand-over from the caller, the rest from the pool
    assert len(pool.by) == 8
    assert sorted(i for i, _ in ran) == list(range(8))
    assert all(name != caller for _, name in ran)
    assert [r if not isinstance(r, BaseException) else str(r) for r in results] == [0, 10, 20, "three", 40, 50, 60, 70]
    assert submit_all(pool, []) == []


def test_tasks_a_pool_refuses_after_the_hand_over_run_on_the_thread_queuing_them() -> None:
    pool = cf.ThreadPoolExecutor(1)
    started = threading.Event()

    def first() -> str:
        started.set()
        return "first"

    real = pool.submit
    calls = []

    def refusing(fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(fn)
        if len(calls) > 1:  # the pool shuts down between the hand-over and the rest
            raise RuntimeError("cannot schedule new futures after shutdown")
        return real(fn, *args, **kwargs)

    pool.submit = refusing  # type: ignore[method-assign]
    futures = submit_all(pool, [first, lambda: "second", lambda: "third"])
    assert [f.result(timeout=10) for f in futures] == ["first", "second", "third"]
    assert started.is_set()
    pool.shutdown()
    closed = cf.ThreadPoolExecutor(1)
    closed.shutdown()
    with pytest.raises(RuntimeError):  # refused at the hand-over: the caller hears it, as from submit
        submit_all(closed, [first])
