"""The batched scatter's and gather's row arithmetic (`batch_rows`, `place_rows`, `gather_rows`),
on the CPU.

`CudaBlockTransfer.scatter_many` copies the payloads of a whole load job (chunk order: an entry
per 64 tokens) into one staging buffer back to back and then places every layer's rows with one
`index_select` and one `index_copy_`; `gather_many` (and `gather`, a batch of one) does the same
the other way for a step's saves. The same functions run here on CPU tensors (the CUDA streams and
graphs around them are exercised in tests/gpu/test_cuda_transfer.py): every placed row must be
exactly the row a one-payload-at-a-time scatter would place, no other block may change, and a
gathered payload must be laid out entry after entry, layer-major, as the stored format has it.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from galahad.adapters.cuda.placement import batch_rows, gather_rows, place_rows  # noqa: E402

BLOCKS, PAGE, LAYERS = 200, 48, 5


def _payload(gen: torch.Generator, nrows: int) -> torch.Tensor:
    """A layer-major payload: `nrows` rows of `PAGE` bytes per layer."""
    return torch.randint(0, 256, (LAYERS * nrows * PAGE,), dtype=torch.uint8, generator=gen)


def _one_at_a_time(layers: list[torch.Tensor], payload: torch.Tensor, nrows: int, first: int, ids: list[int]) -> None:
    for i, layer in enumerate(layers):
        rows = payload[i * nrows * PAGE : (i + 1) * nrows * PAGE].view(nrows, PAGE)
        layer[ids] = rows[first : first + len(ids)]


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_places_every_row_where_one_scatter_per_payload_would(seed: int) -> None:
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(BLOCKS))
    rnd.shuffle(free)
    pieces = []
    for _ in range(rnd.randint(1, 9)):
        nrows = rnd.choice([1, 4, 4, 4, 7])  # chunk entries mostly alike, not always
        first = rnd.randint(0, nrows - 1)
        k = rnd.randint(0, nrows - first)
        ids = [free.pop() for _ in range(k)]
        pieces.append((nrows, first, ids, _payload(gen, nrows)))
    start = [torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8, generator=gen) for _ in range(LAYERS)]
    expect = [t.clone() for t in start]
    for nrows, first, ids, payload in pieces:
        _one_at_a_time(expect, payload, nrows, first, ids)

    got = [t.clone() for t in start]
    staging = torch.cat([payload for *_rest, payload in pieces])
    src = batch_rows([(nrows, first, len(ids)) for nrows, first, ids, _p in pieces], LAYERS)
    dst = torch.tensor([b for *_head, ids, _p in pieces for b in ids], dtype=torch.long)
    place_rows(got, staging.view(-1, PAGE), src, dst)
    for i in range(LAYERS):
        assert torch.equal(got[i], expect[i]), f"layer {i}"


def test_rows_of_later_payloads_are_offset_by_the_earlier_payloads_whole_size() -> None:
    # two payloads of 4 rows per layer, 3 layers: the second starts at row 12
    src = batch_rows([(4, 1, 2), (4, 0, 1)], 3)
    assert src.tolist() == [[1, 2, 12], [5, 6, 16], [9, 10, 20]]


def test_a_wrong_row_would_be_caught() -> None:
    """The comparison above can fail: a batch with its row arithmetic off by one is not exact."""
    gen = torch.Generator().manual_seed(1)
    payload = _payload(gen, 4)
    start = [torch.zeros((BLOCKS, PAGE), dtype=torch.uint8) for _ in range(LAYERS)]
    expect = [t.clone() for t in start]
    _one_at_a_time(expect, payload, 4, 0, [3, 9])
    got = [t.clone() for t in start]
    src = batch_rows([(4, 0, 2)], LAYERS) + 1  # off by one row
    place_rows(got, payload.view(-1, PAGE), src, torch.tensor([3, 9]))
    assert not all(torch.equal(g, e) for g, e in zip(got, expect))


@pytest.mark.parametrize("seed", range(4))
def test_a_gathered_batch_is_each_entry_layer_major_one_after_another(seed: int) -> None:
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8, generator=gen) for _ in range(LAYERS)]
    entries = [rnd.sample(range(BLOCKS), rnd.choice([1, 4, 4, 9])) for _ in range(rnd.randint(1, 6))]
    expect = torch.cat([torch.cat([layer[ids].reshape(-1) for layer in layers]) for ids in entries])
    staging = torch.zeros(expect.numel(), dtype=torch.uint8)
    where = batch_rows([(len(ids), 0, len(ids)) for ids in entries], LAYERS)
    src = torch.tensor([b for ids in entries for b in ids], dtype=torch.long)
    gather_rows(layers, staging.view(-1, PAGE), where, src)
    assert torch.equal(staging, expect)
