"""The store's record of keys retired on purpose: `ROOT/galahad-retired-keys`.

A server that cannot open an entry must tell two cases apart. A key retired on purpose (the
Rotation steps in docs/security.md: the old key kept as a retired line, then that line deleted)
will not come back: an entry sealed under it is set aside when its prompt is saved again, and
written anew under the key in use. A key that is merely not here (a wrong `GALAHAD_KEY_FILE`, a
key command answering for another environment, a key setting lost at a restart) may come back:
its entries are kept as they are, and loaded again once the right key is back.

What marks a key as retired on purpose is this record: every server that starts with retired
lines in its keyring adds their ids here, and takes the id of its current key out (a key made
current again is not retired). An operator may add an id by hand (one 16-hex-digit key id a
line, as the startup line and the warning print them) for a key lost for good.

The file holds key ids only, never key material. It is read with `read_regular` (never a FIFO,
never through a link, at most `_MAX_BYTES`), and rewritten atomically (a private temporary file,
fsync, rename, fsync of the folder), only when what it lists changes. Servers starting together
take turns (an exclusive `flock` of the store folder, waited for at most `_LOCK_WAIT_S`), so no
one's ids are lost to another's rewrite; where the filesystem has no such locks it goes unlocked.
A record that is there but cannot be read whole (another user's file, a folder, a link, a FIFO,
over `_MAX_BYTES`) is left as it is, never rewritten from what was not read. Temporary files a
writer killed mid-write left are removed by the next writer after `_STALE_TEMP_S`. A record that
cannot be read or written costs only replacements (entries are then kept, the safe side), never
a start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator

from galahad.private_folder import fsync_folder
from galahad.regular_file import read_regular

__all__ = ["RECORD_NAME", "note_retired_keys"]

log = logging.getLogger(__name__)

RECORD_NAME = "galahad-retired-keys"
_MAX_BYTES = 64 << 10
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_TEMP_PREFIX = f".tmp-{RECORD_NAME}-"
_LOCK_WAIT_S = 5.0  # then the record is updated unlocked: a start never hangs on another's lock
_STALE_TEMP_S = 600  # a temporary file this old was left by a writer that died
_HEADER = b"# key ids retired on purpose: entries sealed under them are replaced (docs/security.md, Rotation)\n"


def note_retired_keys(folder: str, current: bytes | None, retired: Iterable[bytes]) -> frozenset[bytes]:
    """Add `retired` to the record in `folder`, take `current` out, and return the ids it lists.

    `current` is None for a server without a key (it only reads the record)."""
    path = os.path.join(folder, RECORD_NAME)
    mine = frozenset(retired)
    with _locked(folder):
        recorded = _read(path)
        if recorded is None:  # there but not readable whole: left as it is
            return frozenset()
        wanted = (recorded | mine) - ({current} if current is not None else set())
        if wanted != recorded:
            try:
                _write(folder, path, wanted)
            except OSError as exc:
                log.warning("[galahad] cannot update %s (%s): entries sealed under the keys retired now are "
                            "kept, not replaced, when their prompts are saved again", path, exc.strerror or exc)
                wanted = recorded - ({current} if current is not None else set())
        _remove_stale_temps(folder)
    return wanted


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    """An exclusive `flock` of `folder` while the record is read and rewritten, when one can be
    had within `_LOCK_WAIT_S`; otherwise nothing (the update then goes unlocked)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield  # the read and the write say what is wrong with the folder
        return
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("[galahad] %s stayed locked for %.0f s: the record of retired keys is "
                                "updated without the lock", folder, _LOCK_WAIT_S)
                    break
                time.sleep(0.01)
            except OSError:
                break  # no locks on this filesystem
        yield
    finally:
        os.close(fd)  # releases the lock


def _read(path: str) -> frozenset[bytes] | None:
    """The ids the record lists (none when it is absent); None when it is there but cannot be
    read whole."""
    try:
        text = read_regular(path, _MAX_BYTES, follow_links=False)
    except FileNotFoundError:
        return frozenset()
    except OSError as exc:
        log.warning("[galahad] cannot read %s (%s): it is left as it is, and entries sealed under keys "
                    "retired on purpose are kept, not replaced, when their prompts are saved again",
                    path, exc.strerror or exc)
        return None
    if len(text) > _MAX_BYTES:
        log.warning("[galahad] %s is larger than %d bytes: it is left as it is, and entries sealed under "
                    "keys retired on purpose are kept, not replaced, when their prompts are saved again",
                    path, _MAX_BYTES)
        return None
    ids = set()
    for line in text.decode("ascii", "replace").splitlines():
        word = line.split("#", 1)[0].strip().lower()
        if _KEY_ID.fullmatch(word):
            ids.add(bytes.fromhex(word))
        elif word:
            log.warning("[galahad] %s: ignoring %r (a line is one 16-hex-digit key id)", path, word[:40])
    return frozenset(ids)


def _remove_stale_temps(folder: str) -> None:
    """Remove the record's temporary files older than `_STALE_TEMP_S` (a writer killed mid-write)."""
    try:
        names = [name for name in os.listdir(folder) if name.startswith(_TEMP_PREFIX)]
    except OSError:
        return
    for name in names:
        temp = os.path.join(folder, name)
        try:
            if time.time() - os.lstat(temp).st_mtime > _STALE_TEMP_S:
                os.unlink(temp)
        except OSError:
            continue  # gone meanwhile, or not ours to remove


def _write(folder: str, path: str, ids: frozenset[bytes]) -> None:
    body = _HEADER + b"".join(key_id.hex().encode() + b"\n" for key_id in sorted(ids))
    temp = os.path.join(folder, _TEMP_PREFIX + secrets.token_hex(8))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    fsync_folder(folder)
