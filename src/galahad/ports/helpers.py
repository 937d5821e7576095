"""The port to helper processes: parts read and verified, or sealed and written, outside the
engine process's lock.

The use cases hand a part's descriptor to a `PartHelpers` (the adapter `adapters/helpers`
runs them as processes) and get back the verified part, as the codec in their own process would
give it, or to a `PartWriters` and get the part sealed and written into it, the bytes the codec
in their own process would write; `HelperRecipe` tells a helper how to build the same ciphers. A
helper that is lost raises `HelperLost` (galahad.domain.error), and the caller reads or seals the
part itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from galahad.ports.cipher import Cipher

__all__ = ["HelperRecipe", "PartHelpers", "PartWriters"]


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


@runtime_checkable
class PartWriters(Protocol):
    """Helpers sealing parts from a shared region and placing them:
    `seal_and_place(dir_fd, name, tick_ns, size, header, offset, sizes)` seals the part whose
    encoded header (cipher and key ids set, salt not yet drawn) is `header` and whose segments of
    `sizes` bytes lie one after another in the region from `offset` on, as
    `format.codec.seal_part` does with the cipher those ids name, writes it as the file `name` of
    the folder open on `dir_fd` (atomically and durably, stamped with `tick_ns`, only if it is
    `size` bytes) and returns whether it took the name (False: taken meanwhile); it raises the
    same errors as sealing, `OSError` where the disk or the folder refused a step. `running` is
    False once the helpers are off. What a `PlacesParts` store's `place` calls."""

    @property
    def running(self) -> bool: ...

    def seal_and_place(self, dir_fd: int, name: str, tick_ns: int, size: int, header: bytes, offset: int,
                       sizes: Sequence[int]) -> bool: ...

    def close(self) -> None: ...
