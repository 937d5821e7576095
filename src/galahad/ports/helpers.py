"""The port to helper processes: parts read and verified outside the engine process's lock.

The use cases hand a part's descriptor to a `PartHelpers` (the adapter `adapters/helpers`
runs them as processes) and get back the verified part, as the codec in their own process would
give it; `HelperRecipe` tells a helper how to build the same ciphers. A helper that is lost
raises `HelperLost` (galahad.domain.error), and the caller reads the part itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs

from galahad.ports.cipher import Cipher

__all__ = ["HelperRecipe", "PartHelpers"]


@attrs.frozen
class HelperRecipe:
    """How a helper builds the engine process's cipher lookup: `module.function(*args)`, with
    `args` pickled over the helper's socket (a keyring travels this way, never in argv)."""

    module: str
    function: str
    args: tuple[Any, ...] = ()

    def ciphers(self) -> Callable[[int, bytes], Cipher | None]:
        lookup: Callable[[int, bytes], Cipher | None] = getattr(importlib.import_module(self.module),
                                                                 self.function)(*self.args)
        return lookup


@runtime_checkable
class PartHelpers(Protocol):
    """Helpers reading parts into a shared region: `open_part(fd, size, offset, out, expect)`
    reads the part open on `fd` (`size` bytes) into `out`, the region from `offset` on, verifies
    it as `format.codec.open_part_from` does against `expect`, and returns the same opened part
    (or raises the same errors); `running` is False once the helpers are off."""

    @property
    def running(self) -> bool: ...

    def open_part(self, fd: int, size: int, offset: int, out: memoryview, expect: Any) -> Any: ...

    def close(self) -> None: ...
