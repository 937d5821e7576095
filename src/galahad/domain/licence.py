"""The result of a licence check: a value, never an exception."""

from __future__ import annotations

import datetime as dt
import enum

import attrs

__all__ = ["LicenceStatus", "RefusalReason"]


class RefusalReason(enum.Enum):
    MISSING = "missing"
    UNREADABLE = "unreadable"
    BAD_SIGNATURE = "bad signature"
    UNKNOWN_ISSUER = "unknown issuer"
    EXPIRED = "expired"
    TOO_FEW_POINTS = "too few points"
    NO_ISSUER_KEY = "no issuer key"


@attrs.frozen
class LicenceStatus:
    """Valid, or refused with a reason and a human sentence naming the fix."""

    valid: bool
    reason: RefusalReason | None = None
    detail: str = ""
    licensee: str = ""
    points: int = 0
    expires: dt.datetime | None = None

    def describe(self) -> str:
        if self.valid:
            when = self.expires.date().isoformat() if self.expires else "never"
            points = "1 point" if self.points == 1 else f"{self.points} points"
            return f"licence OK: {self.licensee}, {points}, expires {when}"
        reason = self.reason.value if self.reason else "refused"
        return f"licence refused ({reason}): {self.detail}"
