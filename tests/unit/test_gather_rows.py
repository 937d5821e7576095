"""The batched save gather's row arithmetic (`gather_rows`, `gather_index_np`), on the CPU.

`CudaBlockTransfer.gather_many` copies a step's saved entries out with two kernels a layer for
the whole batch, eagerly or as a CUDA graph captured for a padded row count (its indices filled
by `gather_index_np`, the padding repeating the last row's pair). The same functions run here on
CPU tensors (the graph itself is exercised in tests/gpu/test_cuda_transfer.py): the staging
buffer must hold exactly what one gather per entry would, entry after entry, each layer-major,
padded or not.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
numpy = pytest.importorskip("numpy")

from galahad.adapters.vllm.cuda import gather_index_np, gather_rows  # noqa: E402

BLOCKS, PAGE, LAYERS = 120, 32, 5


def _one_at_a_time(layers: list[torch.Tensor], pieces: list[list[int]]) -> torch.Tensor:
    """Each entry's payload: every layer's rows of its blocks, layer after layer; entries in order."""
    return torch.cat([layer[ids].reshape(-1) for ids in pieces for layer in layers])


def _padded(layers: list[torch.Tensor], pieces: list[list[int]], rows: int) -> torch.Tensor:
    ids = [b for p in pieces for b in p]
    out = numpy.zeros(rows * (LAYERS + 1), dtype=numpy.int64)
    gather_index_np(ids, [len(p) for p in pieces], LAYERS, rows, out)
    idx = torch.from_numpy(out)
    staging = torch.zeros(len(ids) * LAYERS, PAGE, dtype=torch.uint8)
    gather_rows(layers, staging, idx[:rows], idx[rows:].view(LAYERS, rows))
    return staging.reshape(-1)


def _case(seed: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8, generator=gen) for _ in range(LAYERS)]
    free = list(range(BLOCKS))
    rnd.shuffle(free)
    pieces = [[free.pop() for _ in range(rnd.choice([1, 4, 4, 4, 6]))] for _ in range(rnd.randint(1, 8))]
    return layers, pieces


@pytest.mark.parametrize("seed", range(6))
def test_a_padded_batch_gathers_what_one_gather_per_entry_would(seed: int) -> None:
    layers, pieces = _case(seed)
    m = sum(len(p) for p in pieces)
    for rows in (m, max(16, 1 << (m - 1).bit_length())):  # exact, and padded as the graphs are
        assert torch.equal(_padded(layers, pieces, rows), _one_at_a_time(layers, pieces)), rows


def test_a_gather_with_its_rows_off_by_one_would_be_caught() -> None:
    """The comparison above can fail: indices one row off do not give the entries' bytes."""
    layers, pieces = _case(1)
    ids = [b + 1 for p in pieces for b in p]  # the next block's rows
    rows = len(ids)
    out = numpy.zeros(rows * (LAYERS + 1), dtype=numpy.int64)
    gather_index_np([b % BLOCKS for b in ids], [len(p) for p in pieces], LAYERS, rows, out)
    idx = torch.from_numpy(out)
    staging = torch.zeros(rows * LAYERS, PAGE, dtype=torch.uint8)
    gather_rows(layers, staging, idx[:rows], idx[rows:].view(LAYERS, rows))
    assert not torch.equal(staging.reshape(-1), _one_at_a_time(layers, pieces))


def test_more_rows_than_the_graph_holds_are_refused() -> None:
    with pytest.raises(ValueError):
        gather_index_np(list(range(20)), [20], LAYERS, 16, numpy.zeros(16 * (LAYERS + 1), dtype=numpy.int64))
