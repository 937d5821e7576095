"""Buffers for sealed frames: memory the kernel zeroes as it is written (adapters/posix/memory.py),
what the composition gives the service, so that no saving thread zeroes a large buffer while
holding the interpreter lock (`bench/save_stall.py` measures the engine's thread)."""

from __future__ import annotations

from galahad.adapters.posix.memory import kernel_zeroed


def test_a_kernel_zeroed_buffer_is_writable_zeros_of_its_size() -> None:
    for n in (0, 1, 4095, 1 << 20):
        buf = kernel_zeroed(n)
        assert len(buf) == n and not buf.readonly and buf.format == "B"
        assert not any(buf[: min(n, 8192)])
        if n:
            buf[-1] = 7
            assert buf[-1] == 7


def test_a_view_of_it_keeps_the_memory() -> None:
    head = kernel_zeroed(1 << 16)[:16]  # the buffer itself dropped: the view holds the mapping
    head[:] = b"x" * 16
    assert bytes(head) == b"x" * 16
