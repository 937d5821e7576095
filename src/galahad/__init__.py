"""Galahad: a durable, encrypted, verified disk tier for LLM prompt memory (the KV cache).

The public API for custom serving stacks is `galahad.api` (`KVLayout`, `KVStore`, `LoadResult`),
also importable from here; docs/embedding.md documents it. The vLLM connector and the SGLang
backend are registered by their plugins.
"""

import importlib
from typing import Any

__all__ = ["KVLayout", "KVStore", "LoadResult", "__version__"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # imported on first use: the engines' plugins import this package and need none of it
    if name in ("KVLayout", "KVStore", "LoadResult"):
        return getattr(importlib.import_module("galahad.api"), name)
    raise AttributeError(f"module 'galahad' has no attribute {name!r}")
