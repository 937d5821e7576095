"""Stores that fail: every call raises, or every call hangs. They wrap the real store."""

from __future__ import annotations

import threading
from typing import Any

from galahad.domain.error import StoreUnavailable

__all__ = ["FailingStore", "HangingStore"]


class FailingStore:
    """Every method raises `error()` (a `StoreUnavailable`, or anything else a broken store throws)."""

    def __init__(self, real: Any, error: type[BaseException] = StoreUnavailable) -> None:
        self._real = real
        self._error = error
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if name == "close":
                return self._real.close()
            raise self._error(f"injected: the medium failed during {name}")

        return fail


class HangingStore:
    """Every method blocks until `release()` (a hung network mount, a stuck disk)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._gate = threading.Event()

    def release(self) -> None:
        self._gate.set()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._real, name)

        def hang(*args: Any, **kwargs: Any) -> Any:
            if name != "close":
                self._gate.wait(60)
            return target(*args, **kwargs)

        return hang
