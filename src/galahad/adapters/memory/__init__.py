"""The in-memory block store: the reference adapter the others are tested against."""

from galahad.adapters.memory.store import InMemoryBlockStore

__all__ = ["InMemoryBlockStore"]
