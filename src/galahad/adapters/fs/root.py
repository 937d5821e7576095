"""The store root: its manifest, its permissions, its namespaces, and where it lives.

`StoreRoot.open(path)` is the read-only view tools use (it writes nothing and accepts a root
owned by another user, as long as nobody else can write to it); `FilesystemBlockStore` opens
it `writable`, which creates the folder and manifest when absent and refuses a folder owned
by another user. The root itself may be a symbolic link (the operator's choice); the folders
below it are reached through tree.py, which refuses links and folders it cannot trust.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import stat
from typing import Any

import attrs

from galahad.adapters.fs.folder import read_small
from galahad.adapters.fs.index import CLOCK
from galahad.adapters.fs.layout import (
    MANIFEST_NAME,
    NAMESPACE_FILE,
    namespace_dir,
    namespace_name,
    parse_namespace_dir,
)
from galahad.adapters.fs.medium import unavailable, write_file
from galahad.adapters.fs.mount import is_shared, warn_if_remote
from galahad.adapters.fs.tree import FOLDER_FLAGS, FolderTree, RefusedFolder
from galahad.domain.error import StoreUnavailable
from galahad.adapters.posix.private_folder import fsync_folder, make_private_folders
from galahad.adapters.posix.regular_file import NotARegularFile, read_regular

__all__ = ["StoreRoot", "ensure_namespace"]

_log = logging.getLogger(__name__)

_FORMAT = "galahad-store"
_VERSION = 1
_NS_FORMAT = "galahad-namespace"
_DEFAULT_SHARE = 0.8  # of the free space at first start, when no max_bytes is given


@attrs.frozen
class StoreRoot:
    """An opened store root: its folder, its size cap and when it was created (ISO 8601, UTC).

    `remote_fstype` names the filesystem when it is network or FUSE storage (a warning was
    logged), else None; `shared` says whether it is a filesystem several machines mount at once.
    """

    path: str
    max_bytes: int
    created: str
    remote_fstype: str | None = None

    @property
    def shared(self) -> bool:
        return self.remote_fstype is not None and is_shared(self.remote_fstype)

    def recorded_cap(self) -> int | None:
        """The cap the manifest records now (a server sharing the store may have changed it);
        None when it cannot be read."""
        try:
            manifest = _read_manifest(self.path)
        except StoreUnavailable:
            return None
        return None if manifest is None else int(manifest["max_bytes"])

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, writable: bool = False, max_bytes: int | None = None) -> StoreRoot:
        """Open the store root at `path`; `StoreUnavailable` says why it cannot be used.

        With `writable`: create the folder (0700) and manifest (0600) when absent, recording
        `max_bytes` (default: 80% of the free space now); an explicit `max_bytes` that differs
        from the manifest's replaces it. The root must then be owned by this process's user.
        """
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        root = os.path.abspath(os.fspath(path))
        if writable:
            _make_folder(root)
        _check_folder(root, owner=writable)
        manifest = _read_manifest(root)
        if manifest is None:
            if not writable:
                raise StoreUnavailable(errno.ENOENT, f"{root} is not a Galahad store (it has no {MANIFEST_NAME})")
            manifest = _create_manifest(root, max_bytes)
        elif writable and max_bytes is not None and manifest["max_bytes"] != max_bytes:
            manifest = {**manifest, "max_bytes": max_bytes}
            try:
                _write_in_root(root, MANIFEST_NAME, _dump(manifest), replace=True)
            except StoreUnavailable as exc:  # a read-only store still serves reads, under the new cap
                _log.warning("[galahad] could not record max_bytes=%d in the store manifest: %s", max_bytes, exc)
        return cls(root, manifest["max_bytes"], manifest["created"], warn_if_remote(root))

    def namespaces(self) -> dict[str, str]:
        """Namespace digest hex -> its folder, for every namespace folder in the root."""
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            raise unavailable("list", self.path, exc) from exc
        found = {(digest, name) for name in names if (digest := parse_namespace_dir(name))}
        return {digest: os.path.join(self.path, name) for digest, name in sorted(found)}

    def namespace_info(self, digest_hex: str) -> dict[str, Any] | None:
        """The namespace (as `Namespace.as_dict()` gave it) stored in a namespace folder, or None
        when its namespace.json is missing, unreadable or does not match the folder's digest, or
        the namespace folder is a symbolic link or not a folder (never followed)."""
        folder = namespace_dir(self.path, digest_hex)
        try:
            root_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                ns_fd = os.open(namespace_name(digest_hex), FOLDER_FLAGS, dir_fd=root_fd)
            finally:
                os.close(root_fd)
            try:
                raw = read_small(NAMESPACE_FILE, ns_fd, folder, 1 << 20)[0]
            finally:
                os.close(ns_fd)
            doc = json.loads(raw)
            if doc.get("format") != _NS_FORMAT or doc.get("digest") != digest_hex:
                return None
            namespace = doc["namespace"]
            return namespace if isinstance(namespace, dict) else None
        except (OSError, ValueError, KeyError, AttributeError):
            return None

    def other_layouts(self, digest_hex: str, namespace: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """(digest hex, namespace) of every other namespace in the root that differs from
        `namespace` (that of `digest_hex`) only in its tensor / pipeline parallel sizes (and so
        in the per-rank shapes of its KV groups): the same model saved by a differently split
        server. Reads each namespace folder's namespace.json once; nothing below them."""
        mine = _without_layout(namespace)
        found = []
        for digest in self.namespaces():
            if digest == digest_hex:
                continue
            info = self.namespace_info(digest)
            if info is not None and _without_layout(info) == mine:
                found.append((digest, info))
        return found


def _without_layout(namespace: dict[str, Any]) -> dict[str, Any]:
    """A namespace less what a split changes: the sizes, and the per-rank shapes of its KV groups
    (heads per rank, layers per stage)."""
    return {k: v for k, v in namespace.items() if k not in ("tp_size", "pp_size", "groups")}


def ensure_namespace(tree: FolderTree, ns_hex: str, canonical_json: bytes | None) -> bool:
    """Make the namespace folder (0700) if absent, with its namespace.json (written if absent
    and `canonical_json` is given: the bytes of `Namespace.canonical_json()`). False when the
    folder is refused (a symbolic link, another user's...: logged once; the store then serves
    misses and saves nothing); `StoreUnavailable` when it cannot be made."""
    rel = namespace_name(ns_hex)
    try:
        folder = tree.borrow(rel, create=True)
    except RefusedFolder:
        return False
    if folder is None:  # not reached: `create` makes it or raises
        return False
    try:
        if canonical_json is not None:
            doc = b'{"format":"%s","version":1,"digest":"%s","namespace":%s}\n' % (
                _NS_FORMAT.encode(),
                ns_hex.encode(),
                canonical_json,
            )
            write_file(folder.fd, folder.path, NAMESPACE_FILE, doc, CLOCK.tick())
    finally:
        tree.give_back(folder)
    return True


def _write_in_root(root: str, name: str, data: bytes, *, replace: bool = False) -> bool:
    """`write_file` of `name` in the root folder (the operator's: a link there is followed)."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise unavailable("open the store folder", root, exc) from exc
    try:
        return write_file(fd, root, name, data, CLOCK.tick(), replace=replace)
    finally:
        os.close(fd)


def _make_folder(path: str) -> None:
    """Create `path` (mode 0700, and any missing parents 0700) and make the new name durable."""
    try:
        make_private_folders(os.path.dirname(path))
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    except OSError as exc:
        raise unavailable("create the folder", path, exc) from exc
    try:
        os.chmod(path, 0o700)  # whatever the umask
        fsync_folder(os.path.dirname(path))
    except OSError as exc:
        raise unavailable("create the folder", path, exc) from exc


def _check_folder(root: str, *, owner: bool) -> None:
    try:
        st = os.stat(root)
    except OSError as exc:
        raise unavailable("open the store folder", root, exc) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise StoreUnavailable(errno.ENOTDIR, f"store path {root} is not a folder")
    if owner and st.st_uid != os.geteuid():
        raise StoreUnavailable(
            errno.EPERM,
            f"store folder {root} is owned by uid {st.st_uid}, not by this process's user (uid {os.geteuid()}); "
            f"fix: chown {os.geteuid()} {root} && chmod 700 {root}, or use a folder of your own",
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoreUnavailable(
            errno.EPERM,
            f"store folder {root} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"fix: chmod 700 {root}",
        )


def _read_manifest(root: str) -> dict[str, Any] | None:
    path = os.path.join(root, MANIFEST_NAME)
    try:
        raw = read_regular(path, 1 << 16, follow_links=False)
    except FileNotFoundError:
        return None
    except NotARegularFile as exc:
        raise StoreUnavailable(
            errno.EINVAL, f"{exc}; move it away or point GALAHAD_CACHE_DIR "
            "at another folder"
        ) from None
    except OSError as exc:
        raise unavailable("read", path, exc) from exc
    try:
        doc = json.loads(raw)
        problem = _manifest_problem(doc)
    except ValueError:
        problem = "it is not JSON"
    if problem:
        raise StoreUnavailable(
            errno.EINVAL,
            f"{path} is not a usable Galahad store manifest ({problem}); "
            f"move it away or point GALAHAD_CACHE_DIR at another folder",
        )
    return dict(doc)


def _manifest_problem(doc: Any) -> str | None:
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        return f'"format" is not "{_FORMAT}"'
    version = doc.get("version")
    if not isinstance(version, int) or version < 1:
        return '"version" is not a positive integer'
    if version > _VERSION:
        return f"version {version} was written by a newer Galahad; this one reads version {_VERSION}"
    cap = doc.get("max_bytes")
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        return '"max_bytes" is not a positive integer'
    if not isinstance(doc.get("created"), str):
        return '"created" is missing'
    return None


def _create_manifest(root: str, max_bytes: int | None) -> dict[str, Any]:
    if max_bytes is None:
        try:
            vfs = os.statvfs(root)
        except OSError as exc:
            raise unavailable("measure the free space of", root, exc) from exc
        max_bytes = max(1, int(vfs.f_bavail * vfs.f_frsize * _DEFAULT_SHARE))
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    doc = {"format": _FORMAT, "version": _VERSION, "max_bytes": max_bytes, "created": created}
    if _write_in_root(root, MANIFEST_NAME, _dump(doc)):
        return doc
    found = _read_manifest(root)  # another process created it first: theirs stands
    if found is None:
        raise StoreUnavailable(errno.EIO, f"{root}/{MANIFEST_NAME} vanished while being created")
    return found


def _dump(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()
