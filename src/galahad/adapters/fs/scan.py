"""Scans of a store root: they fill the index and remove what interrupted writers left behind.

A scan walks every namespace folder of the root (the size cap is the root's, so entries of a
namespace no longer served still count and are evicted first, being the least recently used).
It removes, once older than the grace period (other processes may be in the middle of a save):

- temp files (`.tmp-*`): writes that never finished;
- the parts of an entry without a commit marker: saves that never committed, and evictions or
  quarantines cut short (they remove the marker first);
- a marker with no part left beside it.

Files it does not recognise are left alone. Each namespace's quarantine folder is pruned to its
newest `QUARANTINE_KEEP` files.

Every folder is opened through tree.py, relative to its parent's descriptor: a symbolic link,
something that is not a folder, or another user's or a group- or world-writable folder is
refused (logged once) and skipped, and every file is looked at and removed relative to its
folder's descriptor, so a scan never lists, stats or removes anything outside the store.
`Scanner` runs them on a store's background thread: at open, then every few minutes.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable

import attrs

from galahad.adapters.fs.index import CLOCK, EntryId, Index
from galahad.adapters.fs.layout import (
    QUARANTINE_DIR,
    TEMP_PREFIX,
    marker_name,
    parse_name,
    parse_namespace_dir,
    part_name,
)
from galahad.adapters.fs.medium import unlink_quietly
from galahad.adapters.fs.tree import FolderTree, names_in
from galahad.domain.error import StoreUnavailable

__all__ = ["QUARANTINE_KEEP", "ScanReport", "Scanner", "prune_quarantine", "scan_root"]

_log = logging.getLogger(__name__)

QUARANTINE_KEEP = 8
_FANOUT = re.compile(r"[0-9a-f]{2}")


@attrs.define
class ScanReport:
    """What one scan saw: entries and their bytes (all namespaces), and stale files it removed."""

    entries: int = 0
    nbytes: int = 0
    removed: int = 0
    seconds: float = 0.0


def scan_root(tree: FolderTree, index: Index, *, grace_ns: int, stop: threading.Event) -> ScanReport | None:
    """Scan every namespace of the store root of `tree` into `index`; None if `stop` was set
    before the end."""
    started = time.monotonic()
    gen = index.begin_scan(CLOCK.tick())
    report = ScanReport()
    for ns_name in _namespaces(tree):
        ns_hex = parse_namespace_dir(ns_name)
        if ns_hex is None:
            continue
        leaves = tree.walk(ns_name, _FANOUT, 2)
        try:
            for rel, leaf_fd in leaves:
                if stop.is_set():
                    return None
                _scan_leaf(leaf_fd, ns_hex, rel[-5:].replace("/", ""), index, gen, grace_ns, report)
        finally:
            leaves.close()
        try:
            quarantine = tree.open_uncached(f"{ns_name}/{QUARANTINE_DIR}")
        except StoreUnavailable:  # unreadable: left as it is
            quarantine = None
        if quarantine is not None:
            try:
                report.removed += prune_quarantine(quarantine, QUARANTINE_KEEP)
            finally:
                os.close(quarantine)
    index.end_scan(gen)
    report.seconds = time.monotonic() - started
    return report


class Scanner:
    """A store's background scans of its root into `index`: one at open, then one every
    `rescan_s` seconds (None: only the one at open), each followed by `after()` (the store trims
    itself to its cap). A scan that fails is logged (loudly the first time) and the store serves
    on without an exact index. `ready` is set once the first scan ended, however it ended;
    `indexed` once a scan went through every folder (the index then holds every entry the root
    held when that scan began, and what this store wrote or committed since). While
    `paused()` (the store's filesystem is not answering), scans are put off: a scan would see an
    empty store and forget what the index knows."""

    def __init__(self, tree: FolderTree, index: Index, *, grace_ns: int, rescan_s: float | None,
                 after: Callable[[], None], paused: Callable[[], bool] = lambda: False) -> None:
        self.ready = threading.Event()
        self.indexed = threading.Event()
        self._tree = tree
        self._index = index
        self._grace_ns = grace_ns
        self._rescan_s = rescan_s
        self._after = after
        self._paused = paused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="galahad-store-scan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop scanning: a scan under way ends at its next leaf folder."""
        self._stop.set()
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        first, failed = True, False
        while not self._stop.is_set():
            seconds = 0.0
            if self._paused() and not first:
                self._stop.wait(1.0)
                continue
            try:
                report = scan_root(self._tree, self._index, grace_ns=self._grace_ns, stop=self._stop)
                if report is not None:
                    self.indexed.set()
                    seconds = report.seconds
                    log = _log.info if first else _log.debug
                    log(
                        "[galahad] store %s indexed: %d entries, %d bytes in %.2f s; %d stale files removed",
                        self._tree.root, report.entries, report.nbytes, report.seconds, report.removed,
                    )  # fmt: skip
                    self._after()
            except Exception:  # a thread boundary: log (once loudly), keep serving without an exact index
                log = _log.debug if failed else _log.warning
                log("[galahad] scan of store %s failed; its size accounting may be off", self._tree.root,
                    exc_info=True)
                failed = True
            finally:
                first = False
                self.ready.set()
            if self._rescan_s is None:
                return
            self._stop.wait(max(self._rescan_s, 10 * seconds))


def prune_quarantine(folder_fd: int, keep: int) -> int:
    """Remove all but the `keep` newest files of the quarantine folder open at `folder_fd` (a
    folder tree.py trusts); how many went. Files only: a folder in it is left alone."""
    try:
        names = names_in(folder_fd)
    except OSError:
        return 0
    found = []
    for name in names:
        try:
            st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile
        if not stat.S_ISDIR(st.st_mode):
            found.append((st.st_mtime_ns, name))
    found.sort(reverse=True)
    return sum(unlink_quietly(name, folder_fd) for _, name in found[keep:])


def _namespaces(tree: FolderTree) -> list[str]:
    """The names of the namespace folders in the root (the root is trusted: listed by its path)."""
    try:
        names = os.listdir(tree.root)
    except OSError:
        return []
    return sorted(n for n in names if parse_namespace_dir(n) is not None)


def _scan_leaf(
    leaf: int, ns_hex: str, prefix: str, index: Index, gen: int, grace_ns: int, report: ScanReport
) -> None:
    """One `<k[0:2]>/<k[2:4]>` folder, open at `leaf`: group its files by entry, clean, and merge
    into the index."""
    now = time.time_ns()
    parts: dict[str, dict[int, tuple[int, int]]] = {}  # key hex -> part -> (size, mtime)
    markers: dict[str, int] = {}  # key hex -> mtime
    try:
        listed = names_in(leaf)
    except OSError:
        return
    for name in listed:
        try:
            st = os.stat(name, dir_fd=leaf, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if name.startswith(TEMP_PREFIX):
            if now - st.st_mtime_ns > grace_ns and unlink_quietly(name, leaf):
                report.removed += 1
            continue
        parsed = parse_name(name)
        if parsed is None or not parsed[0].startswith(prefix):
            continue
        keyhex, part = parsed
        if part is None:
            markers[keyhex] = st.st_mtime_ns
        else:
            parts.setdefault(keyhex, {})[part] = (st.st_size, st.st_mtime_ns)
    merged: list[tuple[EntryId, dict[int, int], int]] = []
    for keyhex in sorted(parts.keys() | markers.keys()):
        found = parts.get(keyhex, {})
        newest = max([m for _, m in found.values()] + [markers.get(keyhex, 0)])
        if (keyhex not in markers or not found) and now - newest > grace_ns:
            report.removed += _remove_abandoned(leaf, keyhex, found)
            continue
        if found:
            sizes = {p: size for p, (size, _) in found.items()}
            merged.append(((ns_hex, bytes.fromhex(keyhex)), sizes, newest))
            report.entries += 1
            report.nbytes += sum(sizes.values())
    index.merge(merged, gen)


def _remove_abandoned(leaf: int, keyhex: str, found: dict[int, tuple[int, int]]) -> int:
    marker = marker_name(keyhex)
    if not found:
        return int(unlink_quietly(marker, leaf))
    try:
        os.stat(marker, dir_fd=leaf, follow_symlinks=False)
        return 0  # committed since we listed the folder
    except OSError:
        pass
    return sum(unlink_quietly(part_name(keyhex, p), leaf) for p in found)
