"""Which pinned buffers `PinnedPool.acquire` hands to whom: the loads' shared region (reader
processes) only to loads, the saves' shared region (save processes) only to saves, plain buffers
to anyone. The pool's own logic, on this CPU machine: the buffers here are ordinary tensors put
in its free list (pinning and registering them needs CUDA: tests/gpu/test_reader_region.py and
tests/gpu/test_save_region.py pin real ones)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from galahad.adapters.vllm.cuda import PinnedBuffer, PinnedPool  # noqa: E402

MIB = 1 << 20


def _pool() -> PinnedPool:
    pool = PinnedPool()
    pool._free.extend([  # noqa: SLF001 - the free list, as reserve and reserve_shared fill it
        PinnedBuffer(torch.empty(8 * MIB, dtype=torch.uint8)),
        PinnedBuffer(torch.empty(8 * MIB, dtype=torch.uint8), region_offset=0, role="load"),
        PinnedBuffer(torch.empty(8 * MIB, dtype=torch.uint8), region_offset=0, role="save"),
    ])
    return pool


def test_each_shared_region_goes_to_its_own_side_first() -> None:
    pool = _pool()
    assert pool.acquire(MIB, pin=False, shared="save").role == "save"
    assert pool.acquire(MIB, pin=False, shared=True).role == "load"
    assert pool.acquire(MIB, pin=False, shared="save").role is None  # then a plain one
    assert pool.acquire(MIB, pin=False, shared=True) is None  # never the other side's region


def test_gathers_take_plain_buffers_only_and_none_takes_any() -> None:
    pool = _pool()
    assert pool.acquire(MIB, pin=False).role is None
    assert pool.acquire(MIB, pin=False) is None
    roles = {pool.acquire(MIB, pin=False, shared=None).role for _ in range(2)}
    assert roles == {"load", "save"}


def test_a_region_is_for_loads_or_saves() -> None:
    with pytest.raises(ValueError, match="loads or saves"):
        PinnedPool().reserve_shared(MIB, 1, role="both")
