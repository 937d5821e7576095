"""Reading the small files Galahad trusts without ever blocking, following only the links it may.

A FIFO, a socket or a device where a file is expected would hang a plain `open` (a FIFO waits
for a writer) or stream forever (`/dev/zero`). Each file is opened with `O_NONBLOCK`, checked
with `fstat` and read only when it is a regular file, never past a size limit. Names inside the
store (its manifest, commit markers, namespace files) are opened with `O_NOFOLLOW`: a link there
was not written by Galahad. Files a user points at (the licence, issuer keys, the key file) may be
links, as mounted secrets are.

The store, licence and key adapters all read through here: they may not import each other.
"""

from __future__ import annotations

import errno
import os
import stat
import time

__all__ = ["NotARegularFile", "read_opened", "read_regular", "read_regular_with_stat"]

_STALE_TRIES = 7
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class NotARegularFile(OSError):
    """`path` names something other than a regular file where one is expected (a folder, FIFO,
    socket, device, or a symbolic link where links are not followed); nothing was read from it.

    `kind` says what it is ("a FIFO"), and is also the error's `strerror`; `str()` is
    "PATH is not a regular file (KIND)". Callers turn it into a refusal naming the fix.
    """

    def __init__(self, path: str | os.PathLike[str], kind: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, kind)
        self.path = os.fspath(path)
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.path} is not a regular file ({self.kind})"


def read_regular(path: str | os.PathLike[str], limit: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file at `path`, at most `limit + 1` of them (more than `limit`
    means it is too big: the caller says so).

    `NotARegularFile` for anything else (with `follow_links=False`, also for a symbolic link);
    the `OSError` of the call when it cannot be opened or read (`FileNotFoundError`,
    `PermissionError`, ...); `ValueError` for a path holding a NUL.
    """
    return read_regular_with_stat(path, limit, follow_links=follow_links)[0]


def read_regular_with_stat(path: str | os.PathLike[str], limit: int, *,
                           follow_links: bool = True) -> tuple[bytes, os.stat_result]:
    """As `read_regular`, with the file's `fstat` (its mode and times, as read).

    A stale handle (ESTALE: another machine sharing the folder on a network filesystem replaced
    the file since this one last looked) is asked again, waiting a little longer each time (up to
    3.2 s in all: a FUSE client such as GlusterFS's keeps a name's old file for a second)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    for attempt in range(_STALE_TRIES):
        if attempt:
            time.sleep(0.025 * 2**attempt)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ESTALE and attempt + 1 < _STALE_TRIES:
                continue
            if exc.errno == errno.ELOOP and not follow_links:
                raise NotARegularFile(path, "a symbolic link", errno.ELOOP) from None
            _refuse_if_not_regular(path, follow_links)  # a socket cannot be opened at all: name it
            raise
        try:
            return read_opened(fd, limit, path)
        except OSError as exc:
            if exc.errno != errno.ESTALE or attempt + 1 == _STALE_TRIES:
                raise
    raise AssertionError("not reached")


def read_opened(fd: int, limit: int, path: str | os.PathLike[str]) -> tuple[bytes, os.stat_result]:
    """As `read_regular_with_stat`, of a file already opened (`O_NONBLOCK`) at `fd`, which it
    closes; `path` names it in a `NotARegularFile`."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(path, _kind(info.st_mode))
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            want = limit + 1 - size
            chunks.append(chunk := os.read(fd, want))
            size += len(chunk)
            if len(chunk) < want:  # the end of the file: a regular file reads short only there
                break
        return b"".join(chunks), info
    finally:
        os.close(fd)


def _refuse_if_not_regular(path: str | os.PathLike[str], follow_links: bool) -> None:
    try:
        mode = (os.stat if follow_links else os.lstat)(path).st_mode
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(mode):
        raise NotARegularFile(path, _kind(mode))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")
