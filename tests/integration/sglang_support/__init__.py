"""Helpers for the SGLang tests: import SGLang's real classes on a CPU machine.

SGLang 0.5.23 is installed with `--no-deps` (its wheel pins CUDA torch 2.14.1); its storage
classes, factory and controller import with the CPU torch 2.13.0 of this environment. Its host
pools import `torchvision` through a multimodal module; PyPI's torchvision is a CUDA build that
breaks with CPU torch, so where torchvision is absent we put an inert stand-in in `sys.modules`
(after telling `transformers` it is absent, so that nothing else starts using it). Nothing of
ours ever runs on that stand-in: it only lets SGLang's module graph load.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import pytest

__all__ = ["load_sglang"]

_TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                "torchvision.transforms.v2", "torchvision.transforms.v2.functional", "torchvision.io",
                "torchvision.ops")


class _Inert:
    """Any attribute, any call: an inert object (for import-time uses such as `T.InterpolationMode`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def _module_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert()


def _stub_torchvision() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    try:  # settle transformers' cached "is torchvision available" answers to False first
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        import_utils.is_torchvision_greater_or_equal("0.27")
    except Exception:  # noqa: BLE001 - no transformers: nothing to settle
        pass
    for name in _TORCHVISION:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__getattr__ = _module_getattr  # type: ignore[method-assign]
        sys.modules[name] = module


def load_sglang() -> types.ModuleType:
    """SGLang's storage module, or skip the test when SGLang is not installed.

    Installed but not importable (a dependency missing) is an error, not a skip: CI must not go
    green by skipping every SGLang test.
    """
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (see docs/sglang.md, Testing without a GPU)")
    _stub_torchvision()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Only CUDA ... support AWQ/GGUF" on CPU
        from sglang.srt.mem_cache import hicache_storage
        from sglang.srt.mem_cache.pool_host import mha, mla  # noqa: F401 - the full module graph
    return hicache_storage
