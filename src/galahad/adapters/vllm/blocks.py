"""The engine's paged KV cache as opaque bytes: copy whole blocks out (save) and in (load).

vLLM 0.32 hands each attention layer over as a `[B, H, N, C]` view of one shared allocation; on
the CPU backend the kernel reinterprets each page, so a block is treated as opaque bytes: a byte
view `(num_blocks, page_bytes)` is built from the storage and strides (never `.contiguous()`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KVBlocks", "LayerView", "UnsupportedLayout"]

log = logging.getLogger(__name__)


class UnsupportedLayout(Exception):
    """A KV tensor whose blocks are not dense byte ranges (cannot be copied as whole blocks)."""


@dataclass(frozen=True)
class LayerView:
    """One layer's blocks as bytes: `data[b]` is engine block b's page (all its kernel blocks)."""

    name: str
    group: int
    index: int  # position of the layer within its group
    data: torch.Tensor  # uint8 (num_blocks, page_bytes)
    dtype: torch.dtype
    block_shape: tuple[int, ...]  # logical shape of one engine block in `dtype` elements

    @property
    def page_bytes(self) -> int:
        return int(self.data.shape[1])

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    expect = 1
    for stride, size in sorted(zip(strides, shape)):
        if size == 1:
            continue
        if stride != expect:
            return False
        expect *= size
    return True


def byte_view(t: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`(num_blocks, page_bytes)` uint8 view of a `[B, ...]` KV tensor, and one block's shape."""
    if t.dim() < 2 or t.shape[0] % num_blocks:
        raise UnsupportedLayout(f"shape {tuple(t.shape)} does not split into {num_blocks} blocks")
    ratio = t.shape[0] // num_blocks
    inner_shape, inner_strides = tuple(t.shape[1:]), tuple(t.stride()[1:])
    if not _dense(inner_shape, inner_strides):
        raise UnsupportedLayout(f"block pages of shape {inner_shape} strides {inner_strides} "
                                "are not dense")
    page = math.prod(inner_shape)
    if ratio > 1 and t.stride(0) != page:
        raise UnsupportedLayout("kernel blocks of one engine block are not adjacent")
    elt = t.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(),
        t.storage_offset() * elt,
        (num_blocks, ratio * page * elt),
        (ratio * t.stride(0) * elt, 1),
    )
    shape = ((ratio,) if ratio > 1 else ()) + inner_shape
    return view, shape


class KVBlocks:
    """Every registered layer's byte view, by group, in the group's layer order."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> None:
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.groups: list[list[LayerView]] = []
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            layers = []
            for i, name in enumerate(group.layer_names):
                if name not in kv_caches:
                    raise UnsupportedLayout(f"layer {name} of group {g} has no KV tensor")
                t = kv_caches[name]
                data, shape = byte_view(t, self.num_blocks)
                layers.append(LayerView(name, g, i, data, t.dtype, shape))
            self.groups.append(layers)

    def layers(self) -> list[LayerView]:
        return [layer for group in self.groups for layer in group]

    def indices(self, block_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each group's block ids (`block_ids[g]`, as an entry lists them) as an index tensor on
        that group's device, for `gather` and `scatter`: made once for all the layers of an
        entry, not once per layer, on the engine's thread."""
        return [torch.tensor(list(ids), dtype=torch.long, device=group[0].data.device if group else "cpu")
                for ids, group in zip(block_ids, self.groups)]

    @staticmethod
    def gather(layer: LayerView, index: torch.Tensor) -> torch.Tensor:
        """A host copy `(len(index), page_bytes)` of the blocks `index` lists (`indices`)."""
        out = layer.data.index_select(0, index)
        return out if out.device.type == "cpu" else out.cpu()

    @staticmethod
    def scatter(layer: LayerView, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` (uint8 `(len(index), page_bytes)`) into the blocks `index` lists (`indices`)."""
        layer.data.index_copy_(0, index, rows.to(layer.data.device))

    @staticmethod
    def perturb(layer: LayerView, rows: torch.Tensor) -> torch.Tensor:
        """TEST ONLY: negate every element (valid numbers, wrong KV); zero a byte-typed page (a
        mamba state of mixed dtypes: the state of an empty context, not this one)."""
        if layer.dtype.is_floating_point:
            return rows.clone().view(layer.dtype).neg_().view(torch.uint8)
        return torch.zeros_like(rows)
