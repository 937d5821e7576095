"""The folders of a store: creating them durably, listing them, and looking files up in them.

Lookups (`file_size`, `listdir`, `part_names`) answer "absent" (None, an empty list) for a name
that is not there and raise `StoreUnavailable` for anything else; `make_dirs` and `unlink` raise
the `OSError` for their caller to translate with the path and action it knows.
"""

from __future__ import annotations

import os
import re
import stat

from galahad.adapters.fs.layout import parse_name, part_prefix
from galahad.adapters.fs.medium import ABSENT, unavailable
from galahad.private_folder import fsync_folder

__all__ = ["file_size", "listdir", "make_dirs", "part_names", "unlink"]



def make_dirs(path: str) -> None:
    """Create `path` and missing parents (0700), fsyncing each new name into its parent."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        make_dirs(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    fsync_folder(parent)


def unlink(path: str) -> bool:
    """Remove a file; False if it was not there (other failures raise)."""
    try:
        os.unlink(path)
        return True
    except OSError as exc:
        if exc.errno in ABSENT:
            return False
        raise


def file_size(path: str) -> int | None:
    """The size of a regular file, or None if there is none at `path`."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        if exc.errno in ABSENT:
            return None
        raise unavailable("look up", path, exc) from exc
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def listdir(path: str, pattern: re.Pattern[str] | None = None) -> list[str]:
    try:
        names = os.listdir(path)
    except OSError as exc:
        if exc.errno in ABSENT:
            return []
        raise unavailable("list", path, exc) from exc
    return sorted(n for n in names if pattern is None or pattern.fullmatch(n))


def part_names(leaf: str, keyhex: str) -> list[str]:
    prefix = part_prefix(keyhex)
    return [n for n in listdir(leaf) if n.startswith(prefix) and parse_name(n) is not None]
