"""One host pool's page, as the segments of a Galahad part.

SGLang's host pools (research/sglang_hicache_api.md §3) keep a page in one of several layouts.
For the KV pools we know (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost` in `layer_first`,
`page_first`, `page_first_direct` or `page_head`) a page is a view into the pool's buffer made of
a few contiguous pieces (K and V, or one per layer): those pieces are our segments, copied
straight between the pool and our buffers. Any other pool (mamba state, future pools) goes
through the pool's own flat-page API (`get_data_page` / `set_from_flat_data_page`), as one
byte segment.

Either way the payload of a page is its bytes in the order of SGLang's flat page
(`get_data_page(i, flat=True)`), so the zero-copy interface (`batch_*_v1`) and the copy
interface (`batch_get` / `batch_set`, flat tensors) read and write the same entries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from galahad.domain.error import ConfigError
from galahad.app.service import SegmentSpec

__all__ = ["PageGeometry", "dtype_name"]

_MAX_NDIM = 4
_VIEW_POOLS = {"MHATokenToKVPoolHost", "MLATokenToKVPoolHost"}
_VIEW_LAYOUTS = {"layer_first", "page_first", "page_first_direct", "page_head"}
_STATE_POOLS = {"mamba"}
_SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head (MHA only)")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def _fold(shape: Sequence[int]) -> tuple[int, ...]:
    """Drop leading 1s and merge leading dimensions until at most four remain."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    while len(dims) > _MAX_NDIM:
        dims[0:2] = [dims[0] * dims[1]]
    return tuple(dims) or (1,)


def _pieces(view: torch.Tensor) -> list[torch.Tensor]:
    """The maximal contiguous sub-tensors of `view`, in row-major (flatten) order."""
    if view.is_contiguous():
        return [view]
    out: list[torch.Tensor] = []
    for i in range(view.shape[0]):
        out.extend(_pieces(view[i]))
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


@attrs.frozen
class PageGeometry:
    """How to move one page of one pool between host memory and a part's segments.

    `view` mode: the page is `pieces` contiguous views of the pool buffer (copied directly).
    `flat` mode: through the pool's flat-page calls, one uint8 segment of `nbytes`.
    """

    pool_name: str
    page_size: int
    mode: str
    segments: tuple[SegmentSpec, ...]
    nbytes: int
    spec: str  # the same on every rank and stage (shapes and layer ranges are checked per part)

    @classmethod
    def of(cls, pool: Any, pool_name: str, group: int) -> PageGeometry:
        """Inspect `pool` (a SGLang host pool) once, at registration.

        A pool whose pages cannot be read whole through its own page calls (SGLang's
        `page_unified` and `page_first_kv_split` layouts, which only its copy kernels move; K and
        V heads of different sizes) is refused here with a `ConfigError` naming the pool, its
        layout and the layouts that work, rather than accepted and failing on every call.
        """
        try:
            return cls._inspect(pool, pool_name, group)
        except Exception as exc:  # noqa: BLE001 - SGLang's pool raises what it likes: translated here
            layout = getattr(pool, "layout", "?")
            raise ConfigError(
                f"SGLang's host pool {type(pool).__name__} (pool {pool_name}, layout {layout!r}) cannot "
                f"hand over its pages whole ({type(exc).__name__}: {exc}); Galahad stores the layouts "
                f"{', '.join(_SUPPORTED_LAYOUTS)}: launch SGLang with --hicache-mem-layout "
                "page_first_direct --hicache-io-backend direct (docs/sglang.md)"
            ) from exc

    @classmethod
    def _inspect(cls, pool: Any, pool_name: str, group: int) -> PageGeometry:
        page_size = int(pool.page_size)
        kind = 1 if pool_name in _STATE_POOLS else 0
        start = int(getattr(pool, "start_layer", 0) or 0)
        layout = str(getattr(pool, "layout", ""))
        if type(pool).__name__ in _VIEW_POOLS and layout in _VIEW_LAYOUTS:
            pieces = _pieces(pool.get_data_page(0, flat=False))
            per_piece = len(pieces) // 2 if type(pool).__name__.startswith("MHA") else len(pieces)
            segments = tuple(
                SegmentSpec(group=group, layer=start + (i % per_piece if layout == "layer_first" else 0),
                            kind=kind, dtype=dtype_name(p.dtype), shape=_fold(p.shape))
                for i, p in enumerate(pieces)
            )
            nbytes = sum(p.numel() * p.element_size() for p in pieces)
            mode = "view"
        else:
            dummy = pool.get_dummy_flat_data_page()
            nbytes = dummy.numel() * dummy.element_size()
            page = pool.get_data_page(0, flat=True)  # a layout the pool cannot flatten raises here, once
            if page.numel() * page.element_size() != nbytes:
                raise ValueError(f"its flat page is {page.numel() * page.element_size()} bytes, "
                                 f"its empty page {nbytes}")
            segments = (SegmentSpec(group=group, layer=start, kind=kind, dtype="uint8", shape=(nbytes,)),)
            mode = "flat"
        spec = f"{pool_name}:{type(pool).__name__}:{layout}:{mode}:page{page_size}:{_heads(pool)}"
        return cls(pool_name, page_size, mode, segments, nbytes, spec)

    @property
    def segment_bytes(self) -> list[int]:
        return [math.prod(s.shape) * _itemsize(s.dtype) for s in self.segments]

    # -- host memory -> private buffer ------------------------------------------------------

    def snapshot(self, pool: Any, index: int) -> torch.Tensor:
        """A private copy of the page at token `index` (flat uint8), safe to write later."""
        if self.mode == "view":
            out = torch.empty(self.nbytes, dtype=torch.uint8)
            offset = 0
            for piece in _pieces(pool.get_data_page(index, flat=False)):
                src = _bytes_of(piece)
                out[offset : offset + src.numel()].copy_(src)
                offset += src.numel()
            return out
        return self.snapshot_flat(pool.get_data_page(index, flat=True))

    def snapshot_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """A private copy of a flat page tensor (the copy interface's value)."""
        src = flat.detach().reshape(-1).contiguous().view(torch.uint8)
        if src.numel() != self.nbytes:
            raise ValueError(f"a {self.pool_name} page is {self.nbytes} bytes, got {src.numel()}")
        return src.clone()

    def split(self, flat: torch.Tensor) -> list[memoryview]:
        """A snapshot cut into one buffer per segment (views, no copy)."""
        whole = memoryview(flat.numpy()).cast("B")
        out, offset = [], 0
        for size in self.segment_bytes:
            out.append(whole[offset : offset + size])
            offset += size
        return out

    # -- private buffer -> host memory ------------------------------------------------------

    def fill(self, pool: Any, index: int, payload: memoryview) -> None:
        """Copy a verified payload into the pool's page at token `index`."""
        src = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        if src.numel() != self.nbytes:
            raise ValueError(f"a {self.pool_name} page is {self.nbytes} bytes, the entry holds {src.numel()}")
        if self.mode == "view":
            offset = 0
            for piece in _pieces(pool.get_data_page(index, flat=False)):
                dst = _bytes_of(piece)
                dst.copy_(src[offset : offset + dst.numel()])
                offset += dst.numel()
            return
        page = pool.get_dummy_flat_data_page()
        page.reshape(-1).view(torch.uint8).copy_(src)
        pool.set_from_flat_data_page(index, page)

    def fill_flat(self, target: torch.Tensor, payload: memoryview) -> torch.Tensor:
        """Copy a verified payload into a flat page tensor (the copy interface's target)."""
        dst = target.reshape(-1).view(torch.uint8)
        if dst.numel() != self.nbytes or len(payload) != self.nbytes:
            raise ValueError(f"a {self.pool_name} page is {self.nbytes} bytes")
        dst.copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return target

    def matches(self, header: Any) -> bool:
        """Whether a loaded part's segment table is this page's (shape, layer and size)."""
        segs = getattr(header, "segments", None)
        if segs is None or len(segs) != len(self.segments):
            return False
        return all(
            tuple(got.shape) == tuple(want.shape) and got.layer == want.layer and got.nbytes == size
            for got, want, size in zip(segs, self.segments, self.segment_bytes)
        )


def _heads(pool: Any) -> str:
    """The per-token geometry, the same on every pipeline stage (layer counts are checked per part)."""
    names = ("dtype", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim",
             "kv_cache_dim")
    return ",".join(f"{n}={getattr(pool, n)}" for n in names if hasattr(pool, n))


def _itemsize(name: str) -> int:
    return torch.empty(0, dtype=getattr(torch, name)).element_size()
