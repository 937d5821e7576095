"""The folders below a store root, reached only through descriptors of folders the store trusts.

The root (`GALAHAD_CACHE_DIR`) is the operator's choice: it may be a symbolic link, and root.py
checks it at open. Everything below it is untrusted: anyone who can write into the store folder
can put a symbolic link, a FIFO or someone else's folder where a namespace, fanout, leaf or
quarantine folder should be. So each folder below the root is opened relative to its parent's
descriptor with `O_DIRECTORY | O_NOFOLLOW` and checked with `fstat`; one that is a symbolic link,
not a folder, owned by another user, or writable by group or others is *refused*: logged once,
naming the folder and the fix, and treated as absent. Nothing under a refused folder is read,
written, renamed or removed, so a planted link can cause misses and nothing more. Files are then
named relative to the trusted descriptor (`dir_fd=`), never by a path through the folders.

Descriptors of the folders used most recently (leaves, namespaces, quarantine folders) are kept
open, a bounded number (`FolderTree.borrow`); a thread borrows one and gives it back, and one
dropped from the cache meanwhile is closed only when its last borrower gives it back. A kept
descriptor can outlive its folder (removed, or moved away, while the server runs): `find` looks
a name up by its path when the descriptor says it is absent, and `borrow(fresh=True)` compares
the descriptor with what the folder's path names now; both open the chain again when they
differ. A name absent by its path is absent, whatever the folders on the way are: a miss is
always safe, and a lookup that misses costs one `lstat`, as it always did.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import resource
import stat
import threading
from collections.abc import Callable, Generator

from galahad.adapters.fs.medium import ABSENT, unavailable
from galahad.domain.error import StoreUnavailable

__all__ = ["FOLDER_FLAGS", "Folder", "FolderTree", "RefusedFolder", "names_in"]

_log = logging.getLogger(__name__)

FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the root may be a link: followed
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
_WARNED_MAX = 64  # folders a store names in a warning; past that, refusals are logged at DEBUG


class RefusedFolder(StoreUnavailable):
    """A folder below the store root that the store does not trust (a symbolic link, not a folder,
    another user's, or writable by group or others): nothing is written under it. Raised where
    something had to be written there (a put); the message names the folder and the fix, which
    was also logged once. The save is skipped and counted; reads there are misses."""


class Folder:
    """A trusted folder's open descriptor, borrowed from a `FolderTree` (give it back)."""

    __slots__ = ("fd", "path", "ident", "users", "dropped")

    def __init__(self, fd: int, path: str, ident: tuple[int, int]) -> None:
        self.fd = fd
        self.path = path  # for messages, and to tell whether the descriptor is still the folder there
        self.ident = ident  # (st_dev, st_ino) when opened
        self.users = 0
        self.dropped = False


def names_in(fd: int) -> list[str]:
    """The names in the folder open at `fd`, read through a descriptor of its own: a listing moves
    the offset of the descriptor it reads, which other threads may be listing through too."""
    own = os.open(".", _ROOT_FLAGS, dir_fd=fd)
    try:
        return os.listdir(own)
    finally:
        os.close(own)


def _problem(st: os.stat_result, euid: int) -> tuple[str, str] | None:
    """(what is wrong, the fix's command shape) of a folder's `fstat`, or None when it is trusted."""
    if not stat.S_ISDIR(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a folder")
        return f"{kind}, not a folder", "remove it (rm {path}); the store makes the folder again"
    if st.st_uid != euid:
        return (f"owned by uid {st.st_uid}, not by this process's user (uid {euid})",
                f"chown -R {euid} {{path}} && chmod 700 {{path}}, or remove it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o})", "chmod 700 {path}"
    return None


def _make(parent_fd: int, name: str, path: str) -> None:
    """Create the folder `name` (0700) in the folder open at `parent_fd`, its name made durable."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        return  # another thread or process made it meanwhile (or planted something: the open says)
    except OSError as exc:
        raise unavailable("create the folder", path, exc) from exc
    try:
        os.fsync(parent_fd)
    except OSError as exc:
        raise unavailable("create the folder", path, exc) from exc


def _what_is(parent_fd: int, name: str) -> tuple[str, str]:
    """What is at `name` where a folder was expected and could not be opened as one, and the fix."""
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        return "a symbolic link", "remove the link (rm {path}); the store makes the folder again"
    kind = next((what for test, what in _KINDS if test(mode)), "something else")
    return f"{kind}, not a folder", "remove it (rm {path}); the store makes the folder again"


class FolderTree:
    """The trusted folders below one store root, by their path relative to it ("ns-<hex>/ab/cd").

    `borrow` gives a kept descriptor (opening, and with `create` making, the chain of folders
    when needed); `find` looks a name up; `walk` and `open_uncached` serve scans, which touch
    every folder once and would only churn the kept ones.
    """

    def __init__(self, root: str, *, keep: int | None = None, on_root: Callable[[int | None], None] | None = None) -> None:
        self.root = root
        self._on_root = on_root  # the root's st_dev at each open of it (None: absent); may raise
        self._euid = os.geteuid()
        if keep is None:  # a bounded share of the descriptors this process may open
            keep = max(16, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 16))
        self._keep = keep
        self._kept: collections.OrderedDict[str, Folder] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._warned: set[str] = set()  # folders named in a refusal's warning

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    # -- kept descriptors --------------------------------------------------------------------

    def borrow(self, rel: str, *, create: bool = False, fresh: bool = False) -> Folder | None:
        """The trusted folder `rel` (give it back), or None when it is absent (and not `create`)
        or refused (logged once). With `create`, missing folders are made (0700) and a refused
        one raises `RefusedFolder`. With `fresh`, a kept descriptor is checked against the folder
        its path names now (one `lstat`), and the chain opened again when they differ."""
        folder = self._kept_one(rel)
        if folder is not None and fresh and rel and not self._still_there(folder):
            self.give_back(folder)
            self.renew(rel)
            folder = None
        if folder is not None:
            return folder
        try:
            return self._open(rel, create, fresh)
        except RefusedFolder:
            if create:
                raise
            return None

    def give_back(self, folder: Folder) -> None:
        with self._lock:
            folder.users -= 1
            if folder.dropped and folder.users == 0:
                os.close(folder.fd)

    def renew(self, rel: str) -> None:
        """Forget the kept descriptors of `rel` and of the folders above it (one may be stale:
        its folder removed or moved away): the next borrow opens the chain again."""
        with self._lock:
            while True:
                folder = self._kept.pop(rel, None)
                if folder is not None:
                    self._drop(folder)
                if not rel:
                    return
                rel = rel.rpartition("/")[0]

    def find(self, rel: str, name: str) -> tuple[Folder, os.stat_result] | None:
        """The trusted folder `rel` (borrowed: give it back) and the `lstat` of `name` in it, or
        None when `name` is not there or a folder on the way is refused.

        Through a kept descriptor, the name is looked up there (one `lstat`). Otherwise, or when
        it is not there (the descriptor may have outlived its folder), it is looked up by its
        path first (one `lstat`, as cheap as a lookup ever was): absent there, it is absent,
        whatever the folders on the way are. Found, it is looked up again through the folder's
        descriptor, opened afresh, and only that answer counts."""
        folder = self._kept_one(rel)
        if folder is not None:
            st = self._lstat_in(folder, name)
            if st is not None:
                return folder, st
            self.give_back(folder)
        path = f"{self.root}/{rel}/{name}"
        try:
            os.lstat(path)
        except OSError as exc:
            if exc.errno in ABSENT:
                return None
            raise unavailable("look up", path, exc) from exc
        if folder is not None:  # absent through the kept descriptor, present by the path
            self.renew(rel)
        for again in (False, True):
            folder = self.borrow(rel)
            if folder is None:
                return None
            st = self._lstat_in(folder, name)
            if st is not None:
                return folder, st
            self.give_back(folder)
            if again:
                return None
            self.renew(rel)  # a kept descriptor above it may have outlived its folder
        return None

    def _lstat_in(self, folder: Folder, name: str) -> os.stat_result | None:
        """The `lstat` of `name` in the borrowed `folder`, None when absent; on another failure
        the folder is given back and `StoreUnavailable` raised."""
        try:
            return os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in ABSENT:
                return None
            self.give_back(folder)
            raise unavailable("look up", f"{folder.path}/{name}", exc) from exc

    def forget(self) -> None:
        """Forget every kept descriptor (the filesystem went away and came back: they may belong
        to a mount that is gone); the next borrow opens each chain again from the root's path."""
        with self._lock:
            while self._kept:
                self._drop(self._kept.popitem(last=False)[1])

    def _kept_one(self, rel: str) -> Folder | None:
        """The kept descriptor of `rel`, borrowed, or None when none is kept."""
        if rel not in self._kept:  # most lookups miss: no lock taken (a dict's `in` is atomic)
            return None
        with self._lock:
            folder = self._kept.get(rel)
            if folder is not None:
                folder.users += 1
                self._kept.move_to_end(rel)
            return folder

    def close(self) -> None:
        """Close the kept descriptors (those still borrowed, when given back)."""
        with self._lock:
            self._closed = True
        self.forget()

    def _still_there(self, folder: Folder) -> bool:
        """Whether the folder's path (below the root: its last name not followed) names the
        folder its descriptor was opened on."""
        try:
            st = os.lstat(folder.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == folder.ident

    def _open(self, rel: str, create: bool, fresh: bool) -> Folder | None:
        """Open the chain down to `rel` (its parent borrowed, so kept too), and keep it."""
        if not rel:
            fd = self._open_root()
            try:
                st = os.fstat(fd)
            except OSError as exc:
                os.close(fd)
                raise unavailable("open the store folder", self.root, exc) from exc
            opened: tuple[int, tuple[int, int]] | None = fd, (st.st_dev, st.st_ino)
        else:
            head, _, name = rel.rpartition("/")
            parent = self.borrow(head, create=create, fresh=fresh)
            if parent is None:
                return None
            try:
                opened = self._open_child(parent.fd, name, self.path(rel), create=create)
            finally:
                self.give_back(parent)
        if opened is None:
            return None
        folder = Folder(opened[0], self.path(rel), opened[1])
        folder.users = 1
        with self._lock:
            known = self._kept.get(rel)
            if known is not None:  # another thread opened it meanwhile: theirs is kept
                known.users += 1
                os.close(folder.fd)
                return known
            if self._closed:
                folder.dropped = True  # the store closed meanwhile: closed when given back
                return folder
            self._kept[rel] = folder
            while len(self._kept) > self._keep:
                self._drop(self._kept.popitem(last=False)[1])
        return folder

    def _drop(self, folder: Folder) -> None:
        """Inside the lock: the folder leaves the cache; closed now, or by its last borrower."""
        folder.dropped = True
        if folder.users == 0:
            os.close(folder.fd)

    # -- scans -------------------------------------------------------------------------------

    def open_uncached(self, rel: str) -> int | None:
        """A descriptor of the trusted folder `rel`, not kept (the caller closes it); None when
        absent or refused (logged once)."""
        fd = self._open_root()
        done = ""
        for name in rel.split("/") if rel else ():
            done = f"{done}/{name}" if done else name
            try:
                opened = self._open_child(fd, name, self.path(done), create=False)
            except RefusedFolder:
                opened = None
            finally:
                os.close(fd)
            if opened is None:
                return None
            fd = opened[0]
        return fd

    def walk(self, rel: str, pattern: re.Pattern[str], depth: int) -> Generator[tuple[str, int], None, None]:
        """(relative path, descriptor) of every trusted folder `depth` levels below `rel` whose
        names on the way match `pattern`, in name order. Each descriptor is open while its item
        is being handled, and closed when the walk moves on (or is closed). A folder that is
        refused or cannot be read is passed by, as an empty one."""
        try:
            top = self.open_uncached(rel)
        except StoreUnavailable:
            return
        if top is None:
            return
        try:
            yield from self._walk(top, rel, pattern, depth)
        finally:
            os.close(top)

    def _walk(self, fd: int, rel: str, pattern: re.Pattern[str], depth: int) -> Generator[tuple[str, int], None, None]:
        if depth == 0:
            yield rel, fd
            return
        try:
            names = sorted(n for n in names_in(fd) if pattern.fullmatch(n))
        except OSError:
            return
        for name in names:
            sub = f"{rel}/{name}" if rel else name
            try:
                opened = self._open_child(fd, name, self.path(sub), create=False)
            except StoreUnavailable:  # refused (logged), or unreadable: nothing to walk there
                continue
            if opened is None:
                continue
            try:
                yield from self._walk(opened[0], sub, pattern, depth - 1)
            finally:
                os.close(opened[0])

    def _open_root(self) -> int:
        """A descriptor of the root, by its path; `on_root` hears which filesystem it is on."""
        try:
            fd = os.open(self.root, _ROOT_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ENOENT and self._on_root is not None:
                self._on_root(None)  # the store's own folder gone: a mount that went away, most likely
            raise unavailable("open the store folder", self.root, exc) from exc
        try:
            dev = os.fstat(fd).st_dev
            if self._on_root is not None:
                self._on_root(dev)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, StoreUnavailable):
                raise
            raise unavailable("open the store folder", self.root, exc) from exc
        return fd

    # -- opening one folder ------------------------------------------------------------------

    def _open_child(self, parent_fd: int, name: str, path: str, *, create: bool) -> tuple[int, tuple[int, int]] | None:
        """(descriptor, (st_dev, st_ino)) of the folder `name` in the folder open at `parent_fd`
        (`path` names it in messages), made 0700 first when absent and `create`; None when absent
        (and not `create`). `RefusedFolder` when something untrusted is there (logged once per
        folder and store); `StoreUnavailable` for other failures."""
        made = False
        while True:
            try:
                fd = os.open(name, FOLDER_FLAGS, dir_fd=parent_fd)
                break
            except OSError as exc:
                if exc.errno == errno.ENOENT and create and not made:
                    _make(parent_fd, name, path)
                    made = True
                    continue
                if exc.errno == errno.ENOENT:
                    return None
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a link, a file, a FIFO: not followed, not opened
                    raise self._refuse(path, *_what_is(parent_fd, name)) from None
                raise unavailable("open the folder", path, exc) from exc
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise unavailable("open the folder", path, exc) from exc
        problem = _problem(st, self._euid)
        if problem is not None:
            os.close(fd)
            raise self._refuse(path, *problem)
        return fd, (st.st_dev, st.st_ino)

    def _refuse(self, path: str, what: str, fix: str) -> RefusedFolder:
        """Log the refusal (once per folder, a bounded number of folders) and return it as an error."""
        fix = fix.replace("{path}", path)
        with self._lock:
            first = path not in self._warned and len(self._warned) < _WARNED_MAX
            if first:
                self._warned.add(path)
        log = _log.warning if first else _log.debug
        log("[galahad] store folder %s is %s: refused, entries under it are treated as absent and nothing is "
            "written there; fix: %s", path, what, fix)
        return RefusedFolder(errno.EPERM, f"store folder {path} is {what}: refused; fix: {fix}")
