"""Direct loads: a checksum-only part is read into pinned memory without the host's hash, copied
to the GPU, and verified there.

The host load path moves every byte over host memory four times: the page cache read, the
pinned buffer written, read back to hash it (a 4 MiB frame is beyond the core's cache by then),
and read again by the copy to the GPU. On the H200 machine that gave 0.61-0.65 of the medium's
read rate inside vLLM. Here the third pass goes: the part's frames are read with `os.preadv`
straight into the load's pinned buffer by a pool of threads, each piece is copied to the load
stream's staging buffer as soon as it is there, its 1 KiB blocks are summed by a kernel on a
stream of its own (`xxh3_gpu.FrameHasher`) while the next piece is copied, and the layers are
copied into their blocks. Once the last piece is in, every frame's tag is computed on the GPU
and handed back to `codec.open_part_placed`, which compares them with the file's tag table. A
part whose tags differ is refused (and quarantined) exactly as on the host; the blocks it was
copied into are then recomputed by vLLM (the compute stream waits for these copies first:
`DirectIn.abandon`).

Mapping the file and letting the GPU read its page cache pages itself (`cudaHostRegister`,
read-only) was measured first (`python bench/gpu_hash.py pipeline`, twenty-fourth session):
the copy alone then runs at 1.6x the medium, but registering the pages costs as much as the
copy and does not overlap it, so a load came to 0.6-0.7 of the medium: not used.

A sealed part, the flat layout, a frame not a whole number of KiB, or a payload that is not this
engine's shape are declined (None) before anything moves, and read the usual way.

Off unless `GALAHAD_DIRECT_LOADS=1`: inside vLLM on the H200 it has not yet been measured faster
than the host path side by side (docs/performance.md, GPU, twenty-fourth session).
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import itertools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from galahad.adapters.vllm.cuda import CudaBlockTransfer
from galahad.domain.error import IntegrityError, StoreUnavailable
from galahad.fanout import usable_cores
from galahad.format.v1 import BlockHeader

if TYPE_CHECKING:
    from galahad.adapters.vllm.xxh3_gpu import FrameHasher

__all__ = ["DirectIn", "DirectLoads"]

log = logging.getLogger(__name__)

_PIECE = 64 << 20  # copied to the GPU and hashed there a piece at a time, as the reads complete
_READ_MAX = 4 << 20  # bytes one `preadv` reads (a frame, at most this)


class DirectLoads:
    """The process's direct load path: the hashing kernels compiled once, the reading threads,
    and the stream the hashing runs on."""

    def __init__(self, transfer: CudaBlockTransfer, threads: int) -> None:
        self.transfer = transfer
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="galahad-direct")
        self.hash_stream = torch.cuda.Stream(transfer.device)
        self.loads = 0
        self.declined = 0

    @classmethod
    def start(cls, transfer: CudaBlockTransfer, threads: int | None = None) -> DirectLoads | None:
        """The path, its kernels compiled and run once on a small payload here (so no load
        waits for Triton), or None (no Triton, or its kernels do not run here: logged)."""
        try:
            from galahad.adapters.vllm import xxh3_gpu

            got, want = [], []
            # the shapes loads take (Triton specializes on sizes divisible by 16), so that no
            # load waits for a compilation: whole 4 MiB frames, and a short last one
            for extra in (0, 3 << 10):
                n = (8 << 20) + extra
                probe = torch.randint(0, 256, (n,), dtype=torch.uint8, device=transfer.device)
                h = xxh3_gpu.FrameHasher(n, 4 << 20, [1, 2, 3][: -(-n // (4 << 20))], transfer.device)
                h.add(probe[: 4 << 20], 0)
                h.add(probe[4 << 20 :], 4 << 20)
                got += h.tags()
                want += _host_tags(probe.cpu().numpy().tobytes(), 4 << 20, [1, 2, 3])
        except Exception as exc:  # noqa: BLE001 - any failure here: the host path, said once
            log.warning("[galahad] loads are verified on the host, not on the GPU (%s: %s)",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        if got != want:
            log.warning("[galahad] the GPU's frame tags differ from xxhash's on this machine; loads are "
                        "verified on the host")
            return None
        log.info("[galahad] GALAHAD_DIRECT_LOADS=1: plain loads are verified on the GPU")
        return cls(transfer, threads or min(16, max(2, usable_cores())))

    def stream_in(self, block_ids: Sequence[Sequence[int]], host: torch.Tensor, nrows: int,
                  first_row: int) -> DirectIn:
        """One load's `service.DeviceLoad` through the pinned buffer `host` (call it on the thread
        that runs the forward pass)."""
        return DirectIn(self, block_ids, host, nrows, first_row)

    def read(self, fd: int, view: memoryview, offset: int) -> cf.Future[int]:
        return self._pool.submit(os.preadv, fd, [view], offset)


def _host_tags(data: bytes, frame_size: int, seeds: Sequence[int]) -> list[bytes]:
    import xxhash

    frames = range(-(-len(data) // frame_size))
    return [xxhash.xxh3_128_digest(data[i * frame_size : (i + 1) * frame_size], seed=seeds[i]) for i in frames]


class DirectIn:
    """One part loaded into its blocks through `host`, verified on the GPU: called as a
    `service.DeviceLoad`, then `finish()` (verified: the compute stream waits for the copies) or
    `abandon()` (refused: it waits for them too, so the recompute is never overwritten)."""

    def __init__(self, loads: DirectLoads, block_ids: Sequence[Sequence[int]], host: torch.Tensor, nrows: int,
                 first_row: int) -> None:
        t = loads.transfer
        k = len(block_ids[t.groups[0]])
        if first_row < 0 or first_row + k > nrows:
            raise ValueError(f"rows {first_row}..{first_row + k} outside a payload of {nrows}")
        self._loads, self._t, self._host = loads, t, host
        self._block_ids, self._nrows, self._first, self._k = block_ids, nrows, first_row, k
        self._compute = torch.cuda.current_stream(t.device)
        self._done: torch.cuda.Event | None = None
        self.used = False

    def __call__(self, fd: int, size: int, h: BlockHeader, offset: int, seeds: Sequence[int]) -> list[bytes] | None:
        from galahad.adapters.vllm.xxh3_gpu import FrameHasher

        t, loads = self._t, self._loads
        n = h.payload_len
        if n != t.payload_bytes(self._nrows) or n > self._host.numel() or not FrameHasher.fits(n, h.frame_size):
            loads.declined += 1
            return None
        try:
            hasher = FrameHasher(n, h.frame_size, seeds, t.device)  # before anything moves
        except torch.OutOfMemoryError:
            log.warning("[galahad] no GPU memory for a direct load's %d MiB of frame sums; read on the host",
                        FrameHasher.sums_bytes(n) >> 20)
            loads.declined += 1
            return None
        view = memoryview(self._host.numpy()).cast("B")
        step = h.frame_size if h.frame_size <= _READ_MAX else _READ_MAX
        reads = [(a, min(a + step, n), loads.read(fd, view[a : min(a + step, n)], offset + a)) for a in range(0, n, step)]
        try:
            tags = self._move(reads, hasher, n)
        finally:
            for _a, _b, fut in reads:  # none left writing into the buffer after a failure
                fut.cancel() or fut.exception()
        loads.loads += 1
        return tags

    def _move(self, reads: list[tuple[int, int, cf.Future[int]]], hasher: FrameHasher, n: int) -> list[bytes]:
        """Copy the payload into the blocks through the staging buffer, a piece at a time as it
        is read, each piece hashed on the hash stream; the tags."""
        t, s, hs = self._t, self._t._load, self._loads.hash_stream
        ends = list(itertools.accumulate(self._nrows * p for p in t.pages))
        waited = 0  # reads[:waited] are checked complete
        with t._load_lock:
            s.wait_stream(self._compute)  # blocks freed by finished requests are not written early
            hs.wait_stream(torch.cuda.current_stream(t.device))  # the hasher's constants are on the device
            self.used = True
            with torch.cuda.stream(s):
                idx = t._index(self._block_ids, s)
                for lo, hi in t._chunks(self._nrows):
                    at = ends[lo - 1] if lo else 0
                    m = ends[hi - 1] - at
                    s.wait_stream(hs)  # the last chunk's hashing has read the staging buffer
                    staging = t._staging_for(m, s)
                    for c0 in range(at, at + m, _PIECE):
                        c1 = min(c0 + _PIECE, at + m)
                        while waited < len(reads) and reads[waited][0] < c1:
                            a, b, fut = reads[waited]
                            try:
                                got = fut.result()
                            except OSError as exc:  # as the store's reader says it: a miss, and
                                # EIO sets the entry aside (`KVCacheService.load_part`)
                                code = exc.errno or errno.EIO
                                raise StoreUnavailable(code, f"cannot read a part: {os.strerror(code)}") from exc
                            if got != b - a:
                                raise IntegrityError(f"truncated: payload bytes {a}.. read {got} of {b - a}")
                            waited += 1
                        piece = staging[c0 - at : c1 - at]
                        piece.copy_(self._host[c0:c1], non_blocking=True)
                        landed = torch.cuda.Event()
                        landed.record(s)
                        hs.wait_event(landed)
                        with torch.cuda.stream(hs):
                            hasher.add(piece, c0)
                    k = 0
                    for i in range(lo, hi):
                        page = t.pages[i]
                        rows = staging[k : k + self._nrows * page].view(self._nrows, page)
                        t.layers[i].index_copy_(0, idx[t.groups[i]], rows[self._first : self._first + self._k])
                        k += self._nrows * page
                s.wait_stream(hs)
                self._done = torch.cuda.Event()
                self._done.record(s)
            with torch.cuda.stream(hs):
                tags = hasher.tags()  # waits for the hash stream: every piece has landed and was summed
        return tags

    def finish(self) -> torch.cuda.Event | None:
        """The compute stream waits for the copies; their event (the pinned buffer's too)."""
        if self._done is not None:
            self._compute.wait_event(self._done)
        return self._done

    def abandon(self) -> torch.cuda.Event | None:
        """The load was refused: what was copied is waited for before the recompute; the event
        after which the pinned buffer is free (None: nothing was copied)."""
        if not self.used:
            return None
        done = torch.cuda.Event()
        done.record(self._t._load)
        self._compute.wait_event(done)
        return done


