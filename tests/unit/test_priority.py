"""Loads before saves (`galahad.app.priority.LoadsFirst`): a save waits while a load runs, never
longer than its limit, and not at all when none runs or the limit is 0."""

from __future__ import annotations

import threading
import time

from galahad.app.priority import LoadsFirst


def test_with_no_load_running_a_save_does_not_wait() -> None:
    gate = LoadsFirst(5.0)
    t0 = time.monotonic()
    assert gate.wait() == 0.0
    assert time.monotonic() - t0 < 0.5


def test_a_save_waits_until_the_last_running_load_ends() -> None:
    gate = LoadsFirst(5.0)
    first, second = threading.Event(), threading.Event()

    def load(done: threading.Event, hold_s: float) -> None:
        with gate.loading():
            done.set()
            time.sleep(hold_s)

    a = threading.Thread(target=load, args=(first, 0.2))
    b = threading.Thread(target=load, args=(second, 0.4))
    a.start()
    b.start()
    first.wait(5)
    second.wait(5)
    assert gate.running == 2
    waited = gate.wait()
    assert gate.running == 0  # both ended before the save went on
    assert 0.2 <= waited < 4.0
    a.join()
    b.join()


def test_a_save_waits_at_most_its_limit_for_a_load_that_does_not_end() -> None:
    gate = LoadsFirst(0.2)
    with gate.loading():
        t0 = time.monotonic()
        waited = gate.wait()
        assert 0.15 <= waited and time.monotonic() - t0 < 2.0
        assert gate.running == 1


def test_a_limit_of_zero_never_waits_even_while_loads_run() -> None:
    gate = LoadsFirst(0.0)
    with gate.loading():
        t0 = time.monotonic()
        assert gate.wait() == 0.0
        assert time.monotonic() - t0 < 0.1


def test_a_load_that_raises_still_counts_itself_out() -> None:
    gate = LoadsFirst(5.0)
    try:
        with gate.loading():
            raise RuntimeError("a failed read")
    except RuntimeError:
        pass
    assert gate.running == 0 and gate.wait() == 0.0
