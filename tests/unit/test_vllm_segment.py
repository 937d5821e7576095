"""The segment table a saved part's header carries for each layer (`worker.saves.segment_of`).

It is the layer's logical block shape in its dtype when pages are dense, raw bytes when they are
padded, for every KV dtype vLLM uses.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from galahad.adapters.vllm.blocks import LayerView  # noqa: E402
from galahad.adapters.vllm.worker.saves import segment_of as _segment  # noqa: E402
from galahad.app.service import SegmentSpec  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_dense_page_is_described_by_its_block_shape_in_its_dtype(dtype: torch.dtype) -> None:
    shape = (2, 16, 8, 128)
    elem = torch.empty(0, dtype=dtype).element_size()
    data = torch.zeros(4, 2 * 16 * 8 * 128 * elem, dtype=torch.uint8)
    layer = LayerView("l0", 0, 3, data, dtype, shape)
    assert _segment(layer, 5) == SegmentSpec(0, 3, 0, str(dtype).removeprefix("torch."), (5, *shape))
    assert _segment(layer, 5, state=True).kind == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_padded_page_is_described_as_raw_bytes(dtype: torch.dtype) -> None:
    shape = (2, 16, 8, 128)
    elem = torch.empty(0, dtype=dtype).element_size()
    page = 2 * 16 * 8 * 128 * elem + 64  # padding after the block's elements
    layer = LayerView("l1", 1, 0, torch.zeros(4, page, dtype=torch.uint8), dtype, shape)
    assert _segment(layer, 7) == SegmentSpec(1, 0, 0, "uint8", (7, page))
