"""Reading the small files a licence check needs (the licence, issuer keys) without ever blocking.

A FIFO, a socket or a device where a file is expected would hang a plain `open` (a FIFO waits for
a writer) or stream forever (`/dev/zero`): each file is opened with `O_NONBLOCK`, checked with
`fstat` and read only when it is a regular file, and never past a size limit.
"""

from __future__ import annotations

import os
import stat

__all__ = ["NotRegularFile", "read_small_file"]

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO never blocks
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class NotRegularFile(OSError):
    """A path that names a folder, FIFO, socket or device where a file is expected.

    Raised by `read_small_file`; the licence adapter turns it into a refusal naming `path` and
    `kind` ("a FIFO"), so it never crosses the `Licence` port.
    """

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"{os.fspath(path)} is not a regular file ({kind})")
        self.path = os.fspath(path)
        self.kind = kind


def read_small_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit + 1` of them (more means too big).

    `NotRegularFile` for anything else; `OSError` (`FileNotFoundError`, `PermissionError`, ...)
    when it cannot be opened or read; `ValueError` for a path holding a NUL.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        _refuse_if_not_regular(path)  # a socket cannot be opened at all: name what it is
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, _kind(mode))
        chunks: list[bytes] = []
        size = 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _refuse_if_not_regular(path: str | os.PathLike[str]) -> None:
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, _kind(mode))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")
