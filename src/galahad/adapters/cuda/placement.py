"""Moving a batch of rows between the paged KV cache and a staging buffer: two kernels a layer,
however many payloads. `place_rows` puts loaded rows into their blocks, `gather_rows` copies
blocks out for a save, each with the staging rows `batch_rows` computes; `RowGraph` replays
either as one CUDA graph per batch size, so the engine thread makes two torch calls per batch, not
two a layer (every torch call lets go of the interpreter lock and must take it back, and beside
the threads sealing and reading entries each such round trip can cost the engine thread a wait).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy
import torch

__all__ = ["RowGraph", "batch_rows", "batch_rows_np", "gather_rows", "place_rows"]

Kernels = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], None]


class RowGraph:
    """`kernels` (`place_rows` or `gather_rows`) for a batch of up to `rows` rows, captured once as
    a CUDA graph on `stream` (the load or the save stream) over a fixed staging buffer.

    Its index buffer (the block ids, then each layer's staging rows) is filled from a pinned host
    buffer written with numpy, padded by repeating the last row's pair: a row copied twice with
    the same bytes. Each replay takes a host buffer of its own from torch's pinned-memory cache,
    which hands a buffer out again only once its copy has run: a copy may wait on the stream
    behind a forward pass (the stream first waits for the compute stream, and a step saves many
    batches), and reusing a buffer would make the engine's thread wait for that forward.
    The graph keeps its temporaries (one layer's rows) for as long as it lives.
    """

    def __init__(self, layers: Sequence[torch.Tensor], staging_rows: torch.Tensor, rows: int,
                 stream: torch.cuda.Stream, kernels: Kernels) -> None:
        self.rows, self.nlayers = rows, len(layers)
        n = rows * (self.nlayers + 1)
        with torch.inference_mode(False):  # written by any thread, as `CudaBlockTransfer._staging_for` says
            self.idx = torch.zeros(n, dtype=torch.long, device=staging_rows.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            # not `torch.cuda.graph(...)`: it synchronizes the device and empties the allocator's
            # cache, under the running engine; the kernels are only recorded here, never run
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                kernels(layers, staging_rows, self.idx[rows:].view(self.nlayers, rows), self.idx[:rows])
            finally:
                self.graph.capture_end()

    def run(self, blocks: Sequence[int], staging_rows: numpy.ndarray) -> None:
        """Replay for the blocks `blocks` and the `(layers, len(blocks))` staging rows of them
        (`batch_rows_np`), on the current stream (the one captured on)."""
        m, rows = len(blocks), self.rows
        with torch.inference_mode(False):
            host = torch.empty(self.idx.numel(), dtype=torch.long, pin_memory=True)
        out = host.numpy()
        out[:m] = blocks
        out[m:rows] = out[m - 1]
        at = out[rows:].reshape(self.nlayers, rows)
        at[:, :m] = staging_rows
        at[:, m:] = at[:, m - 1 : m]
        self.idx.copy_(host, non_blocking=True)  # the cache holds `host` until this copy has run
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


def gather_rows(layers: Sequence[torch.Tensor], rows: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """The staging rows `dst[i]` (`batch_rows`) take layer i's blocks `src`: `place_rows` the
    other way, a save's copy out. Two kernels a layer, however many entries."""
    for i, layer in enumerate(layers):
        rows.index_copy_(0, dst[i], layer.index_select(0, src))

