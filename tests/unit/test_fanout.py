"""Frames fanned out over a pool: every frame once, the caller never waits on a busy pool, a
failure is raised only once every frame that started has ended, threads that fill the cores get
no helpers (not even in the moment between two of their parts), and a core left over for good
joins the part still under way."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable

import pytest

from galahad import fanout
from galahad.fanout import run_frames


@pytest.fixture(autouse=True)
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout._CORES, "_cores", 4)  # the same on any machine running the tests
    monkeypatch.setattr(fanout._CORES, "_short_since", 0.0)  # no other test's recent past


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


def _frames(names: list[str], seconds: float, *, started: threading.Event | None = None,
            before_last: threading.Event | None = None, count: int) -> Callable[[int], None]:
    """A frame's work: record the thread that runs it, sleep; optionally say it started, or wait
    for `before_last` before ending the last frame."""

    def frame(i: int) -> None:
        names.append(threading.current_thread().name)
        if started is not None:
            started.set()
        if before_last is not None and i == count - 1:
            assert before_last.wait(10)
        time.sleep(seconds)

    return frame


def test_a_part_opened_while_the_other_thread_is_between_two_parts_gets_no_helper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads on two cores opening parts: the one that opens its next part while the other is
    between two of its own (its core free for a moment) gets no helper, which would only take
    turns with the other's next part."""
    monkeypatch.setattr(fanout._CORES, "_cores", 2)
    monkeypatch.setattr(fanout, "LATE_HELPER_IDLE_S", 0.05)  # longer than any wake-up here
    a_left, b_between, a_started = threading.Event(), threading.Event(), threading.Event()
    ours: list[str] = []
    theirs: list[str] = []
    with cf.ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:

        def other() -> None:
            run_frames(_frames(theirs, 0.002, before_last=a_left, count=3), list(range(3)), pool)
            b_between.set()  # between two parts
            assert a_started.wait(10)
            run_frames(_frames(theirs, 0.002, count=6), list(range(6)), pool)

        b_in = threading.Event()
        b = threading.Thread(target=lambda: (b_in.set(), other()))
        b.start()
        assert b_in.wait(10)
        time.sleep(0.01)  # the other thread's first part is under way (its first frame sleeps)
        run_frames(_frames(ours, 0.001, count=1), [0], pool)  # the cores are full meanwhile
        a_left.set()
        assert b_between.wait(10)
        run_frames(_frames(ours, 0.003, started=a_started, count=6), list(range(6)), pool)
        b.join()
    assert len(ours) == 7 and not any(name.startswith("pool") for name in ours), ours


def test_a_core_left_over_for_good_joins_the_part_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long part that started while the cores were full gets a helper once the other thread
    has finished (the last part of a batch is not left to one core)."""
    monkeypatch.setattr(fanout._CORES, "_cores", 2)
    short: list[str] = []
    long: list[str] = []
    inside = threading.Event()
    with cf.ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:
        first = threading.Thread(target=run_frames, args=(_frames(short, 0.005, started=inside, count=2), [0, 1], pool))
        first.start()
        assert inside.wait(10)  # the short part is under way: the long one starts with no core over
        run_frames(_frames(long, 0.002, count=40), list(range(40)), pool)
        first.join()
    assert len(long) == 40 and not long[0].startswith("pool")  # the caller took the first frame itself
    assert any(name.startswith("pool") for name in long), "no helper joined once the short part ended"
