"""The licence port."""

from __future__ import annotations

import datetime as dt
from typing import Protocol

from galahad.domain.licence import LicenceStatus

__all__ = ["Licence"]


class Licence(Protocol):
    """Whether caching is allowed for a deployment of `ranks` GPU ranks (tensor x pipeline x data parallel).

    Contract: `check` never raises; it returns a `LicenceStatus` that is valid, or refused with
    its reason (missing, unreadable, bad signature, unknown issuer, expired, too few points).
    """

    def check(self, ranks: int, now: dt.datetime | None = None) -> LicenceStatus: ...
