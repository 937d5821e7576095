"""Test licences: an issuer key pair and signed licence files, made locally with the library."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

__all__ = ["make_licence"]


def make_licence(folder: str | os.PathLike[str], *, points: int = 1, days: int = 30,
                 issued: dt.date | None = None, name: str = "licence.lic") -> tuple[str, str]:
    """Write an issuer key pair (once per folder) and a licence; returns (licence, issuer public key)."""
    from galahad.adapters.licence.issuer import generate_issuer, issue_licence, load_issuer_key

    where = Path(folder)
    where.mkdir(parents=True, exist_ok=True)
    if not (where / "issuer.key").exists():
        generate_issuer(where)
    key = load_issuer_key(where / "issuer.key")
    lic = where / name
    lic.write_bytes(issue_licence(key, "galahad tests", points, issued or dt.date.today(), days).encode())
    return str(lic), str(where / "issuer.pub")
