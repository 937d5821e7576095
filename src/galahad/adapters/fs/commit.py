"""Commit markers in the folder tree: whether an entry is committed, and committing one.

marker.py is the marker file's format; this module finds, reads and writes markers in trusted
leaf folders (tree.py). An entry is committed while its marker is a regular file that parses and
every part it lists is present with that size. Lookups ask that for every 64 tokens of a prompt
on vLLM's engine thread, and again for the same entries on every turn of a conversation, so a
marker already read is remembered by its file's identity (inode, size, and the times a new
marker is stamped with): asking again costs two `lstat`s, not an open, a read and a parse.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator

from galahad.adapters.fs import marker
from galahad.adapters.fs.folder import file_size, read_small
from galahad.adapters.fs.index import CLOCK
from galahad.adapters.fs.layout import marker_name, parse_name, part_name
from galahad.adapters.fs.medium import ABSENT, unavailable, unlink_quietly, write_file
from galahad.adapters.fs.tree import Folder, FolderTree, names_in
from galahad.adapters.posix.regular_file import NotARegularFile
from galahad.domain.chain import ChainKey

__all__ = ["Markers"]

_FANOUT = re.compile(r"[0-9a-f]{2}")
_MARKERS_KEPT = 1 << 14  # commit markers remembered by their file's identity (10 MB at most)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one marker file from another at the same name: a marker is never changed in
    place by Galahad, but replaced by a new file stamped with a fresh nanosecond tick."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class Markers:
    """The commit markers under the store root of `tree`, those read so far remembered by key
    (a bounded number: past it all are forgotten and read again)."""

    def __init__(self, tree: FolderTree) -> None:
        self._tree = tree
        # markers read so far, by key: (the file's identity, its parts)
        self._known: dict[str, tuple[tuple[int, int, int, int], dict[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def parts(self, rel: str, keyhex: str) -> dict[int, int] | None:
        """The parts of entry `keyhex` of leaf folder `rel` if it is committed.

        An absent marker costs one `lstat` of its path (a miss is a miss whatever the folders
        on the way are); a present one is looked at again through its leaf folder's trusted
        descriptor (tree.py); its parts are looked at every time. Plain `os` calls, no buffered
        file object; a marker that is not a regular file (a link or a FIFO planted there) is no
        marker, and is never opened."""
        found = self._tree.find(rel, marker_name(keyhex))
        if found is None:
            return None
        leaf, st = found
        try:
            return self.parts_in(leaf, keyhex, st)
        finally:
            self._tree.give_back(leaf)

    def parts_in(self, leaf: Folder, keyhex: str, st: os.stat_result | None = None) -> dict[int, int] | None:
        """`parts` in a leaf folder already borrowed; `st`: the marker's `lstat`, if known."""
        if st is None:
            st = self._lstat_marker(leaf, keyhex)
            if st is None:
                return None
        if not stat.S_ISREG(st.st_mode):
            return None
        known = self._known.get(keyhex)
        if known is not None and known[0] == _identity(st):
            sizes: dict[int, int] | None = known[1]
        else:
            sizes = self._read(leaf, keyhex)
        if sizes is None:
            return None
        for part, size in sizes.items():
            if file_size(part_name(keyhex, part), leaf.fd, leaf.path) != size:
                return None
        return sizes

    def commit(self, rel: str, keyhex: str, wanted: tuple[int, ...]) -> tuple[bool, tuple[dict[int, int], int] | None]:
        """Commit entry `keyhex` of leaf folder `rel` iff every part of `wanted` is present:
        (whether it is committed, and (its parts' sizes, the marker's tick) when this call wrote
        the marker). A marker there already that does not commit the entry is replaced; one
        written by another process meanwhile stands."""
        found = self._tree.find(rel, part_name(keyhex, wanted[0]))
        if found is None:
            return False, None
        leaf, first = found
        try:
            # the first part's size from the lookup that found it (a commit runs for every entry
            # saved: each system call saved is one fewer on the engine process's interpreter lock)
            sizes = {p: first.st_size if p == wanted[0] and stat.S_ISREG(first.st_mode)
                     else file_size(part_name(keyhex, p), leaf.fd, leaf.path) for p in wanted}
            if any(size is None for size in sizes.values()):
                return False, None
            present = {p: s for p, s in sizes.items() if s is not None}
            mark = self._lstat_marker(leaf, keyhex)
            if mark is not None:
                if self.parts_in(leaf, keyhex, mark) is not None:
                    return True, None
                unlink_quietly(marker_name(keyhex), leaf.fd)  # a stale marker
            tick = CLOCK.tick()
            if not write_file(leaf.fd, leaf.path, marker_name(keyhex), marker.encode(present), tick,
                              looked=True):
                return self.parts_in(leaf, keyhex) is not None, None  # another process committed it
        finally:
            self._tree.give_back(leaf)
        return True, (present, tick)

    @staticmethod
    def _lstat_marker(leaf: Folder, keyhex: str) -> os.stat_result | None:
        """The `lstat` of entry `keyhex`'s marker in a borrowed leaf folder (None: absent)."""
        name = marker_name(keyhex)
        try:
            return os.stat(name, dir_fd=leaf.fd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in ABSENT:
                return None
            raise unavailable("look up", f"{leaf.path}/{name}", exc) from exc

    def walk(self, ns_rel: str) -> Iterator[ChainKey]:
        """The committed entries of the namespace folder `ns_rel`, leaf folder by leaf folder."""
        leaves = self._tree.walk(ns_rel, _FANOUT, 2)
        try:
            for rel, fd in leaves:
                try:
                    names = sorted(names_in(fd))
                except OSError as exc:
                    raise unavailable("list", self._tree.path(rel), exc) from exc
                for name in names:
                    parsed = parse_name(name)
                    if parsed and parsed[1] is None and self.parts(rel, parsed[0]) is not None:
                        yield ChainKey.from_hex(parsed[0])
        finally:
            leaves.close()

    def _read(self, leaf: Folder, keyhex: str) -> dict[int, int] | None:
        """Read and parse a marker, and remember it by the identity of the file read."""
        name = marker_name(keyhex)
        try:
            raw, st = read_small(name, leaf.fd, leaf.path, marker.MAX_BYTES)
        except NotARegularFile:  # a link or a FIFO planted there: no marker
            raw = b""
        except OSError as exc:
            if exc.errno in ABSENT:
                return None
            raise unavailable("read", f"{leaf.path}/{name}", exc) from exc
        sizes = marker.decode(raw)
        if sizes is None:
            self._known.pop(keyhex, None)
            return None
        if len(self._known) >= _MARKERS_KEPT:
            self._known.clear()  # bounded; the next lookups read their markers again
        self._known[keyhex] = (_identity(st), sizes)
        return sizes

