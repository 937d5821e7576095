"""The failure policy and the quarantine rule."""

from __future__ import annotations

import enum
from collections.abc import Sequence

__all__ = ["FailurePolicy", "usable_prefix"]


class FailurePolicy(enum.Enum):
    """What the engine does with a block that fails to load: recompute it, or fail the request."""

    RECOMPUTE = "recompute"
    FAIL = "fail"


def usable_prefix(ok: Sequence[bool]) -> int:
    """How many leading entries of a chain may be used.

    A failed entry is a miss for itself and every later entry of its chain (their KV depends on
    it), on every rank; the failed one is quarantined so no rank offers it again.
    """
    for index, good in enumerate(ok):
        if not good:
            return index
    return len(ok)
