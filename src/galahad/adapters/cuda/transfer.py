"""Whole KV blocks between vLLM's paged GPU KV cache and reused, page-locked host buffers.

The payload of one entry is layer-major: for each layer in turn, `nrows` rows of that layer's
page bytes (`(nrows, page_bytes)`), which is the segment order of a stored part. So a part read
from disk into a pinned buffer is one host-to-device copy away from the GPU, and a gathered
request is a ready payload.

- Saves (`gather`, `gather_many`): on the save stream, which first waits for the compute stream
  (the forward that wrote the blocks), two kernels a layer copy the entries' blocks into a GPU
  staging buffer, replayed as one CUDA graph per batch size (`RowGraph`, in `placement`); the
  compute stream then waits only for that (device-to-device, fast), so blocks freed and reused
  afterwards are never read half-written, and the device-to-host copy into a pinned buffer runs
  on the side while the next forward computes.
- Loads (`scatter`): on the load stream, one host-to-device copy per group of layers into the
  staging buffer, then one `index_copy_` per layer into the blocks; the compute stream waits for
  the load's event (on the device, never on the host) before the forward that reads them.
  `scatter_many` does the same for many payloads at once (a load job's 64-token entries): their
  copies back to back into the staging buffer, then one `index_select` and one `index_copy_` per
  layer for all of them, so the engine thread's cost does not grow with the number of entries.
  Those two kernels a layer are replayed as one CUDA graph per batch size as well: every torch
  call lets go of the interpreter lock and must take it back, and beside the threads that read
  the next entries or seal the last ones each such round trip costs the engine thread a wait.

No Python loop per block, no pinning per request: pinned buffers come from a `PinnedPool` (in
`pinned`) that keeps them for reuse, and the staging buffer is allocated once and grows only to a
cap.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from galahad.adapters.cuda.pinned import PinnedBuffer, PinnedPool
from galahad.adapters.cuda.placement import Kernels, RowGraph, batch_rows, batch_rows_np, gather_rows, place_rows

__all__ = ["CudaBlockTransfer", "Gathered", "Piece", "StreamIn", "transfer_for"]

log = logging.getLogger(__name__)

_STREAM_STEP = 32 << 20  # a streamed load is copied on in groups of layers of at least this much
_GRAPH_MIN_ROWS = 16  # graphs are captured for batches of 16, 32, 64, ... rows (padded)
_GRAPH_MAX_LAYER_BYTES = 64 << 20  # a batch of more rows a layer than this runs its kernels eagerly


@dataclass
class Gathered:
    """A request's blocks copied out: `buffer[:nbytes]` is the payload once `done` has completed."""

    buffer: PinnedBuffer | None  # None: copied into `host` (ordinary memory) instead
    host: torch.Tensor  # uint8 (nbytes,) view of the payload
    nbytes: int
    done: torch.cuda.Event

    def wait(self) -> None:
        """Block this thread until the payload is in host memory."""
        self.done.synchronize()

    def views(self, sizes: Sequence[int], offset: int = 0) -> list[memoryview]:
        """The payload from byte `offset` on cut into consecutive segments of `sizes` bytes
        (after `wait`)."""
        out, raw = [], memoryview(self.host.numpy()).cast("B")
        for n in sizes:
            out.append(raw[offset : offset + n])
            offset += n
        return out


class StreamIn:
    """One payload copied into its blocks layer by layer while it is still being read.

    `advance(n)` says the first n bytes of `host` are final (verified); every layer lying wholly
    within them is copied on the load stream then (host-to-device into the staging buffer, one
    `index_copy_` a layer), in groups of at least `step` bytes so a small payload is not cut into
    many copies. `finish()` copies the rest and makes the compute stream wait for all of
    it; `abandon()` (the load failed) makes it wait for what was copied, so the recompute that
    follows is never overwritten by a copy still in flight. `advance` may be called from any
    thread; the copies are ordered on the load stream.
    """

    def __init__(self, transfer: CudaBlockTransfer, block_ids: Sequence[Sequence[int]], host: torch.Tensor,
                 nrows: int, first_row: int, step: int = _STREAM_STEP) -> None:
        k = len(block_ids[transfer.groups[0]])
        if first_row < 0 or first_row + k > nrows:
            raise ValueError(f"rows {first_row}..{first_row + k} outside a payload of {nrows}")
        self._t = transfer
        self._step = step
        self._host, self._nrows, self._first, self._k = host, nrows, first_row, k
        self._ends = list(itertools.accumulate(nrows * p for p in transfer.pages))
        self._compute = torch.cuda.current_stream(transfer.device)
        self._lock = threading.Lock()
        self._next = 0  # the first layer not copied yet
        self._issued = False
        self._block_ids = block_ids
        self._idx: list[torch.Tensor] = []  # the block ids on the device, copied at the first issue

    def advance(self, verified: int) -> None:
        with self._lock:
            b = bisect.bisect_right(self._ends, verified)
            start = self._ends[self._next - 1] if self._next else 0
            if b > self._next and (b == len(self._ends) or self._ends[b - 1] - start >= self._step):
                self._issue(self._next, b)

    def finish(self) -> torch.cuda.Event:
        with self._lock:
            if self._next < len(self._ends):
                self._issue(self._next, len(self._ends))
            return self._done()

    def abandon(self) -> torch.cuda.Event | None:
        with self._lock:
            self._next = len(self._ends)  # nothing more is copied
            return self._done() if self._issued else None

    def _done(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(self._t._load)
        self._compute.wait_event(done)
        return done

    def _issue(self, a: int, b: int) -> None:
        t, s = self._t, self._t._load
        with t._load_lock:
            if not self._issued:
                _wait(s, self._compute, t._load_after)  # blocks freed by finished requests are not written early
                self._idx = t._index(self._block_ids, s)
                self._issued = True
            with torch.cuda.stream(s):
                for lo, hi in t._chunks_between(self._nrows, a, b):
                    offset = self._ends[lo - 1] if lo else 0
                    n = self._ends[hi - 1] - offset
                    staging = t._staging_for(n, s)
                    staging.copy_(self._host[offset : offset + n], non_blocking=self._host.is_pinned())
                    at = 0
                    for i in range(lo, hi):
                        page = t.pages[i]
                        rows = staging[at : at + self._nrows * page].view(self._nrows, page)
                        t.layers[i].index_copy_(0, self._idx[t.groups[i]], rows[self._first : self._first + self._k])
                        at += self._nrows * page
        self._next = b


@dataclass(frozen=True)
class Piece:
    """One payload of a `scatter_many`: `nrows` rows per layer in `host` (layer-major), the rows
    from `first_row` on going to the blocks `block_ids[g]`."""

    block_ids: Sequence[Sequence[int]]
    host: torch.Tensor  # uint8, pinned for speed
    nrows: int
    first_row: int = 0


class CudaBlockTransfer:
    """Gathers and scatters whole blocks of every layer of one GPU's paged KV cache.

    `layers[i]` is layer i's byte view `(num_blocks, page_bytes)` (uint8, on one CUDA device;
    `blocks.byte_view` builds it from vLLM's tensor without copying), and `groups[i]` the KV cache
    group whose block ids address it.
    """

    def __init__(self, layers: Sequence[torch.Tensor], groups: Sequence[int] | None = None, *,
                 pool: PinnedPool | None = None, staging_bytes: int = 2 << 30) -> None:
        if not layers:
            raise ValueError("no layers")
        self.layers = list(layers)
        self.groups = list(groups) if groups is not None else [0] * len(self.layers)
        self.device = self.layers[0].device
        if self.device.type != "cuda":
            raise ValueError(f"KV cache on {self.device}, not on a CUDA device")
        self.pages = [int(t.shape[1]) for t in self.layers]
        self.pool = pool if pool is not None else PinnedPool()
        self.staging_cap = int(staging_bytes)
        self._staging: dict[int, torch.Tensor] = {}  # one per stream: saves and loads overlap
        self._save = torch.cuda.Stream(self.device)
        self._load = torch.cuda.Stream(self.device)
        self._save_lock = threading.Lock()  # callers on several threads: each stream's staging
        self._load_lock = threading.Lock()  # buffer is used by one transfer at a time
        # Events recorded again by every transfer (under its stream's lock), not made anew: a wait
        # takes the event's state when it is queued, and each CUDA call on the engine's thread
        # lets go of the interpreter lock and must take it back.
        self._save_after = torch.cuda.Event()  # the save stream waits for the forward up to here
        self._load_after = torch.cuda.Event()  # the load stream waits for the compute stream's work
        self._gathered = torch.cuda.Event()  # the compute stream waits for a save's device-side gather
        # per stream, by padded row count: each reads or writes that stream's staging buffer
        self._graphs: dict[int, dict[int, RowGraph]] = {id(self._save): {}, id(self._load): {}}
        self._graph_sizes: set[tuple[int, int]] = set()  # (stream, rows) run once without a graph (warm-up)
        self._graphs_off = False  # set when a capture fails: the kernels are launched one by one

    # -- sizes ----------------------------------------------------------------------------------

    def payload_bytes(self, nrows: int) -> int:
        return nrows * sum(self.pages)

    def segment_bytes(self, nrows: int) -> list[int]:
        return [nrows * p for p in self.pages]

    def _chunks(self, nrows: int) -> list[tuple[int, int]]:
        """Layer ranges `[a, b)` whose rows fit the staging buffer together (at least one layer)."""
        return self._chunks_between(nrows, 0, len(self.pages))

    def _chunks_between(self, nrows: int, a: int, b: int) -> list[tuple[int, int]]:
        """`_chunks` of the layers `[a, b)` only."""
        out, lo, size = [], a, 0
        for i in range(a, b):
            n = nrows * self.pages[i]
            if i > lo and size + n > self.staging_cap:
                out.append((lo, i))
                lo, size = i, 0
            size += n
        out.append((lo, b))
        return out

    def _staging_for(self, nbytes: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """This stream's staging buffer (allocated on it, kept, grown only when too small: to the
        next power of two within the staging cap, so it grows a few times in a process's life).

        Always an ordinary tensor, never an inference tensor: vLLM runs the forward pass (and so
        the first load of a step) in `torch.inference_mode`, and a buffer made there could not
        be written afterwards by a thread outside it (a stream advanced by the frame-opening
        threads: "Inplace update to inference tensor outside InferenceMode")."""
        key = id(stream)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < nbytes:
            self._staging.pop(key, None)
            graphs = self._graphs.get(key)
            if graphs:  # they use the old buffer: captured again on the new one, once the last
                stream.synchronize()  # replay has finished (their memory goes back with them)
                graphs.clear()
            size = max(nbytes, min(self.staging_cap, 1 << (nbytes - 1).bit_length()))
            with torch.cuda.stream(stream), torch.inference_mode(False):
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._staging[key] = buf
        return buf[:nbytes]

    def _index(self, block_ids: Sequence[Sequence[int]], stream: torch.cuda.Stream) -> list[torch.Tensor]:
        """The block ids on the device, copied on `stream` from pinned memory: never a wait.

        (`torch.tensor(ids, device=...)` copies from ordinary memory, which makes this thread
        wait until the stream, and so the forward pass it waits for, has finished: 5 ms a save.)"""
        host = [torch.tensor(list(ids), dtype=torch.long).pin_memory() for ids in block_ids]
        with torch.cuda.stream(stream):
            return [h.to(self.device, non_blocking=True) for h in host]

    # -- saving ---------------------------------------------------------------------------------

    def gather(self, block_ids: Sequence[Sequence[int]], buf: PinnedBuffer | None = None) -> Gathered:
        """Copy the blocks `block_ids[g]` of every layer (in group g) out to host memory (into
        `buf` when given, a pinned buffer of the pool).

        Returns at once; the compute stream has been made to wait for the device-side gather only.
        """
        nrows = len(block_ids[self.groups[0]])
        nbytes = self.payload_bytes(nrows)
        if self.can_gather_many() and nbytes <= self.staging_cap:  # the same layout: a batch of one
            return self.gather_many([block_ids], buf)
        if buf is None:
            buf = self.pool.acquire(nbytes)
        with self._save_lock:
            host = buf.view(nbytes) if buf is not None else torch.empty(nbytes, dtype=torch.uint8)
            compute = torch.cuda.current_stream(self.device)
            s = self._save
            _wait(s, compute, self._save_after)
            idx = self._index(block_ids, s)
            chunks = self._chunks(nrows)
            gathered = self._gathered
            done = torch.cuda.Event()
            with torch.cuda.stream(s):
                staging = self._staging_for(max(nrows * sum(self.pages[a:b]) for a, b in chunks), s)
                offset = 0
                for k, (a, b) in enumerate(chunks):
                    at = 0
                    for i in range(a, b):
                        n = nrows * self.pages[i]
                        torch.index_select(self.layers[i], 0, idx[self.groups[i]],
                                           out=staging[at : at + n].view(nrows, self.pages[i]))
                        at += n
                    if k == len(chunks) - 1:
                        gathered.record(s)
                    host[offset : offset + at].copy_(staging[:at], non_blocking=buf is not None)
                    offset += at
                done.record(s)
            compute.wait_event(gathered)
        return Gathered(buf, host, nbytes, done)

    def can_gather_many(self) -> bool:
        """Whether `gather_many` applies: every layer of one page size and one KV cache group."""
        return len(set(self.pages)) == 1 and len(set(self.groups)) == 1

    def gather_many(self, pieces: Sequence[Sequence[Sequence[int]]], buf: PinnedBuffer | None = None) -> Gathered:
        """Copy several entries' blocks out at once (a step's saves, chunk order: one entry per
        64 tokens): entry after entry, each layer-major as `gather` lays one out, so entry e's
        payload starts at `payload_bytes` of the rows before it. Two kernels a layer for all of
        them (`index_select` of every entry's rows, `index_copy_` to where each entry keeps that
        layer, `batch_rows`) and one device-to-host copy, instead of a layer's copy per entry.

        Needs `can_gather_many()` and a payload within the staging cap (the caller batches).
        Returns at once; the compute stream waits for the device-side gather only.
        """
        if not self.can_gather_many():
            raise ValueError("gather_many needs one page size and one KV cache group")
        g, page, nlayers = self.groups[0], self.pages[0], len(self.layers)
        counts = [len(p[g]) for p in pieces]
        nbytes = self.payload_bytes(sum(counts))
        if nbytes > self.staging_cap:
            raise ValueError(f"{nbytes} bytes at once, over the staging cap of {self.staging_cap}")
        if buf is None:
            buf = self.pool.acquire(nbytes)
        ids = [b for p in pieces for b in p[g]]
        dst = batch_rows_np([(n, 0, n) for n in counts], nlayers)  # (layers, rows): staging rows
        m = len(ids)
        with self._save_lock:
            host = buf.view(nbytes) if buf is not None else torch.empty(nbytes, dtype=torch.uint8)
            compute = torch.cuda.current_stream(self.device)
            s = self._save
            _wait(s, compute, self._save_after)
            gathered = self._gathered
            done = torch.cuda.Event()
            with torch.cuda.stream(s):
                staging = self._staging_for(nbytes, s)
                graph = self._graph(gather_rows, m, s) if m else None
                if graph is not None:
                    graph.run(ids, dst)
                elif m:
                    host_idx = torch.cat([torch.tensor(ids, dtype=torch.long),
                                          torch.from_numpy(dst).reshape(-1)]).pin_memory()
                    idx = host_idx.to(self.device, non_blocking=True)
                    gather_rows(self.layers, staging.view(-1, page), idx[m:].view(nlayers, m), idx[:m])
                gathered.record(s)
                host.copy_(staging, non_blocking=buf is not None)
                done.record(s)
            compute.wait_event(gathered)
        return Gathered(buf, host, nbytes, done)

    def release(self, gathered: Gathered) -> None:
        """Give a gather's pinned buffer back (after its payload was written)."""
        if gathered.buffer is not None:
            self.pool.release(gathered.buffer, gathered.done)

    # -- loading --------------------------------------------------------------------------------

    def scatter(self, block_ids: Sequence[Sequence[int]], host: torch.Tensor, nrows: int,
                first_row: int = 0, *, wait: bool = True) -> torch.cuda.Event:
        """Copy a layer-major payload of `nrows` rows per layer (`host`, uint8, pinned for speed)
        into the blocks `block_ids[g]`, from row `first_row` on; returns the completion event.

        With `wait`, the compute stream is made to wait for it (on the device).
        """
        k = len(block_ids[self.groups[0]])
        if first_row < 0 or first_row + k > nrows:
            raise ValueError(f"rows {first_row}..{first_row + k} outside a payload of {nrows}")
        if host.numel() < self.payload_bytes(nrows):
            raise ValueError(f"payload of {host.numel()} bytes, {self.payload_bytes(nrows)} expected")
        with self._load_lock:
            compute = torch.cuda.current_stream(self.device)
            s = self._load
            _wait(s, compute, self._load_after)  # blocks freed by finished requests are not written early
            idx = self._index(block_ids, s)
            chunks = self._chunks(nrows)
            done = torch.cuda.Event()
            with torch.cuda.stream(s):
                staging = self._staging_for(max(nrows * sum(self.pages[a:b]) for a, b in chunks), s)
                offset = 0
                for a, b in chunks:
                    n = nrows * sum(self.pages[a:b])
                    staging[:n].copy_(host[offset : offset + n], non_blocking=host.is_pinned())
                    at = 0
                    for i in range(a, b):
                        page = self.pages[i]
                        rows = staging[at : at + nrows * page].view(nrows, page)[first_row : first_row + k]
                        self.layers[i].index_copy_(0, idx[self.groups[i]], rows)
                        at += nrows * page
                    offset += n
                done.record(s)
            if wait:
                compute.wait_event(done)
        return done

    def stream_in(self, block_ids: Sequence[Sequence[int]], host: torch.Tensor, nrows: int,
                  first_row: int = 0, *, step: int = _STREAM_STEP) -> StreamIn:
        """A scatter that starts before the payload is all there: see `StreamIn`. Call it on the
        thread that runs the forward pass (its compute stream is the one made to wait)."""
        return StreamIn(self, block_ids, host, nrows, first_row, step)

    def scatter_many(self, pieces: Sequence[Piece], *, wait: bool = True) -> torch.cuda.Event | None:
        """Copy several payloads in at once (the entries of one load job, chunk order: one per
        64 tokens): their host-to-device copies into the staging buffer back to back, then two
        kernels per layer for all of them (`place_rows`), instead of a layer's `index_copy_` per
        payload. Returns the last completion event (None for no pieces); with `wait`, the compute
        stream waits for it (on the device).

        Layers of one page size and one KV cache group only; otherwise, and for a payload larger
        than the staging buffer, one `scatter` per payload.
        """
        for p in pieces:
            k = len(p.block_ids[self.groups[0]])
            if p.first_row < 0 or p.first_row + k > p.nrows:
                raise ValueError(f"rows {p.first_row}..{p.first_row + k} outside a payload of {p.nrows}")
            if p.host.numel() < self.payload_bytes(p.nrows):
                raise ValueError(f"payload of {p.host.numel()} bytes, {self.payload_bytes(p.nrows)} expected")
        done: torch.cuda.Event | None = None
        uniform = len(set(self.pages)) == 1 and len(set(self.groups)) == 1
        batch: list[Piece] = []
        size = 0
        for p in pieces:
            n = self.payload_bytes(p.nrows)
            if not uniform or n > self.staging_cap:
                done = self.scatter(p.block_ids, p.host, p.nrows, p.first_row, wait=wait)
                continue
            if batch and size + n > self.staging_cap:
                done = self._scatter_batch(batch, size, wait)
                batch, size = [], 0
            batch.append(p)
            size += n
        if batch:
            done = self._scatter_batch(batch, size, wait)
        return done

    def _scatter_batch(self, batch: Sequence[Piece], nbytes: int, wait: bool) -> torch.cuda.Event:
        g, page = self.groups[0], self.pages[0]
        shape = [(p.nrows, p.first_row, len(p.block_ids[g])) for p in batch]
        dst = [b for p in batch for b in p.block_ids[g]]
        m = len(dst)
        with self._load_lock:
            compute = torch.cuda.current_stream(self.device)
            s = self._load
            _wait(s, compute, self._load_after)  # blocks freed by finished requests are not written early
            done = torch.cuda.Event()
            with torch.cuda.stream(s):
                staging = self._staging_for(nbytes, s)
                offset = 0
                for p in batch:
                    n = self.payload_bytes(p.nrows)
                    staging[offset : offset + n].copy_(p.host[:n], non_blocking=p.host.is_pinned())
                    offset += n
                graph = self._graph(place_rows, m, s) if m else None
                if graph is not None:
                    graph.run(dst, batch_rows_np(shape, len(self.layers)))
                else:
                    src = batch_rows(shape, len(self.layers))
                    host_idx = torch.cat([torch.tensor(dst, dtype=torch.long), src.reshape(-1)]).pin_memory()
                    idx = host_idx.to(self.device, non_blocking=True)
                    place_rows(self.layers, staging.view(-1, page), idx[m:].view(len(self.layers), m), idx[:m])
                done.record(s)
            if wait:
                compute.wait_event(done)
        return done

    def _graph(self, kernels: Kernels, m: int, s: torch.cuda.Stream) -> RowGraph | None:
        """The graph of `kernels` for `m` rows (padded to a power of two) over stream `s`'s staging
        buffer, captured on `s` the second time that size comes (the first runs eagerly: the
        kernels are warm then). None when graphs are off or capturing failed (logged once, then
        eager), and for more than `_GRAPH_MAX_LAYER_BYTES` a layer (a graph keeps a layer's rows
        as its temporary for good; launching is small beside copying that much)."""
        if self._graphs_off:
            return None
        rows = max(_GRAPH_MIN_ROWS, 1 << (m - 1).bit_length())
        page = self.pages[0]
        if rows * page > _GRAPH_MAX_LAYER_BYTES:
            return None
        graphs = self._graphs[id(s)]
        graph = graphs.get(rows)
        if graph is not None:
            return graph
        if (id(s), rows) not in self._graph_sizes:
            self._graph_sizes.add((id(s), rows))
            return None
        staging = self._staging[id(s)]
        try:
            graph = RowGraph(self.layers, staging[: staging.numel() // page * page].view(-1, page), rows, s, kernels)
        except Exception:  # noqa: BLE001 - a runtime that cannot capture: launch them eagerly
            log.warning("[galahad] cannot capture the save's and load's copy kernels as a CUDA graph; "
                        "launching them one by one", exc_info=True)
            self._graphs_off = True
            return None
        graphs[rows] = graph
        return graph



def _wait(stream: torch.cuda.Stream, other: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    """`stream.wait_stream(other)` through a kept event (that one makes and drops an event a call)."""
    event.record(other)
    stream.wait_event(event)


def transfer_for(layers: Sequence[object], *, single_group: bool,
                 reserve_bytes: int = 0, max_pinned_bytes: int = 16 << 30) -> CudaBlockTransfer | None:
    """A transfer for the worker's registered layers (`LayerView`s), or None off CUDA, with
    several KV cache groups (their entries have per-group row counts: the byte path serves them),
    or when the host would not page-lock even `pinned._ARENA_LEAST` bytes (the byte path again).

    `reserve_bytes` pins one arena at registration (`PinnedPool.reserve_arena`), so the first
    load after a restart does not pay for pinning (about 0.1 s per GB here), nor saves and loads
    that run beside each other while it has room for them.
    """
    if not layers or not single_group:
        return None
    data = [getattr(layer, "data") for layer in layers]
    if data[0].device.type != "cuda" or not torch.cuda.is_available():
        return None
    pool = PinnedPool(max_pinned_bytes)
    if reserve_bytes and not pool.reserve_arena(reserve_bytes) and pool.pin_refused:
        log.warning("[galahad] the CUDA transfer path is off: no host memory could be pinned for it "
                    "(the line before says why); saves and loads copy through ordinary memory, slower")
        return None
    return CudaBlockTransfer(data, [int(getattr(layer, "group")) for layer in layers], pool=pool)
