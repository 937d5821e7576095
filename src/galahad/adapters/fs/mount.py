"""Which filesystem a path lives on, from /proc/self/mountinfo: network or FUSE, and shared.

`os.statvfs` does not report the filesystem type, so we read the mount table: the mount whose
mount point is the longest prefix of the (resolved) path wins; of several mounts on the same
point, the last one listed (the one on top).
"""

from __future__ import annotations

import logging
import os
import re
import threading

import attrs

__all__ = ["Mount", "filesystem_of", "is_remote", "is_shared", "mount_of", "parse_mountinfo", "warn_if_remote"]

_log = logging.getLogger(__name__)

_MOUNTINFO = "/proc/self/mountinfo"
_REMOTE = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "ncpfs", "ceph", "glusterfs",
        "9p", "lustre", "gpfs", "beegfs", "afs", "orangefs", "pvfs2", "davfs", "fuse", "fuseblk",
    }
)  # fmt: skip
_SHARED = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "ncpfs", "ceph", "glusterfs", "lustre", "gpfs",
        "beegfs", "afs", "orangefs", "pvfs2", "juicefs", "cephfs", "ceph-fuse",
    }
)  # fmt: skip  (a FUSE client of one of these mounts as fuse.<name>: fuse.glusterfs, fuse.juicefs...)
_ESCAPE = re.compile(r"\\([0-7]{3})")

_warned: set[str] = set()
_warned_lock = threading.Lock()


@attrs.frozen
class Mount:
    """One line of the mount table: where it is mounted, its filesystem type and its source."""

    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a /proc/<pid>/mountinfo text; lines that do not parse are skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            dash = fields.index("-", 6)
            mounts.append(Mount(_unescape(fields[4]), fields[dash + 1], _unescape(fields[dash + 2])))
        except (ValueError, IndexError):
            continue
    return mounts


def filesystem_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding `path` (an absolute, resolved path), or None if no mount covers it."""
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point.rstrip("/")
        if path == point or path.startswith(point + "/"):
            if best is None or len(point) >= len(best.mount_point.rstrip("/")):
                best = mount
    return best


def is_remote(fstype: str) -> bool:
    """Whether loads from this filesystem type go over a network or through FUSE."""
    return fstype in _REMOTE or fstype.startswith("fuse.")


def is_shared(fstype: str) -> bool:
    """Whether this filesystem type is one that several machines mount at once (a distributed or
    network filesystem), so that servers on other nodes may share a store on it."""
    return fstype in _SHARED or (fstype.startswith("fuse.") and fstype[5:] in _SHARED)


def mount_of(path: str, mountinfo: str | None = None) -> Mount | None:
    """The mount holding `path` (resolved), from `mountinfo` or this process's mount table; None
    when unknown (a mount table that cannot be read). Never raises."""
    if mountinfo is None:
        try:
            with open(_MOUNTINFO, encoding="utf-8", errors="replace") as handle:
                mountinfo = handle.read()
        except OSError:
            return None
    return filesystem_of(os.path.realpath(path), parse_mountinfo(mountinfo))


def warn_if_remote(path: str, mountinfo: str | None = None) -> str | None:
    """Log one line (once per path per process) if `path` is on network or FUSE storage: a shared
    network filesystem is named as one (servers on other nodes share the store), any other remote
    or FUSE storage is named as slow.

    Returns the remote filesystem type, or None when local or unknown. Never raises: a mount
    table that cannot be read means "unknown".
    """
    real = os.path.realpath(path)
    mount = mount_of(real, mountinfo)
    if mount is None or not is_remote(mount.fstype):
        return None
    with _warned_lock:
        first = real not in _warned
        _warned.add(real)
    if first and is_shared(mount.fstype):
        _log.warning(
            "[galahad] store %s is on %s, a shared network filesystem: servers that mount it with the same "
            "GALAHAD_CACHE_DIR share its entries; loads are slower than from a local disk "
            "(docs/store.md, A store shared by several servers)",
            real,
            mount.fstype,
        )
    elif first:
        _log.warning(
            "[galahad] store %s is on %s (network/FUSE storage): loads will be slow; use a local disk",
            real,
            mount.fstype,
        )
    return mount.fstype
