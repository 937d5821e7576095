"""The store's record of keys retired on purpose: `ROOT/galahad-retired-keys`.

A server that cannot open an entry must tell two cases apart. A key retired on purpose (the
Rotation steps in docs/security.md: the old key kept as a retired line, then that line deleted)
will not come back: an entry sealed under it is set aside when its prompt is saved again, and
written anew under the key in use. A key that is merely not here (a wrong `GALAHAD_KEY_FILE`, a
key command answering for another environment, a key setting lost at a restart) may come back:
its entries are kept as they are, and loaded again once the right key is back.

What marks a key as retired on purpose is this record. A server that starts with retired lines
in its keyring notes each as `OLD NEW`: key id OLD retired by the keyring whose current key is
NEW. It takes out the lines whose OLD is its own current key (a key made current again is not
retired). A server replaces entries sealed under OLD only when it holds NEW (current or retired):
a server with a wrong key, or none, holds no key that retired anything, so it never replaces
(even the new key of a two-restart rotation, listed as retired by the old key in between). An
operator may add a line `OLD` alone by hand (one 16-hex-digit key id, as the startup line and the
warning print them) for a key lost for good: every server then replaces its entries.

The file holds key ids only, never key material. It is read with `read_regular` (never a FIFO,
never through a link, at most `_MAX_BYTES`), and rewritten atomically (a private temporary file,
fsync, rename, fsync of the folder), only when what it lists changes. Servers starting together
take turns (an exclusive `flock` of `galahad-retired-keys.lock` beside the record, waited for at
most `_LOCK_WAIT_S`), so no one's ids are lost to another's rewrite. A lock on a file, unlike one
on a folder, is seen by servers on other machines that share the store on a network filesystem
(GlusterFS, NFS); where the filesystem has no such locks the update goes unlocked.
A record that is there but cannot be read whole (another user's file, a folder, a link, a FIFO,
over `_MAX_BYTES`) is left as it is, never rewritten from what was not read. Temporary files a
writer killed mid-write left are removed by the next writer after `_STALE_TEMP_S`. A record that
cannot be read or written costs only replacements (entries are then kept, the safe side), never
a start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable, Iterator

from galahad.adapters.posix.private_folder import fsync_folder
from galahad.adapters.posix.regular_file import read_regular

__all__ = ["LOCK_NAME", "RECORD_NAME", "note_retired_keys"]

log = logging.getLogger(__name__)

RECORD_NAME = "galahad-retired-keys"
LOCK_NAME = f"{RECORD_NAME}.lock"  # empty; only locked
_MAX_BYTES = 64 << 10
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_TEMP_PREFIX = f".tmp-{RECORD_NAME}-"
_LOCK_WAIT_S = 5.0  # with no change to the record, then it is updated unlocked: a start never hangs
_STALE_TEMP_S = 600  # a temporary file this old was left by a writer that died
_HEADER = (b"# keys retired on purpose: a retired key's id, then the id of the key that retired it (none: by\n"
           b"# hand, for a key lost for good). Their entries are replaced (docs/security.md, Rotation)\n")


Line = tuple[bytes, bytes | None]  # (retired key id, the current key id that retired it; None: by hand)


def note_retired_keys(folder: str, current: bytes | None, retired: Iterable[bytes]) -> frozenset[bytes]:
    """Note this keyring's `retired` ids in the record in `folder` (retired by `current`), take
    out the lines retiring `current`, and return the ids whose entries this server may replace:
    retired by a key it holds, or by hand, and not held itself.

    `current` is None for a server without a key (it only reads the record)."""
    path = os.path.join(folder, RECORD_NAME)
    held = frozenset(retired) | ({current} if current is not None else frozenset())
    mine = {(old, current) for old in retired if current is not None and old != current}
    with _locked(folder):
        names = _listing(folder)  # first: the read below then gets the record now in place
        recorded = _read(path)
        if recorded is None:  # there but not readable whole: left as it is
            return frozenset()
        wanted = {line for line in recorded if line[0] != current} | mine
        if wanted != recorded:
            try:
                _write(folder, path, wanted)
            except OSError as exc:
                log.warning("[galahad] cannot update %s (%s): entries sealed under the keys retired now are "
                            "kept, not replaced, when their prompts are saved again", path, exc.strerror or exc)
                wanted = recorded
        _remove_stale_temps(folder, names)
    return frozenset(old for old, by in wanted if (by is None or by in held) and old not in held)


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    """An exclusive `flock` of the lock file in `folder` (made 0600 if absent) while the record
    is read and rewritten. It waits as long as the record keeps changing (other servers taking
    their turns: a fleet starting at once on a network filesystem queues for seconds) and gives
    up after `_LOCK_WAIT_S` without a change, so a start never hangs on a lock left held; the
    update then goes unlocked. Anything but a regular file at the lock's name is not used."""
    try:
        fd = os.open(os.path.join(folder, LOCK_NAME),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError:
        yield  # a read-only store, or a link planted at the name: the read and the write say the rest
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield
            return
        seen = _version(folder)
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = _version(folder)
                if now != seen:  # another server took its turn: wait on
                    seen, deadline = now, time.monotonic() + _LOCK_WAIT_S
                elif time.monotonic() > deadline:
                    log.warning("[galahad] %s stayed locked for %.0f s with no change to the record: the "
                                "record of retired keys is updated without the lock", folder, _LOCK_WAIT_S)
                    break
                time.sleep(0.01)
            except OSError:
                break  # no locks on this filesystem
        yield
    finally:
        os.close(fd)  # releases the lock


def _version(folder: str) -> int | None:
    """What tells one version of the record from the next: each is a new file renamed in place,
    which changes the folder's mtime. The record's own name is not polled: a GlusterFS client
    would then keep its old file cached, and the update under the lock would read that one."""
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return None


def _read(path: str) -> set[Line] | None:
    """The lines the record holds (none when it is absent); None when it is there but cannot be
    read whole."""
    try:
        text = read_regular(path, _MAX_BYTES, follow_links=False)
    except FileNotFoundError:
        return set()
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
    lines: set[Line] = set()
    for raw in text.decode("ascii", "replace").splitlines():
        words = raw.split("#", 1)[0].lower().split()
        if words and len(words) <= 2 and all(_KEY_ID.fullmatch(w) for w in words):
            lines.add((bytes.fromhex(words[0]), bytes.fromhex(words[1]) if len(words) == 2 else None))
        elif words:
            log.warning("[galahad] %s: ignoring %r (a line is a retired key's 16-hex-digit id, then the "
                        "id of the key that retired it, if any)", path, " ".join(words)[:60])
    return lines


def _listing(folder: str) -> list[str]:
    """The names in `folder` (none when it cannot be listed). Listing a folder tells a network
    filesystem's client which file each name holds now: a GlusterFS client answers a name it
    looked up within the last second from its cache, the file the name held then, though another
    node has since renamed a new record over it; read under the lock, that old copy would make
    the update drop the other node's ids."""
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _remove_stale_temps(folder: str, names: list[str]) -> None:
    """Remove the record's temporary files among `names` older than `_STALE_TEMP_S` (a writer
    killed mid-write)."""
    for name in (name for name in names if name.startswith(_TEMP_PREFIX)):
        temp = os.path.join(folder, name)
        try:
            if time.time() - os.lstat(temp).st_mtime > _STALE_TEMP_S:
                os.unlink(temp)
        except OSError:
            continue  # gone meanwhile, or not ours to remove


def _write(folder: str, path: str, lines: set[Line]) -> None:
    body = _HEADER + b"".join(
        (old.hex() if by is None else f"{old.hex()} {by.hex()}").encode() + b"\n"
        for old, by in sorted(lines, key=lambda line: (line[0], line[1] or b"")))
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
        for wait in (0.05, 0.1, 0.2, 0.4, 0.8, None):  # ESTALE: another node replaced the record
            try:  # since this one last saw it (a network filesystem); the name is looked up again
                os.replace(temp, path)
                break
            except OSError as exc:
                if exc.errno != errno.ESTALE or wait is None:
                    raise
                time.sleep(wait)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    fsync_folder(folder)
