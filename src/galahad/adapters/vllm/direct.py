"""Direct loads: a checksum-only part goes from the page cache to the GPU with no host copy, and
is verified there.

The host load path moves every byte over host memory four times (the page cache read, the
pinned buffer written, read back to hash it, read again by the copy to the GPU); on the H200
machine that gave 0.61-0.65 of the medium's read rate inside vLLM. Here the part's file is
mapped read-only and its page cache pages registered with CUDA (`cudaHostRegister`, read-only),
a piece at a time by a few threads ahead of the copies, so the GPU's copy engine reads them
itself: one pass over host memory. Each piece lands in the load stream's staging buffer, its
1 KiB blocks are summed there (`xxh3_gpu.FrameHasher`), and its layers are copied into their
blocks; once the last piece is in, every frame's tag is computed on the GPU and handed back to
`codec.open_part_placed`, which compares them with the file's tag table. A part whose tags differ
is refused (and quarantined) exactly as on the host; the blocks it was copied into are then
recomputed by vLLM (the compute stream waits for these copies first: `DirectIn.abandon`).

A sealed part, the flat layout, a frame not a whole number of KiB, or a payload that is not
this engine's shape are declined (None) before anything moves, and read the usual way. So is
every part once CUDA refused to register a mapped file (logged once): loads then go through
pinned memory. `GALAHAD_DIRECT_LOADS=0` turns the path off.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Sequence

import numpy
import torch

from galahad.adapters.vllm.cuda import CudaBlockTransfer, _clear_last_error
from galahad.format.v1 import BlockHeader

__all__ = ["DirectIn", "DirectLoads", "direct_loads_from_env"]

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_PIECE = 16 << 20  # registered and copied a piece at a time: registration runs ahead of the copies
_REGISTER_THREADS = 4
_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the pages are a file's, mapped PROT_READ


def direct_loads_from_env(environ: dict[str, str] | None = None) -> bool:
    """`GALAHAD_DIRECT_LOADS`: on (the default) unless 0/false/off/no; anything else is logged
    and taken as on."""
    env = os.environ if environ is None else environ
    raw = env.get("GALAHAD_DIRECT_LOADS", "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    log.warning("[galahad] GALAHAD_DIRECT_LOADS=%r is not 0 or 1; direct loads stay on. Fix: set it to 0 "
                "(loads through pinned memory) or 1", raw)
    return True


class DirectLoads:
    """The process's direct load path: the hashing kernels compiled once, the registering
    threads, and whether CUDA registers mapped files at all (`usable`)."""

    def __init__(self, transfer: CudaBlockTransfer) -> None:
        self.transfer = transfer
        self.usable = True
        self._said = False
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(_REGISTER_THREADS, thread_name_prefix="galahad-register")
        self._release = cf.ThreadPoolExecutor(1, thread_name_prefix="galahad-unpin")
        self.loads = 0
        self.declined = 0

    @classmethod
    def start(cls, transfer: CudaBlockTransfer) -> DirectLoads | None:
        """The path, its kernels compiled and run once on a small payload here (so no load
        waits for Triton), or None (no Triton, or its kernels do not run here: logged)."""
        try:
            from galahad.adapters.vllm import xxh3_gpu

            probe = torch.arange(2048, dtype=torch.int64, device=transfer.device).view(torch.uint8)
            got = xxh3_gpu.frame_tags(probe, 4096, [1, 2, 3, 4])
            want = _host_tags(probe.cpu().numpy().tobytes(), 4096, [1, 2, 3, 4])
        except Exception as exc:  # noqa: BLE001 - any failure here: the host path, said once
            log.warning("[galahad] loads are verified on the host, not on the GPU (%s: %s); they go "
                        "through pinned memory", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        if got != want:
            log.warning("[galahad] the GPU's frame tags differ from xxhash's on this machine; loads are "
                        "verified on the host through pinned memory")
            return None
        log.info("[galahad] plain loads go from the page cache straight to the GPU and are verified "
                 "there (GALAHAD_DIRECT_LOADS=0: through pinned memory)")
        return cls(transfer)

    def stream_in(self, block_ids: Sequence[Sequence[int]], nrows: int, first_row: int) -> DirectIn:
        """One load's `service.DeviceLoad` (call it on the thread that runs the forward pass)."""
        return DirectIn(self, block_ids, nrows, first_row)

    def refused(self, why: str) -> None:
        with self._lock:
            self.usable, said, self._said = False, self._said, True
        if not said:
            log.warning("[galahad] CUDA does not read this page cache directly (%s); loads go through "
                        "pinned memory from now on", why)

    def register(self, addr: int, nbytes: int) -> cf.Future[str | None]:
        return self._pool.submit(_register, addr, nbytes)

    def release_later(self, mapping: _Mapping, done: torch.cuda.Event) -> None:
        """Unpin and unmap `mapping` once `done` passed on the device: off the load's path."""
        self._release.submit(mapping.release, done)


class _Mapping:
    """A part's file mapped read-only, its tensor, and the pieces of it registered with CUDA."""

    def __init__(self, fd: int, size: int) -> None:
        self.mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: torch warns; only the GPU reads it
            self.arr: numpy.ndarray | None = numpy.frombuffer(self.mapped, dtype=numpy.uint8)
            self.tensor: torch.Tensor | None = torch.from_numpy(self.arr)
        self.addr = int(self.arr.ctypes.data)
        self.spans: list[tuple[int, int, cf.Future[str | None]]] = []  # (address, bytes, registration)

    def release(self, done: torch.cuda.Event) -> None:
        try:
            done.synchronize()
            for addr, _n, fut in self.spans:
                if fut.result() is None and int(torch.cuda.cudart().cudaHostUnregister(addr)) != 0:
                    _clear_last_error()
        except Exception:  # noqa: BLE001 - at exit: nothing to tell anyone
            log.debug("[galahad] unpinning a mapped part failed", exc_info=True)
        finally:
            self.tensor = self.arr = None
            try:
                self.mapped.close()
            except (BufferError, ValueError):
                pass  # a view still exported: the mapping goes with it


def _host_tags(data: bytes, frame_size: int, seeds: Sequence[int]) -> list[bytes]:
    import xxhash

    return [xxhash.xxh3_128_digest(data[i * frame_size : (i + 1) * frame_size], seed=s) for i, s in enumerate(seeds)]


def _register(addr: int, nbytes: int) -> str | None:
    """cudaHostRegister, read-only; None, or CUDA's reason (its last error taken off again)."""
    err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, _READ_ONLY)
    if int(err) == 0:
        return None
    _clear_last_error()
    return str(torch.cuda.cudart().cudaGetErrorString(err))


class DirectIn:
    """One part loaded into its blocks straight from the page cache: called as a
    `service.DeviceLoad`, then `finish()` (verified: the compute stream waits for the copies) or
    `abandon()` (refused: it waits for them too, so the recompute is never overwritten)."""

    def __init__(self, loads: DirectLoads, block_ids: Sequence[Sequence[int]], nrows: int, first_row: int) -> None:
        t = loads.transfer
        k = len(block_ids[t.groups[0]])
        if first_row < 0 or first_row + k > nrows:
            raise ValueError(f"rows {first_row}..{first_row + k} outside a payload of {nrows}")
        self._loads, self._t = loads, t
        self._block_ids, self._nrows, self._first, self._k = block_ids, nrows, first_row, k
        self._compute = torch.cuda.current_stream(t.device)
        self._done: torch.cuda.Event | None = None
        self.used = False

    def __call__(self, fd: int, size: int, h: BlockHeader, offset: int, seeds: Sequence[int]) -> list[bytes] | None:
        from galahad.adapters.vllm.xxh3_gpu import FrameHasher

        t, loads = self._t, self._loads
        n = h.payload_len
        if not loads.usable or n != t.payload_bytes(self._nrows) or not FrameHasher.fits(n, h.frame_size):
            loads.declined += 1
            return None
        mapping = _Mapping(fd, size)
        base = mapping.addr + offset  # the payload's first byte in the mapping
        # the payload's pages in pieces, each registered on its own, ahead of the copies
        cuts = [(base + c) // _PAGE * _PAGE for c in range(0, n, _PIECE)] + [-(-(base + n) // _PAGE) * _PAGE]
        mapping.spans = [(a, b - a, loads.register(a, b - a)) for a, b in zip(cuts, cuts[1:]) if b > a]
        try:
            why = mapping.spans[0][2].result()
            if why is not None:
                loads.refused(f"cudaHostRegister: {why}")
                loads.declined += 1
                return None
            assert mapping.tensor is not None
            tags = self._move(mapping, base, mapping.tensor[offset : offset + n], h, seeds)
            loads.loads += 1
            return tags
        finally:
            done = self._done
            if done is None:
                done = torch.cuda.Event()
                done.record(t._load)
            loads.release_later(mapping, done)

    def _move(self, mapping: _Mapping, base: int, payload: torch.Tensor, h: BlockHeader,
              seeds: Sequence[int]) -> list[bytes]:
        """Copy `payload` (the mapped file's) into the blocks through the staging buffer, a
        piece at a time as its pages are registered, hashing each piece there; the tags."""
        from galahad.adapters.vllm.xxh3_gpu import FrameHasher

        t, s = self._t, self._t._load
        ends = list(itertools.accumulate(self._nrows * p for p in t.pages))
        with t._load_lock:
            s.wait_stream(self._compute)  # blocks freed by finished requests are not written early
            self.used = True
            with torch.cuda.stream(s):
                hasher = FrameHasher(payload.numel(), h.frame_size, seeds, t.device)
                idx = t._index(self._block_ids, s)
                for lo, hi in t._chunks(self._nrows):
                    at = ends[lo - 1] if lo else 0
                    m = ends[hi - 1] - at
                    staging = t._staging_for(m, s)
                    for c0 in range(at, at + m, _PIECE):
                        c1 = min(c0 + _PIECE, at + m)
                        _wait_pinned(mapping, base + c0, base + c1)
                        staging[c0 - at : c1 - at].copy_(payload[c0:c1], non_blocking=True)
                        hasher.add(staging[c0 - at : c1 - at], c0)
                    k = 0
                    for i in range(lo, hi):
                        page = t.pages[i]
                        rows = staging[k : k + self._nrows * page].view(self._nrows, page)
                        t.layers[i].index_copy_(0, idx[t.groups[i]], rows[self._first : self._first + self._k])
                        k += self._nrows * page
                tags = hasher.tags()  # waits for the load stream: every copy above has landed
                self._done = torch.cuda.Event()
                self._done.record(s)
        return tags

    def finish(self) -> None:
        if self._done is not None:
            self._compute.wait_event(self._done)

    def abandon(self) -> None:
        """The load was refused: what was copied is waited for before the recompute."""
        if self.used:
            done = torch.cuda.Event()
            done.record(self._t._load)
            self._compute.wait_event(done)


def _wait_pinned(mapping: _Mapping, lo: int, hi: int) -> None:
    """Wait until every page of the addresses lo..hi is registered (or raise: the load fails)."""
    for addr, nbytes, fut in mapping.spans:
        if addr < hi and addr + nbytes > lo:
            why = fut.result()
            if why is not None:
                raise OSError(f"cudaHostRegister of a piece of the part: {why}")
