"""Placing a batch of loaded rows into the paged KV cache: two kernels a layer, however many
payloads (`place_rows`, with the staging rows `batch_rows` computes), replayed as one CUDA graph
per batch size (`PlaceGraph`) so the engine thread makes two torch calls per batch, not two a layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

__all__ = ["PlaceGraph", "batch_rows", "batch_rows_np", "place_rows"]


class PlaceGraph:
    """`place_rows` for `rows` placed rows, captured once as a CUDA graph on the load stream.

    Its index buffer (the destination block ids, then each layer's staging rows) is filled from
    a pinned host buffer written with numpy (no torch call), padded by repeating the last row's
    pair: a block written twice with the same bytes. So placing a batch is two torch calls (the
    index copy and the replay) instead of two kernels a layer plus building the indices.
    """

    def __init__(self, layers: Sequence[torch.Tensor], staging_rows: torch.Tensor, rows: int,
                 stream: torch.cuda.Stream) -> None:
        self.rows, self.nlayers = rows, len(layers)
        with torch.inference_mode(False):  # written by any thread, as `CudaBlockTransfer._staging_for` says
            self.idx = torch.zeros(rows * (self.nlayers + 1), dtype=torch.long, device=staging_rows.device)
            self.host = torch.zeros(rows * (self.nlayers + 1), dtype=torch.long).pin_memory()
        self._host_np = self.host.numpy()
        self._copied: torch.cuda.Event | None = None  # the last index copy out of `host`
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            # not `torch.cuda.graph(...)`: it synchronizes the device and empties the allocator's
            # cache, under the running engine; the kernels are only recorded here, never run
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                place_rows(layers, staging_rows, self.idx[rows:].view(self.nlayers, rows), self.idx[:rows])
            finally:
                self.graph.capture_end()

    def place(self, dst: Sequence[int], shape: Sequence[tuple[int, int, int]]) -> None:
        """Place the batch (on the current stream, the load stream): `dst` its destination blocks,
        `shape` each piece's `(nrows, first_row, k)` as `batch_rows` takes them."""
        m, rows = len(dst), self.rows
        if self._copied is not None:
            # the last batch's indices have left `host`: as a rule long since. Not so if the load
            # stream still waits behind a forward pass (vLLM's asynchronous scheduling): then the
            # host waits for it here. A new pinned buffer per batch would not; not measured yet.
            self._copied.synchronize()
        out = self._host_np
        out[:m] = dst
        out[m:rows] = dst[-1]
        src = out[rows:].reshape(self.nlayers, rows)
        src[:, :m] = batch_rows_np(shape, self.nlayers)
        src[:, m:] = src[:, m - 1 : m]
        self.idx.copy_(self.host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.graph.replay()


def batch_rows(pieces: Sequence[tuple[int, int, int]], layers: int) -> torch.Tensor:
    """Where each placed row of a batch sits in the staging buffer, as rows of one page size.

    `pieces[p]` is `(nrows, first_row, k)`: piece p's payload holds `nrows` rows per layer,
    layer-major, right after the pieces before it; its rows `first_row .. first_row + k` are
    placed. Returns `(layers, sum of k)`: row `[i, j]` is the staging row of layer i of the j-th
    placed row (in piece order), so layer i is one `index_select` away from its destination rows.
    """
    return torch.from_numpy(batch_rows_np(pieces, layers))


def batch_rows_np(pieces: Sequence[tuple[int, int, int]], layers: int) -> numpy.ndarray:
    """`batch_rows` as a numpy array: what the CUDA graph path writes into its pinned index
    buffer (no torch call, so no trip through the interpreter lock)."""
    starts, strides, base = [], [], 0
    for nrows, first_row, k in pieces:
        starts.append(numpy.arange(base + first_row, base + first_row + k, dtype=numpy.int64))
        strides.append(numpy.full(k, nrows, dtype=numpy.int64))
        base += nrows * layers
    if not starts:
        return numpy.empty((layers, 0), dtype=numpy.int64)
    out: numpy.ndarray = numpy.concatenate(starts)[None, :] + numpy.arange(layers, dtype=numpy.int64)[:, None] * numpy.concatenate(strides)[None, :]
    return out


def place_rows(layers: Sequence[torch.Tensor], rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Layer i's blocks `dst` take the staging rows `src[i]` (`batch_rows`); `rows` is the
    staging buffer viewed `(n, page_bytes)`. Two kernels a layer, however many pieces."""
    for i, layer in enumerate(layers):
        layer.index_copy_(0, dst, rows.index_select(0, src[i]))

