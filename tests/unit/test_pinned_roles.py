"""Which pinned buffers `PinnedPool.acquire` hands to whom: the loads' shared region (reader
processes) only to loads, plain buffers to anyone. The pool's own logic, on this CPU machine: the
buffers here are ordinary tensors put in its free list (pinning and registering them needs CUDA:
tests/gpu/test_reader_region.py pins real ones)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from galahad.adapters.cuda.pinned import PinnedBuffer, PinnedPool  # noqa: E402

MIB = 1 << 20


def _pool() -> PinnedPool:
    pool = PinnedPool()
    pool._free.extend([  # noqa: SLF001 - the free list, as reserve and reserve_shared fill it
        PinnedBuffer(torch.empty(8 * MIB, dtype=torch.uint8)),
        PinnedBuffer(torch.empty(8 * MIB, dtype=torch.uint8), region_offset=0, role="load"),
    ])
    return pool


def test_loads_take_the_shared_region_first_then_a_plain_buffer() -> None:
    pool = _pool()
    assert pool.acquire(MIB, shared=True).role == "load"
    assert pool.acquire(MIB, shared=True).role is None
    assert pool.acquire(MIB, shared=True) is None


def test_saves_never_take_the_loads_region_and_none_takes_any() -> None:
    pool = _pool()
    assert pool.acquire(MIB).role is None
    assert pool.acquire(MIB) is None  # the region is the loads'
    assert pool.acquire(MIB, shared=None).role == "load"
