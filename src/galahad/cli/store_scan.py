"""The store as `galahad-format verify` and `stats` see it: every file of a store folder sorted
by role (parts and commit markers by entry, quarantined, temporary, misplaced), read by name and
never changed (layout: `galahad.adapters.fs.layout`)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import attrs

from galahad.adapters.fs import layout
from galahad.adapters.fs import marker as fs_marker
from galahad.adapters.fs import root as fs_root
from galahad.adapters.posix.regular_file import NotARegularFile, read_regular
from galahad.cli.examine import PROG, UsageProblem, file_kind
from galahad.domain.error import StoreUnavailable

__all__ = ["Entry", "Problem", "StoreScan", "commit_problem", "scan_store"]

_GONE = (errno.ENOENT, errno.ENOTDIR)  # a file or folder removed since it was listed


@attrs.define
class Entry:
    """One entry's files in a leaf folder: its part files and its commit marker, if any."""

    namespace: bytes
    key: bytes
    parts: dict[int, Path] = attrs.Factory(dict)
    marker: Path | None = None


Problem = tuple[str, str, str]  # (file, what is wrong, the class of problem: docs/format.md "What the errors mean")


@attrs.define
class StoreScan:
    """Every file of a store folder, sorted by role, and what kept some from being looked at.
    Reads names (and the manifest), changes nothing."""

    entries: dict[tuple[bytes, bytes], Entry] = attrs.Factory(dict)
    namespaces: dict[bytes, Path] = attrs.Factory(dict)
    quarantined: list[Path] = attrs.Factory(list)
    temp: list[Path] = attrs.Factory(list)
    misplaced: list[tuple[Path, str]] = attrs.Factory(list)
    problems: list[Problem] = attrs.Factory(list)  # an unusable manifest, folders that cannot be read

    def parts(self) -> list[tuple[Path, Entry, int]]:
        return [(path, e, part) for e in self.entries.values() for part, path in sorted(e.parts.items())]


def scan_store(root: Path) -> StoreScan:
    """Sort the files of the store at `root`; UsageProblem for a root the server would refuse
    for its permissions, one that cannot be read, or one that is no store."""
    names = _list_root(root)
    scan = StoreScan()
    for name in names:
        ns_hex = layout.parse_namespace_dir(name)
        if ns_hex is not None and (root / name).is_dir():
            scan.namespaces[bytes.fromhex(ns_hex)] = root / name
    _check_root(root, scan)
    for namespace, folder in scan.namespaces.items():
        for path in sorted(_files(folder, scan.problems)):
            _sort_file(scan, folder, namespace, path)
    return scan


def _list_root(root: Path) -> list[str]:
    if not root.exists():
        raise UsageProblem(f"{root}: no such folder")
    if not root.is_dir():
        raise UsageProblem(f"{root}: not a folder (give the store folder, GALAHAD_CACHE_DIR)")
    try:
        return sorted(os.listdir(root))
    except OSError as exc:
        raise UsageProblem(f"{root}: cannot read the store folder ({exc.strerror}); run {PROG} as its owner "
                           f"(uid {root.stat().st_uid}), or fix its mode: chmod 700 {root}") from None


def _check_root(root: Path, scan: StoreScan) -> None:
    """Refuse what the server refuses, in its words: a root others can write to (a usage problem,
    as is a manifest this user cannot read); a manifest it cannot use is a problem of the store.
    A root with namespace folders and no manifest is read as it is."""
    path = os.path.abspath(root)
    try:
        fs_root._check_folder(path, owner=False)  # the server's own check: tools accept another owner
    except StoreUnavailable as exc:
        raise UsageProblem(str(exc.strerror)) from None
    manifest = root / layout.MANIFEST_NAME
    try:
        mode: int | None = os.stat(manifest).st_mode  # a link followed, as the server does
    except OSError:
        mode = None  # absent, or StoreRoot.open says why not
    if mode is not None and not stat.S_ISREG(mode):  # the server's open would wait on a FIFO for ever
        scan.problems.append((str(manifest), f"not a regular file ({file_kind(mode)})", "NotAFile"))
        return
    try:
        fs_root.StoreRoot.open(path)
    except StoreUnavailable as exc:
        if exc.errno == errno.ENOENT and scan.namespaces:
            return
        if exc.errno == errno.ENOENT:
            raise UsageProblem(f"{root}: not a Galahad store (no {layout.MANIFEST_NAME} and no ns-<digest> folders)")
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UsageProblem(str(exc.strerror)) from None
        scan.problems.append((str(manifest), str(exc.strerror), "StoreUnavailable"))


def _files(folder: Path, problems: list[Problem]) -> Iterator[Path]:
    """The files under `folder`; each sub-folder that cannot be read is added to `problems`."""
    def unreadable(exc: OSError) -> None:
        if exc.errno not in _GONE:  # a folder removed meanwhile is no problem
            problems.append((str(exc.filename), f"cannot read the folder ({exc.strerror}): the files in it were "
                             "not checked; run as the store's owner", "OSError"))

    for base, _dirs, names in os.walk(folder, onerror=unreadable):
        for name in names:
            yield Path(base) / name


def _sort_file(scan: StoreScan, folder: Path, namespace: bytes, path: Path) -> None:
    relative = path.relative_to(folder).parts
    parsed = layout.parse_name(path.name)
    if relative[0] == layout.QUARANTINE_DIR:
        scan.quarantined.append(path)
    elif path.name.startswith(layout.TEMP_PREFIX):
        scan.temp.append(path)
    elif relative == (layout.NAMESPACE_FILE,):
        pass
    elif parsed is None:
        scan.misplaced.append((path, "not a file of a Galahad store"))
    elif relative[:-1] != (parsed[0][0:2], parsed[0][2:4]):
        scan.misplaced.append((path, f"outside its folder {parsed[0][0:2]}/{parsed[0][2:4]}/"))
    else:
        key = bytes.fromhex(parsed[0])
        entry = scan.entries.setdefault((namespace, key), Entry(namespace, key))
        if parsed[1] is None:
            entry.marker = path
        else:
            entry.parts[parsed[1]] = path


def commit_problem(entry: Entry) -> tuple[str, str] | None:
    """Why a committed entry is not whole, with the class of problem: its marker is unreadable or
    not one Galahad writes, or lists parts absent or of another size; None if whole or gone."""
    if entry.marker is None:
        return None
    try:
        sizes = fs_marker.decode(read_regular(str(entry.marker), fs_marker.MAX_BYTES, follow_links=False))
    except NotARegularFile as exc:  # the store's own reader: no link followed, no FIFO waited on
        return f"commit marker is not a regular file ({exc.kind})", "NotAFile"
    except OSError as exc:
        return None if exc.errno in _GONE else (f"commit marker unreadable ({exc.strerror})", "OSError")
    if sizes is None:
        return "commit marker is not one Galahad writes", "IncompleteEntry"
    for part, size in sorted(sizes.items()):
        path = entry.parts.get(part)
        if path is None:
            return f"committed, but part {part} is missing", "IncompleteEntry"
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone meanwhile (evicted or quarantined), or unreadable: said by its own line
        if stat.S_ISREG(st.st_mode) and st.st_size != size:
            return f"committed, but part {part} is {st.st_size} bytes, the marker says {size}", "IncompleteEntry"
    return None
