"""The numpy form of `batch_rows` (what the CUDA graph path fills its indices with) equals the
torch form for any batch shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from galahad.adapters.vllm.cuda import batch_rows, batch_rows_np  # noqa: E402


@st.composite
def _pieces(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        nrows = draw(st.integers(1, 9))
        first = draw(st.integers(0, nrows - 1))
        out.append((nrows, first, draw(st.integers(0, nrows - first))))
    return out


@given(_pieces(), st.integers(1, 5))
def test_batch_rows_np_equals_batch_rows(pieces: list[tuple[int, int, int]], layers: int) -> None:
    expected = batch_rows(pieces, layers)
    got = batch_rows_np(pieces, layers)
    assert got.shape == tuple(expected.shape)
    assert (torch.from_numpy(got) == expected).all()
