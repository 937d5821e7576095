"""`register_sglang_backend()`: the name `galahad` in SGLang's storage backend factory.

What it does, in the process that calls it (SGLang 0.5.23): it registers `galahad` with
`StorageBackendFactory.register_backend`, and teaches the factory to build it (0.5.23 sends
every registered name to `_create_builtin_backend`, which knows only SGLang's own backends and
raises `Unknown built-in backend`). After it, `StorageBackendFactory.create_backend("galahad",
...)` builds a `GalahadHiCacheStorage` in that process.

What it does not do: SGLang's command line accepts only its built-in names for
`--hicache-storage-backend` (argparse choices), so `--hicache-storage-backend galahad` is still
refused there; and scheduler processes started with `spawn` do not inherit a registration made
in the parent. The documented way is the `dynamic` backend, which needs no registration
(docs/sglang.md).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BACKEND_NAME", "CLASS_NAME", "MODULE_PATH", "register_sglang_backend"]

log = logging.getLogger(__name__)

BACKEND_NAME = "galahad"
MODULE_PATH = "galahad_vllm.sglang_backend"
CLASS_NAME = "GalahadHiCacheStorage"


def register_sglang_backend() -> None:
    """Register `galahad` with SGLang's storage backend factory in this process (idempotent)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    if BACKEND_NAME not in StorageBackendFactory._registry:  # noqa: SLF001 - avoid SGLang's overwrite warning
        StorageBackendFactory.register_backend(BACKEND_NAME, MODULE_PATH, CLASS_NAME)
    current = StorageBackendFactory.__dict__["_create_builtin_backend"]
    if getattr(current.__func__, "_galahad", False):
        return
    builtin = current.__func__

    def create(cls: Any, backend_name: str, backend_class: Any, storage_config: Any, mem_pool_host: Any) -> Any:
        if backend_name == BACKEND_NAME:
            return backend_class(storage_config, {})
        return builtin(cls, backend_name, backend_class, storage_config, mem_pool_host)

    create._galahad = True  # type: ignore[attr-defined]
    StorageBackendFactory._create_builtin_backend = classmethod(create)  # type: ignore[method-assign]
    log.info("[galahad] registered SGLang storage backend %r (%s.%s)", BACKEND_NAME, MODULE_PATH, CLASS_NAME)
