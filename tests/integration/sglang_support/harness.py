"""SGLang's real host pools on the CPU, its storage config, page keys, and a Galahad environment.

Pools are SGLang's own `MHATokenToKVPoolHost`, `MLATokenToKVPoolHost` and `MambaPoolHost`, built
from CPU tensors standing for the device pool (research/sglang_hicache_api.md §6.2). Page keys
follow SGLang's formula (§1.3): SHA-256 chained over each page's token ids as little-endian
uint32, lowercase hex.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "DEFAULT_GEOMETRY",
    "LAYOUTS",
    "controller",
    "fill_random",
    "galahad_env",
    "mamba_pool",
    "make_pool",
    "page_keys",
    "storage_config",
]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DEFAULT_GEOMETRY = {"layers": 4, "heads": 2, "head_dim": 16, "page_size": 16, "capacity": 256}
MODEL = "test-org/Tiny-Galahad-7B"


def make_pool(kind: str, layout: str, *, layers: int = 4, heads: int = 2, head_dim: int = 16,
              page_size: int = 16, capacity: int = 256, dtype: torch.dtype = torch.bfloat16,
              start_layer: int = 0) -> Any:
    """SGLang's MHA (`kind="mha"`) or MLA (`"mla"`) host pool, on the CPU."""
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    cpu = torch.device("cpu")
    rows = capacity + page_size
    if kind == "mha":
        k = tuple(torch.zeros(rows, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(rows, heads, head_dim, dtype=dtype) for _ in range(layers))
        ptrs = [torch.tensor([t.data_ptr() for t in side], dtype=torch.uint64) for side in (k, v)]
        info = MHABufferInfo(
            buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
            page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype, device=cpu)
        return MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=capacity, start_layer=start_layer,
                                    end_layer=start_layer + layers)
    if kind == "mla":
        lora, rope = 4 * head_dim, head_dim
        bufs = tuple(torch.zeros(rows, 1, lora + rope, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(
            buffers=bufs, data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
            layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
            kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=dtype, device=cpu)
        return MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=capacity, start_layer=start_layer,
                                    end_layer=start_layer + layers, target_layer_num=layers)
    raise ValueError(kind)


def mamba_pool(*, layers: int = 2, slots: int = 32) -> Any:
    """SGLang's `MambaPoolHost` (page size 1: one state slot per page), on the CPU."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(layers, slots, 3, 8, dtype=torch.bfloat16),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                         layout="page_first")


def fill_random(pool: Any, seed: int) -> None:
    """Fill every buffer of `pool` with reproducible random values."""
    gen = torch.Generator().manual_seed(seed)
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, (list, tuple)) else [pool.kv_buffer]
    if hasattr(pool, "temporal_buffer"):
        buffers = [pool.temporal_buffer, *pool.conv_buffer]
    for buf in buffers:
        raw = buf.view(torch.uint8) if buf.is_contiguous() else buf
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8).view(raw.dtype)
                  if raw.dtype == torch.uint8 else torch.randn(raw.shape, generator=gen).to(raw.dtype))


def page_keys(tokens: Sequence[int], page_size: int, prior: bytes | None = None) -> list[str]:
    """SGLang's page keys for `tokens` (research §1.3), computed with hashlib."""
    keys, prev = [], prior
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(struct.pack(f"<{page_size}I", *tokens[start : start + page_size]))
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def storage_config(*, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                   mla: bool = False, model: str | None = MODEL, extra: dict[str, Any] | None = None,
                   page_first: bool = False) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    base = {"backend_name": "galahad", "module_path": "galahad_vllm.sglang_backend",
            "class_name": "GalahadHiCacheStorage", "interface_v1": 1,
            "model_fingerprint": "sha-of-the-test-weights"}
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=page_first,
        model_name=model, extra_config={**base, **(extra or {})})


def controller(backend: Any, pool: Any) -> SimpleNamespace:
    """The state `HiCacheController`'s page functions read, to call them unbound (research §6.2)."""
    ctl = SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool,
                          page_size=pool.page_size)
    return ctl


def operation(request_id: str = "r0") -> SimpleNamespace:
    """The bits of a `PrefetchOperation` the page-get functions touch."""
    return SimpleNamespace(request_id=request_id, is_terminated=lambda: False)


def galahad_env(root: Path, *, encrypted: bool = True) -> dict[str, str]:
    """`GALAHAD_*` settings for a fresh store under `root`, with a key and a valid licence."""
    root.mkdir(parents=True, exist_ok=True)
    env = {"GALAHAD_CACHE_DIR": str(root / "store")}
    if encrypted:
        env["GALAHAD_KEY_FILE"] = str(root / "store.key")
    env.update(_licence(root))
    return env


def _licence(root: Path) -> dict[str, str]:
    """Issue a licence for the test with our own issuer code (a fresh issuer key per store)."""
    import datetime as dt

    from galahad.adapters.licence.issuer import generate_issuer, issue_licence, load_issuer_key

    lic = root / "licence.lic"
    public = root / "issuer" / "issuer.pub"
    if not lic.exists():
        private, public, _ = generate_issuer(root / "issuer")
        signed = issue_licence(load_issuer_key(private), "sglang-tests", 64, dt.date.today(), 30)
        lic.write_bytes(signed.encode())
    return {"GALAHAD_LICENCE_FILE": str(lic), "GALAHAD_LICENCE_ISSUER_KEY": str(public)}


def apply_env(monkeypatch: Any, env: dict[str, str]) -> None:
    for name in [n for n in os.environ if n.startswith("GALAHAD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def backup(ctl: SimpleNamespace, keys: list[str], indices: Any, *, zero_copy: bool) -> int:
    """Run HiCacheController._page_backup (the backup thread's loop) over `keys`; tokens done."""
    from sglang.srt.managers.cache_controller import HiCacheController

    setter = HiCacheController._page_set_zero_copy if zero_copy else HiCacheController._generic_page_set
    ctl.page_set_func = functools.partial(setter, ctl)
    op = SimpleNamespace(hash_value=keys, host_indices=indices, prefix_keys=None, completed_tokens=0)
    HiCacheController._page_backup(ctl, op)
    return int(op.completed_tokens)


def flat_pages(pool: Any, indices: Any, pages: int) -> list[Any]:
    """The bytes of the first `pages` pages at `indices` of a host pool, copied."""
    return [pool.get_data_page(int(indices[i * pool.page_size]), flat=True).view(torch.uint8).clone()
            for i in range(pages)]
