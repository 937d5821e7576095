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
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time

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

__all__ = ["QUARANTINE_KEEP", "ScanReport", "prune_quarantine", "scan_root"]

QUARANTINE_KEEP = 8
_FANOUT = re.compile(r"[0-9a-f]{2}")


@attrs.define
class ScanReport:
    """What one scan saw: entries and their bytes (all namespaces), and stale files it removed."""

    entries: int = 0
    nbytes: int = 0
    removed: int = 0
    seconds: float = 0.0


def scan_root(root: str, index: Index, *, grace_ns: int, stop: threading.Event) -> ScanReport | None:
    """Scan every namespace of `root` into `index`; None if `stop` was set before the end."""
    started = time.monotonic()
    gen = index.begin_scan(CLOCK.tick())
    report = ScanReport()
    for ns_name in _subfolders(root):
        ns_hex = parse_namespace_dir(ns_name)
        if ns_hex is None:
            continue
        ns_dir = os.path.join(root, ns_name)
        for first in _subfolders(ns_dir, _FANOUT):
            for second in _subfolders(os.path.join(ns_dir, first), _FANOUT):
                if stop.is_set():
                    return None
                _scan_leaf(os.path.join(ns_dir, first, second), ns_hex, first + second, index, gen, grace_ns, report)
        report.removed += prune_quarantine(os.path.join(ns_dir, QUARANTINE_DIR), QUARANTINE_KEEP)
    index.end_scan(gen)
    report.seconds = time.monotonic() - started
    return report


def prune_quarantine(folder: str, keep: int) -> int:
    """Remove all but the `keep` newest files of a quarantine folder; how many went."""
    try:
        found = [(e.stat(follow_symlinks=False).st_mtime_ns, e.path) for e in os.scandir(folder)]
    except OSError:
        return 0
    found.sort(reverse=True)
    return sum(unlink_quietly(path) for _, path in found[keep:])


def _subfolders(path: str, pattern: re.Pattern[str] | None = None) -> list[str]:
    try:
        with os.scandir(path) as entries:
            names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(n for n in names if pattern is None or pattern.fullmatch(n))


def _scan_leaf(
    leaf: str, ns_hex: str, prefix: str, index: Index, gen: int, grace_ns: int, report: ScanReport
) -> None:
    """One `<k[0:2]>/<k[2:4]>` folder: group its files by entry, clean, and merge into the index."""
    now = time.time_ns()
    parts: dict[str, dict[int, tuple[int, int]]] = {}  # key hex -> part -> (size, mtime)
    markers: dict[str, int] = {}  # key hex -> mtime
    try:
        with os.scandir(leaf) as entries:
            listed = list(entries)
    except OSError:
        return
    for entry in listed:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if entry.name.startswith(TEMP_PREFIX):
            if now - st.st_mtime_ns > grace_ns and unlink_quietly(entry.path):
                report.removed += 1
            continue
        parsed = parse_name(entry.name)
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


def _remove_abandoned(leaf: str, keyhex: str, found: dict[int, tuple[int, int]]) -> int:
    marker = os.path.join(leaf, marker_name(keyhex))
    if not found:
        return int(unlink_quietly(marker))
    if os.path.lexists(marker):  # committed since we listed the folder
        return 0
    return sum(unlink_quietly(os.path.join(leaf, part_name(keyhex, p))) for p in found)
