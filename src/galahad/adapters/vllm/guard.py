"""The host boundary: no exception from Galahad ever reaches vLLM.

Every connector hook runs inside `boundary`: an exception is logged (with its traceback the
first time per hook, then at DEBUG), counted as `errors`, and the hook returns its degraded
value (a miss, nothing to load, nothing finished).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ErrorCount", "boundary"]

log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])


class ErrorCount:
    """Errors caught at the boundary since the last report (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._seen: set[str] = set()

    def record(self, hook: str) -> bool:
        """Count one error; True the first time `hook` failed."""
        with self._lock:
            self._n += 1
            first = hook not in self._seen
            self._seen.add(hook)
            return first

    def take(self) -> int:
        with self._lock:
            n, self._n = self._n, 0
            return n


def boundary(default: Callable[[], Any]) -> Callable[[_F], _F]:
    """Run the hook; on any exception log once, count, and return `default()`."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - the host boundary
                if self._errors.record(fn.__name__):
                    log.warning("[galahad] %s failed; degrading to no caching for this call",
                                fn.__name__, exc_info=True)
                else:
                    log.debug("[galahad] %s failed again", fn.__name__, exc_info=True)
                return default()

        return hook  # type: ignore[return-value]

    return wrap
