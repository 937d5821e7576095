"""The commit marker `<keyhex>.ok`: the parts that make the entry and the size of each.

    {"format":"galahad-commit","version":1,"parts":{"0":1048576,"1":1048576}}

An entry is committed while its marker parses and every part it lists is present with that size.
"""

from __future__ import annotations

import json

__all__ = ["MAX_BYTES", "decode", "encode"]

_FORMAT = "galahad-commit"
_VERSION = 1
MAX_BYTES = 1 << 16  # a longer file is not a marker Galahad writes


def encode(sizes: dict[int, int]) -> bytes:
    parts = {str(p): sizes[p] for p in sorted(sizes)}
    return json.dumps({"format": _FORMAT, "version": _VERSION, "parts": parts}, separators=(",", ":")).encode()


def decode(raw: bytes) -> dict[int, int] | None:
    """Part -> size from a marker's bytes, or None when they are not a marker we read."""
    if len(raw) > MAX_BYTES:
        return None
    try:
        doc = json.loads(raw)
        if doc["format"] != _FORMAT or doc["version"] != _VERSION or not doc["parts"]:
            return None
        sizes = {int(p): s for p, s in doc["parts"].items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not all(isinstance(s, int) and s >= 0 and p >= 0 for p, s in sizes.items()):
        return None
    return sizes
