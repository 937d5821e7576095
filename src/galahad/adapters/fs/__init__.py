"""The filesystem block store: crash-consistent, multi-process, size-capped (docs/store.md)."""

from galahad.adapters.fs.root import StoreRoot
from galahad.adapters.fs.store import FilesystemBlockStore

__all__ = ["FilesystemBlockStore", "StoreRoot"]
