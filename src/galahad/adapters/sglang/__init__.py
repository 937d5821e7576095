"""The SGLang adapter: `GalahadHiCacheStorage`, a storage backend for SGLang's hierarchical cache.

Importing this package does no work; `GalahadHiCacheStorage` (which subclasses SGLang's
`HiCacheStorage`, so imports SGLang and torch) is loaded on first use. The documented module
path is `galahad_vllm.sglang_backend` (docs/sglang.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GalahadHiCacheStorage", "register_sglang_backend"]


def __getattr__(name: str) -> Any:
    if name == "GalahadHiCacheStorage":
        from galahad.adapters.sglang.backend import GalahadHiCacheStorage

        return GalahadHiCacheStorage
    if name == "register_sglang_backend":
        from galahad.adapters.sglang.registration import register_sglang_backend

        return register_sglang_backend
    raise AttributeError(name)
