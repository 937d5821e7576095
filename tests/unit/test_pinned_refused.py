"""When the host will not page-lock memory (a memory-lock limit, host memory exhausted), the pinned
pool says so once, with the fix, and hands out nothing: the worker then skips that save
(`saves_skipped`) or loads through ordinary memory, as when the pool is at its cap. No exception
reaches vLLM, and the pool's count of pinned bytes stays true.

The refusal here is real, not a stand-in: this machine's torch has no pinned-memory allocator, so
`torch.empty(..., pin_memory=True)` raises just as CUDA's allocator does when it cannot lock the
memory. (On a GPU host the allocator succeeds; the test is skipped there.)"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from galahad.adapters.cuda.pinned import _ARENA_LEAST, PinnedBuffer, PinnedPool  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the host pins memory here")

MIB = 1 << 20
CUDA_LOG = "galahad.adapters.cuda.pinned"


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot pin" in r.getMessage()]


def test_a_refused_pin_is_none_said_once_with_the_fix_and_counts_nothing(caplog: pytest.LogCaptureFixture) -> None:
    pool = PinnedPool()
    with caplog.at_level(logging.WARNING, logger=CUDA_LOG):
        pool.reserve(9 * MIB, 9 * MIB)
        assert pool.reserve_arena(64 * MIB) == 0
    assert pool.total_bytes == 0 and pool.pinned_allocations == 0 and not pool._free  # noqa: SLF001
    assert pool.pin_refused
    (said,) = _refusals(caplog)  # once, however many tries
    assert "16 MiB" in said and "saves_skipped" in said and "ulimit -l" in said


def test_acquire_never_asks_the_host_to_pin(caplog: pytest.LogCaptureFixture) -> None:
    """`acquire` runs on a request's path (a save's copy, a load's read): it hands out what was
    reserved at registration or nothing, and never pins (about 0.1 s per GB). Here the host
    refuses every pin, so asking it would be seen: a `cannot pin` line and `pin_refused`."""
    pool = PinnedPool()
    with caplog.at_level(logging.WARNING, logger=CUDA_LOG):
        for n in (MIB, 9 * MIB, 300 * MIB):
            assert pool.acquire(n) is None
            assert pool.acquire(n, shared=True) is None
    assert not pool.pin_refused and not _refusals(caplog)
    assert pool.total_bytes == 0 and pool.pinned_allocations == 0


def test_an_arena_the_host_refuses_is_tried_smaller_then_given_up(caplog: pytest.LogCaptureFixture) -> None:
    pool = PinnedPool()
    with caplog.at_level(logging.WARNING, logger=CUDA_LOG):
        assert pool.reserve_arena(1 << 30) == 0
    assert pool.total_bytes == 0 and not pool._free  # noqa: SLF001
    assert len(_refusals(caplog)) == 1
    assert _ARENA_LEAST < 1 << 30


def test_the_arena_still_serves_what_fits_when_the_host_refuses_more() -> None:
    """An arena reserved at start (an ordinary tensor here, put where `reserve_arena` puts its
    pinned one): requests it has room for come from it; one beyond it gets None, not an error."""
    arena = torch.zeros(32 * MIB, dtype=torch.uint8)
    pool = PinnedPool()
    pool._free.append(PinnedBuffer(arena, arena=arena, start=0))  # noqa: SLF001 - as reserve_arena does
    inside = pool.acquire(9 * MIB)
    assert inside is not None and inside.arena is arena
    assert pool.acquire(24 * MIB) is None  # 16 MiB left: none, and nothing pinned
    pool.release(inside)
    again = pool.acquire(24 * MIB)  # joined again: served from the arena
    assert again is not None and again.arena is arena and pool.pinned_allocations == 0
