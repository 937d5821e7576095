"""The pinned arena (`PinnedPool.reserve_arena`): one reserved buffer cut into pieces for the
copies that run beside each other, and joined again for a larger one.

The pool's own logic, on this CPU machine: the arena here is an ordinary tensor put in the free
list as `reserve_arena` puts its pinned one (pinning needs CUDA; tests/gpu/test_cuda_transfer.py
runs the CUDA path over a real one). What must hold whatever the order of requests: no two
buffers handed out share a byte, every byte of the arena is in exactly one piece (handed out or
free), a piece whose last copy is still running is never joined, and a request the arena has
room for, in one run of free bytes, is served from it without pinning."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from galahad.adapters.cuda.pinned import PinnedBuffer, PinnedPool  # noqa: E402

MIB = 1 << 20


class _Copy:
    """A stand-in for the CUDA event a copy records: `done` says whether it has finished."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _pool(nbytes: int, *, zeroed: bool = True) -> tuple[PinnedPool, torch.Tensor]:
    arena = torch.zeros(nbytes, dtype=torch.uint8) if zeroed else torch.empty(nbytes, dtype=torch.uint8)
    pool = PinnedPool()
    pool._free.append(PinnedBuffer(arena, arena=arena, start=0))  # noqa: SLF001 - as reserve_arena does
    return pool, arena


def _span(buf: PinnedBuffer, arena: torch.Tensor) -> tuple[int, int]:
    """Where `buf` lies in `arena`, from its memory (not from the pool's own bookkeeping)."""
    start = buf.tensor.data_ptr() - arena.data_ptr()
    return start, start + buf.capacity


def test_two_saves_at_once_get_their_own_piece_of_the_arena() -> None:
    pool, arena = _pool(64 * MIB)
    a = pool.acquire(9 * MIB)
    b = pool.acquire(9 * MIB)
    assert a is not None and b is not None
    assert _span(a, arena) == (0, 16 * MIB) and _span(b, arena) == (16 * MIB, 32 * MIB)
    a.view(9 * MIB).fill_(1)
    b.view(9 * MIB).fill_(2)
    assert int(arena[: 16 * MIB].sum()) == 9 * MIB and int(arena[16 * MIB : 32 * MIB].sum()) == 18 * MIB
    assert pool.pinned_allocations == 0  # served from the arena: nothing pinned on the way


def test_a_larger_request_joins_free_neighbours_and_only_them() -> None:
    pool, arena = _pool(64 * MIB)
    pieces = [pool.acquire(16 * MIB) for _ in range(4)]
    assert all(p is not None for p in pieces) and pool.acquire(MIB) is None  # all held
    first, second, third, fourth = pieces
    pool.release(first)
    pool.release(third)  # free, but not next to each other
    assert pool.acquire(32 * MIB) is None
    pool.release(second)
    both = pool.acquire(48 * MIB)  # the first three, joined
    assert both is not None and _span(both, arena) == (0, 48 * MIB)
    assert pool.acquire(MIB) is None  # the fourth is still held


def test_a_piece_whose_copy_still_runs_is_joined_only_once_that_copy_finished() -> None:
    pool, arena = _pool(32 * MIB)
    a, b = pool.acquire(16 * MIB), pool.acquire(16 * MIB)
    assert a is not None and b is not None
    copy = _Copy(done=False)  # a host-to-device copy that may still read `a`
    pool.release(a, copy)  # type: ignore[arg-type]
    pool.release(b)
    with pool._lock:  # noqa: SLF001 - the join alone, as acquire asks it first
        assert not pool._join()  # noqa: SLF001 - never while the copy runs
    whole = pool.acquire(32 * MIB)  # waits for the copy (as for a whole buffer), then joins
    assert copy.done and whole is not None and _span(whole, arena) == (0, 32 * MIB)


requests = st.lists(st.tuples(st.booleans(), st.integers(1, 40 * MIB), st.integers(0, 7)), max_size=40)


@given(requests)
def test_pieces_never_overlap_and_always_tile_the_arena(ops: list[tuple[bool, int, int]]) -> None:
    size = 128 * MIB
    pool, arena = _pool(size, zeroed=False)
    held: list[PinnedBuffer] = []
    for take, nbytes, which in ops:
        if take:
            buf = pool.acquire(nbytes)
            if buf is not None:
                assert buf.capacity >= nbytes
                held.append(buf)
        elif held:
            pool.release(held.pop(which % len(held)))
        spans = sorted(_span(b, arena) for b in held + pool._free)  # noqa: SLF001
        assert spans[0][0] == 0 and spans[-1][1] == size  # the whole arena, and no more
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
    for buf in held:
        pool.release(buf)
    whole = pool.acquire(size)  # everything back: one piece again
    assert whole is not None and _span(whole, arena) == (0, size)


def test_a_piece_taken_inside_inference_mode_is_written_outside_it() -> None:
    """vLLM's engine thread runs in `torch.inference_mode()`, the threads that fill a load's
    buffer do not: a piece must be an ordinary tensor, since an inference tensor cannot be written
    in place outside inference mode (a sealed load decrypts into it from such a thread)."""
    pool, _arena = _pool(64 * MIB)
    with torch.inference_mode():
        piece = pool.acquire(9 * MIB)
    assert piece is not None and not piece.tensor.is_inference()
    piece.view(9 * MIB).copy_(torch.ones(9 * MIB, dtype=torch.uint8))
    assert int(piece.view(9 * MIB).sum()) == 9 * MIB
