"""Folders only their owner can enter, and names made durable in them.

The store's folder and the key file's folder are made here, with any missing parents, each 0700
whatever the umask: a parent made 0755 would let every user list what lies in it. The store and
key adapters both make them; they may not import each other.
"""

from __future__ import annotations

import os

__all__ = ["fsync_folder", "make_private_folders"]


def make_private_folders(path: str) -> None:
    """Create the missing folders of `path`, each 0700 whatever the umask. Folders that exist are
    left as they are. The `OSError` of the call when one cannot be made (a file in the way:
    `NotADirectoryError` from the next level)."""
    missing: list[str] = []
    here = os.path.abspath(path)
    while not os.path.lexists(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(folder, 0o700)


def fsync_folder(path: str) -> None:
    """Make the names created or removed in the folder `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
