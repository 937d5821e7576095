"""Page-locked host memory for copies to and from the GPU, kept for reuse.

A `PinnedPool` hands out `PinnedBuffer`s: whole buffers pinned once and reused request after
request, pieces cut from an arena reserved at registration (and joined again when free), and
buffers of a shared region that the reader processes map. The arena is a shared region too, which
the writer processes map (`galahad.adapters.helpers.pool`): a save copied into a piece of it is
sealed and written by one of them. Shared regions are registered with CUDA like any pinned buffer. Pinning costs about 0.1 s per GB, so buffers are
pinned at registration where they can be and kept for reuse, up to a cap; when the host refuses to
page-lock memory the pool says so once, with the fix, and hands out nothing (the caller goes
through ordinary memory).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

from galahad.adapters.helpers.pool import SharedRegion

__all__ = ["PinnedBuffer", "PinnedPool"]

log = logging.getLogger(__name__)

_ROUND = 64 << 20  # pinned buffers are allocated in multiples of 64 MiB (fewer, reusable sizes)
_SMALLEST = 4 << 20


@dataclass(eq=False)
class PinnedBuffer:
    """A page-locked host buffer of `capacity` bytes; `ready` is the event its last copy recorded.

    A buffer of an arena (`PinnedPool.reserve_arena`) is the slice of it from byte `start`: the
    pool cuts a free one to the size asked for and joins free neighbours again."""

    tensor: torch.Tensor  # uint8, pinned, (capacity,)
    ready: torch.cuda.Event | None = None
    region_offset: int | None = None  # where it lies in its shared region (None: not in one)
    role: str | None = None  # "load": a buffer of the reader processes' shared region
    arena: torch.Tensor | None = None  # the reserved buffer this is a slice of (None: not one)
    start: int = 0  # where it begins in `arena`
    capacity: int = field(init=False)  # bytes; a plain field: the pool compares it often
    _bytes: memoryview | None = field(default=None, init=False, repr=False)  # `memoryview`'s, made once

    def __post_init__(self) -> None:
        self.capacity = int(self.tensor.numel())

    def view(self, nbytes: int) -> torch.Tensor:
        return self.tensor[:nbytes]

    def memoryview(self, nbytes: int) -> memoryview:
        """The first `nbytes` as bytes. The whole buffer's view is made once: a buffer is reused
        for load after load, and slicing the tensor and viewing it through numpy each time took
        12% of the reading threads' interpreter-lock time on the H200."""
        whole = self._bytes
        if whole is None:
            whole = self._bytes = memoryview(self.tensor.numpy()).cast("B")
        return whole[:nbytes]


def _register(host: torch.Tensor) -> str:
    """Page-lock `host` (memory torch did not allocate) for the GPU: "" when done, else why not.
    A refusal is also left as CUDA's "last error", which the next kernel launch check would raise
    in the engine's forward pass: it is taken off here."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
    except Exception as exc:  # noqa: BLE001 - no CUDA, or no binding (another runtime)
        return f"{type(exc).__name__}: {exc}"
    if int(err) == 0:
        return ""
    _clear_last_error()
    return f"CUDA refused: {torch.cuda.cudart().cudaGetErrorString(err)}"


def _clear_last_error() -> None:
    """cudaGetLastError() of the CUDA runtime torch loaded (torch has no binding for it)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        log.debug("[galahad] cannot reach the CUDA runtime to clear its last error", exc_info=True)


def _unregister(regions: list[tuple[SharedRegion, torch.Tensor]]) -> None:
    for _region, host in regions:
        try:
            if int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr())) != 0:
                _clear_last_error()
        except Exception:  # noqa: BLE001 - at collection or exit: nothing to tell anyone
            pass
    regions.clear()


def _pinned_size(nbytes: int) -> int:
    """Sizes buffers are pinned at: a multiple of 64 MiB, or below that the next power of two
    from 4 MiB (a 64-token chunk of an 8B model is 9 MiB: it should not hold 64)."""
    if nbytes > _ROUND // 2:
        return -(-nbytes // _ROUND) * _ROUND
    return max(_SMALLEST, 1 << (max(nbytes, 1) - 1).bit_length())


_ARENA_LEAST = 64 << 20  # the smallest arena worth reserving when the host refuses a larger one


@dataclass
class PinnedPool:
    """Pinned host buffers kept for reuse, up to `max_bytes` in all; thread-safe.

    Buffers are pinned by `reserve`, `reserve_arena` and `reserve_shared`, at registration.
    `acquire(n)` hands out the smallest free buffer of at least n bytes (waiting, on the host, for
    the last copy that used it), and never pins one: pinning costs about 0.1 s per GB, and
    `acquire` runs on a request's path. None when no free buffer fits (the caller skips the save
    or loads through ordinary memory). `release` gives a buffer back, with the event of a copy
    still reading or writing it.
    """

    max_bytes: int = 16 << 30
    _free: list[PinnedBuffer] = field(default_factory=list)
    _total: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    pinned_allocations: int = 0
    pin_refused: bool = False  # the host refused to page-lock memory at least once (logged once)
    arena_region: SharedRegion | None = None  # the region the arena lies in (`reserve_arena`)
    _regions: list[tuple[SharedRegion, torch.Tensor]] = field(default_factory=list)  # registered with CUDA

    def reserve(self, *sizes: int) -> None:
        """Pin buffers of these sizes now (at registration), so no request pays for pinning."""
        for n in sizes:
            buf = self._pin(n)
            if buf is not None:
                self.release(buf)

    def reserve_arena(self, nbytes: int) -> int:
        """Pin one buffer of `nbytes` now that serves several copies at once: `acquire` cuts a
        piece of the size asked for from it (the rest stays free) and joins free pieces again
        when a larger one is asked for. With whole buffers only, a save that finds the reserved
        one still held by the save before it pins one of its own, on the engine's thread.
        The arena is a shared region (`arena_region`, a memfd) registered with CUDA: writer
        processes map it and seal saves straight from the piece a save was copied into.

        Returns the bytes reserved: fewer when the host would not page-lock that many (halved
        down to `_ARENA_LEAST`), 0 when not even those, or when the pool is at its cap."""
        while True:
            pinned = self._pin_region(nbytes)
            if pinned is not None:
                self.arena_region, host = pinned
                buf = PinnedBuffer(host, arena=host, start=0)
                self.release(buf)
                return buf.capacity
            if not self.pin_refused or nbytes <= _ARENA_LEAST:
                return 0
            nbytes //= 2

    def reserve_shared(self, nbytes: int, count: int) -> SharedRegion | None:
        """Pin `count` buffers of at least `nbytes` in one shared region (a memfd that the reader
        processes map: `galahad.adapters.helpers.pool`), registered with CUDA like any pinned buffer (and
        unregistered when this pool is collected, before the memory can be unmapped); `acquire`
        hands them to loads only. None, and nothing reserved, when the cap or CUDA refuses it:
        the caller reserves plain ones."""
        role = "load"
        size = _pinned_size(nbytes)
        with self._lock:
            if self._total + size * count > self.max_bytes:
                return None
            self._total += size * count
        region, host, why = _shared(size * count)
        if region is None or host is None:
            with self._lock:
                self._total -= size * count
            log.warning("[galahad] cannot pin a shared region for reader processes (%s); loads are read in "
                        "this process", why)
            return None
        with self._lock:
            self.pinned_allocations += 1
            self._free.extend(PinnedBuffer(host[i * size : (i + 1) * size], region_offset=i * size, role=role)
                              for i in range(count))
        self._keep_registered(region, host)
        return region

    def _keep_registered(self, region: SharedRegion, host: torch.Tensor) -> None:
        """Unregister `host` from CUDA when this pool is collected, before its memory can be unmapped."""
        if not self._regions:
            weakref.finalize(self, _unregister, self._regions)
        self._regions.append((region, host))

    def _pin_region(self, nbytes: int) -> tuple[SharedRegion, torch.Tensor] | None:
        """`_pin` of a shared region (`SharedRegion`, registered with CUDA): the region and its
        bytes as a tensor, or None as `_pin` gives it."""
        size = _pinned_size(nbytes)
        if not self._claim(size):
            return None
        region, host, why = _shared(size)
        if region is None or host is None:
            self._refused(size, why)
            return None
        self._keep_registered(region, host)
        return region, host

    def _pin(self, nbytes: int) -> PinnedBuffer | None:
        """A new pinned buffer, or None: the pool is at its cap, or the host would not page-lock
        the memory (said once, with the fix; the caller skips the save or loads through
        ordinary memory, as at the cap)."""
        size = _pinned_size(nbytes)
        if not self._claim(size):
            return None
        try:
            with torch.inference_mode(False):  # written by any thread, as `CudaBlockTransfer._staging_for` says
                return PinnedBuffer(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        except RuntimeError as exc:  # out of page-lockable memory (memlock limit, host memory)
            self._refused(size, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return None

    def _claim(self, size: int) -> bool:
        """Count `size` bytes about to be pinned, unless that would pass the cap."""
        with self._lock:
            if self._total + size > self.max_bytes:
                return False
            self._total += size
            self.pinned_allocations += 1
        return True

    def _refused(self, size: int, why: str) -> None:
        """The host would not page-lock `size` bytes: counted back, said once with the fix."""
        with self._lock:
            self._total -= size
            self.pinned_allocations -= 1
            said, self.pin_refused = self.pin_refused, True
        if not said:
            log.warning("[galahad] cannot pin %d MiB of host memory (%s); a save that finds no "
                        "free pinned buffer is skipped (saves_skipped_backlog) and a load goes "
                        "through ordinary memory. Fix: raise the memory-lock limit of the serving "
                        "process (ulimit -l, or the container's) or free host memory", size >> 20, why)

    def acquire(self, nbytes: int, *, shared: bool | None = False) -> PinnedBuffer | None:
        """A free buffer of at least `nbytes`, or None; never pins a new one. `shared`: False
        (saves) never takes a buffer of the reader processes' region; True (loads) takes one of
        it first, else a plain one; None takes any."""
        role = "load" if shared else None
        with self._lock:
            buf = self._take(nbytes, shared, role)
            if buf is None and self._join():  # free pieces of an arena, joined, may hold it
                buf = self._take(nbytes, shared, role)
            running = [] if buf is not None else [b.ready for b in self._free if b.arena is not None
                                                  and b.ready is not None and not b.ready.query()]
        if buf is None and running:
            # free pieces whose last copy still runs: wait for those copies (as for a whole
            # buffer taken with its copy queued), then join, rather than pin a new buffer
            for copy in running:
                copy.synchronize()
            with self._lock:
                if self._join():
                    buf = self._take(nbytes, shared, role)
        if buf is None:
            return None
        if buf.ready is not None:
            buf.ready.synchronize()
            buf.ready = None
        return buf

    def _take(self, nbytes: int, shared: bool | None, role: str | None) -> PinnedBuffer | None:
        """The free buffer `acquire` hands out, taken off the free list (under the lock); a
        piece of an arena is cut to size, its rest left free (waiting for the same copy)."""
        fits = sorted((b for b in self._free if b.capacity >= nbytes
                       and (shared is None or b.role is None or b.role == role)),
                      key=lambda b: (role is not None and b.role is None, b.capacity))
        # one whose last copy has finished, if any: never wait for a copy still queued
        buf = next((b for b in fits if b.ready is None or b.ready.query()), fits[0] if fits else None)
        if buf is None:
            return None
        self._free.remove(buf)
        size = _pinned_size(nbytes)
        if buf.arena is None or buf.capacity - size < _SMALLEST:
            return buf
        end = buf.start + buf.capacity
        self._free.append(_piece(buf.arena, buf.start + size, end, buf.ready))
        return _piece(buf.arena, buf.start, buf.start + size, buf.ready)

    def _join(self) -> bool:
        """Join free pieces of each arena that lie next to each other and whose last copy has
        finished (under the lock); whether any were joined."""
        pieces: dict[int, tuple[torch.Tensor, list[PinnedBuffer]]] = {}
        for b in self._free:
            if b.arena is not None and (b.ready is None or b.ready.query()):
                pieces.setdefault(id(b.arena), (b.arena, []))[1].append(b)
        joined = False
        for arena, run in pieces.values():
            run.sort(key=lambda b: b.start)
            i = 0
            while i < len(run) - 1:
                a, b = run[i], run[i + 1]
                if a.start + a.capacity != b.start:
                    i += 1
                    continue
                both = _piece(arena, a.start, b.start + b.capacity, None)
                self._free.remove(a)
                self._free.remove(b)
                self._free.append(both)
                run[i : i + 2] = [both]
                joined = True
        return joined

    @staticmethod
    def carve(buf: PinnedBuffer, nbytes: int) -> tuple[PinnedBuffer, PinnedBuffer | None] | None:
        """Split a buffer cut from an arena (taken with `acquire`) into its first `nbytes` (as
        the pool sizes buffers) and the rest (None: nothing left); each goes back with `release`
        on its own, and free neighbours are joined again. None when `buf` is not an arena's or
        is too small. Pure bookkeeping: no CUDA call (safe on any thread, during graph capture)."""
        size = _pinned_size(nbytes)
        if buf.arena is None or size > buf.capacity:
            return None
        if buf.capacity - size < _SMALLEST:  # too little left to be worth a buffer: all of it
            return buf, None
        head = _piece(buf.arena, buf.start, buf.start + size, buf.ready)
        return head, _piece(buf.arena, buf.start + size, buf.start + buf.capacity, buf.ready)

    @staticmethod
    def footprint(nbytes: int) -> int:
        """The bytes a buffer for `nbytes` takes (`acquire`, `carve`): rounded up as pinned."""
        return _pinned_size(nbytes)

    def release(self, buf: PinnedBuffer, ready: torch.cuda.Event | None = None) -> None:
        buf.ready = ready if ready is not None else buf.ready
        with self._lock:
            self._free.append(buf)

    @property
    def total_bytes(self) -> int:
        return self._total


def _shared(size: int) -> tuple[SharedRegion | None, torch.Tensor | None, str]:
    """A shared region of `size` bytes registered with CUDA, and its bytes as a tensor; (None,
    None, why) when it cannot be made or CUDA refuses it (the region is then dropped)."""
    try:
        region = SharedRegion(size)
    except OSError as exc:
        return None, None, f"no shared memory: {exc}"
    with torch.inference_mode(False):  # an ordinary tensor, as `CudaBlockTransfer._staging_for` says
        host = torch.frombuffer(region.view, dtype=torch.uint8)
    why = _register(host)
    return (region, host, "") if not why else (None, None, why)


def _piece(arena: torch.Tensor, start: int, end: int, ready: torch.cuda.Event | None) -> PinnedBuffer:
    """Bytes `start`..`end` of `arena` as a buffer of the pool (a view: the same pinned memory)."""
    return PinnedBuffer(arena[start:end], ready=ready, arena=arena, start=start)
