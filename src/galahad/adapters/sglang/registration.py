"""`register_sglang_backend()`: the name `galahad` for SGLang's `--hicache-storage-backend`.

What it does, in the process that calls it (SGLang 0.5.23):
- it registers `galahad` with `StorageBackendFactory.register_backend`, and teaches the factory
  to build it (0.5.23 sends every registered name to `_create_builtin_backend`, which knows only
  SGLang's own backends and raises `Unknown built-in backend`);
- it adds `galahad` to the choices SGLang's command line accepts for `--hicache-storage-backend`
  (argparse `choices`, read from the `Arg` of `ServerArgs.hicache_storage_backend` each time
  SGLang builds its parser).

Every SGLang process needs the first, and the scheduler processes are started with `spawn`, so
they do not inherit a registration made in the parent. Galahad is therefore also a general
SGLang plugin (entry point `sglang.srt.plugins`, `sglang_plugin` below): SGLang runs it in each of
its processes (`load_plugins()`), and `python -m sglang.launch_server` runs it before it parses
its command line. With Galahad installed, `--hicache-storage-backend galahad` then works with no
code. `SGLANG_PLUGINS` (a comma-separated allow list) can leave it out; `dynamic` needs neither.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BACKEND_NAME", "CLASS_NAME", "MODULE_PATH", "register_sglang_backend", "sglang_plugin"]

log = logging.getLogger(__name__)

BACKEND_NAME = "galahad"
MODULE_PATH = "galahad_vllm.sglang_backend"
CLASS_NAME = "GalahadHiCacheStorage"


def register_sglang_backend() -> None:
    """Register `galahad` with SGLang's storage backend factory and its command line, in this
    process (idempotent)."""
    if _register_with_factory():
        log.info("[galahad] registered SGLang storage backend %r (%s.%s)", BACKEND_NAME, MODULE_PATH, CLASS_NAME)
    _allow_on_command_line()


def sglang_plugin() -> None:
    """SGLang's general plugin hook (entry point `sglang.srt.plugins`): the same registration, in
    every SGLang process, quietly; a failure is one warning, never an error for SGLang."""
    try:
        _register_with_factory()
        _allow_on_command_line()
    except Exception as exc:  # noqa: BLE001 - a plugin must not stop SGLang; `dynamic` still works
        log.warning("[galahad] cannot register the SGLang storage backend %r (%s: %s); use "
                    "--hicache-storage-backend dynamic (docs/sglang.md)", BACKEND_NAME, type(exc).__name__, exc)


def _allow_on_command_line() -> None:
    """Add `galahad` to the `choices` of `--hicache-storage-backend`: SGLang builds its parser
    from the `Arg` in `ServerArgs`'s annotations, so the name goes into that `Arg`'s list."""
    import typing

    from sglang.srt.server_args import ServerArgs

    hint = typing.get_type_hints(ServerArgs, include_extras=True).get("hicache_storage_backend")
    for meta in getattr(hint, "__metadata__", ()):
        choices = getattr(meta, "choices", None)
        if isinstance(choices, list) and BACKEND_NAME not in choices:
            choices.append(BACKEND_NAME)


def _register_with_factory() -> bool:
    """The name in the factory and the factory taught to build it; whether anything changed."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    changed = False
    if BACKEND_NAME not in StorageBackendFactory._registry:  # noqa: SLF001 - avoid SGLang's overwrite warning
        StorageBackendFactory.register_backend(BACKEND_NAME, MODULE_PATH, CLASS_NAME)
        changed = True
    current = StorageBackendFactory.__dict__["_create_builtin_backend"]
    if getattr(current.__func__, "_galahad", False):
        return changed
    builtin = current.__func__

    def create(cls: Any, backend_name: str, backend_class: Any, storage_config: Any, mem_pool_host: Any) -> Any:
        if backend_name == BACKEND_NAME:
            return backend_class(storage_config, {})
        return builtin(cls, backend_name, backend_class, storage_config, mem_pool_host)

    create._galahad = True  # type: ignore[attr-defined]
    StorageBackendFactory._create_builtin_backend = classmethod(create)  # type: ignore[method-assign]
    return True
