"""The filesystem block store: one namespace of a store root on local disk (docs/store.md).

Every question about what exists or is committed is answered from the filesystem, so several
processes (the ranks of one server, several servers sharing a folder) see each other's entries
at once. The in-memory index (index.py) only serves the size cap; a background scan fills it at
open (open itself does not walk the folder) and refreshes it every `rescan_s` seconds.

Every folder below the root is reached through tree.py: opened relative to its parent's
descriptor, never through a symbolic link, and trusted only when it is a folder of this user
that nobody else can write. Files are read, written, renamed and removed relative to their
folder's descriptor. What lies under a refused folder is absent: a miss, never an error.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from galahad.adapters.fs import marker
from galahad.adapters.fs.folder import file_size, part_names, read_small, unlink
from galahad.adapters.fs.index import CLOCK, EntryId, Index
from galahad.adapters.fs.layout import (
    QUARANTINE_DIR,
    leaf_dir,
    marker_name,
    namespace_dir,
    namespace_name,
    parse_name,
    part_name,
)
from galahad.adapters.fs.medium import ABSENT, Medium, run_all, unavailable, unlink_quietly, write_file
from galahad.adapters.fs.reader import FileReader
from galahad.adapters.fs.residency import resident_share
from galahad.adapters.fs.root import StoreRoot, ensure_namespace
from galahad.adapters.fs.scan import QUARANTINE_KEEP, prune_quarantine, scan_root
from galahad.adapters.fs.tree import Folder, FolderTree, RefusedFolder, names_in
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.domain.namespace import Namespace
from galahad.format.fanout import LastingPool
from galahad.ports.store import Buffer, byte_views, check_part, check_reason
from galahad.adapters.posix.regular_file import NotARegularFile

__all__ = ["FilesystemBlockStore"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")
_FANOUT = re.compile(r"[0-9a-f]{2}")
_MARKERS_KEPT = 1 << 14  # commit markers remembered by their file's identity (10 MB at most)


def _read_only(folder: Folder) -> str:
    """Why nothing can be written under `folder` ("" when it can): said once at open, so a store
    that serves reads only is not first noticed at the first skipped save."""
    try:
        if os.statvfs(folder.fd).f_flag & os.ST_RDONLY:
            return "the filesystem is mounted read-only"
        writable = os.access(".", os.W_OK | os.X_OK, dir_fd=folder.fd)
    except OSError:
        return ""
    return "" if writable else "this user cannot write to it"


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one marker file from another at the same name: a marker is never changed in
    place by Galahad, but replaced by a new file stamped with a fresh nanosecond tick."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class FilesystemBlockStore:
    """A `BlockStore` for one namespace, in `root/ns-<digest>/` (layout in layout.py).

    `max_bytes`: the cap on the bytes of all parts in the root (all namespaces); None keeps the
    cap recorded in the root's manifest (80% of the free space when the root was created).
    `io_threads`: the thread pool for batches and large parts (default min(16, 2 * CPUs)).
    `stale_grace_s`: age after which a
    scan removes temp files and uncommitted parts. `rescan_s`: seconds between the scans that
    bring other processes' writes into the size accounting (None: only the scan at open).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        *,
        max_bytes: int | None = None,
        io_threads: int | None = None,
        stale_grace_s: float = 600.0,
        rescan_s: float | None = 300.0,
    ) -> None:
        self._open(root, namespace.hex, namespace.canonical_json(), max_bytes, io_threads, stale_grace_s, rescan_s)

    @classmethod
    def for_digest(
        cls,
        root: str | os.PathLike[str],
        digest_hex: str,
        *,
        max_bytes: int | None = None,
        io_threads: int | None = None,
        stale_grace_s: float = 600.0,
        rescan_s: float | None = 300.0,
    ) -> FilesystemBlockStore:
        """Open an existing namespace folder by its digest (for tools that hold no `Namespace`)."""
        folder = namespace_dir(os.path.abspath(os.fspath(root)), digest_hex)
        try:
            is_folder = stat.S_ISDIR(os.lstat(folder).st_mode)
        except OSError:
            is_folder = False
        if not is_folder:  # absent, or a link (never followed) or a file there
            raise StoreUnavailable(errno.ENOENT, f"no namespace {digest_hex} in store {os.fspath(root)}")
        store = cls.__new__(cls)
        store._open(root, digest_hex, None, max_bytes, io_threads, stale_grace_s, rescan_s)
        return store

    def _open(
        self,
        root: str | os.PathLike[str],
        ns_hex: str,
        canonical_json: bytes | None,
        max_bytes: int | None,
        io_threads: int | None,
        stale_grace_s: float,
        rescan_s: float | None,
    ) -> None:
        threads = io_threads if io_threads is not None else min(16, 2 * (os.cpu_count() or 1))
        if threads < 1 or stale_grace_s < 0 or (rescan_s is not None and rescan_s <= 0):
            raise ValueError("io_threads must be >= 1, stale_grace_s >= 0 and rescan_s > 0 or None")
        self._root = StoreRoot.open(root, writable=True, max_bytes=max_bytes)
        self._max_bytes = max_bytes if max_bytes is not None else self._root.max_bytes
        self._ns_hex = ns_hex
        self._ns_dir = namespace_dir(self._root.path, ns_hex)
        self._ns_rel = namespace_name(ns_hex)
        self._tree = FolderTree(self._root.path)
        try:
            self._fresh, self.read_only = self._open_namespace(canonical_json)
        except BaseException:
            self._tree.close()
            raise
        self._namespace_doc = (self._root.namespace_info(ns_hex) if canonical_json is None
                               else json.loads(canonical_json))
        if self.read_only:
            _log.warning("[galahad] store %s is read-only (%s): entries already there are served, nothing new "
                         "is saved; remount it read-write or point GALAHAD_CACHE_DIR at a writable folder",
                         self._root.path, self.read_only)
        self._grace_ns = int(stale_grace_s * 1e9)
        self._rescan_s = rescan_s
        self._pool = LastingPool(threads, thread_name_prefix="galahad-io")  # works on while the
        # interpreter exits, for a save queued before; `close` stops it for good
        self._medium = Medium(self._pool)
        self._index = Index()
        # commit markers read so far, by key: (the file's identity, its parts) (`_committed_parts`)
        self._markers: dict[str, tuple[tuple[int, int, int, int], dict[int, int]]] = {}
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {"evictions": 0, "evicted_bytes": 0, "quarantined": 0, "puts_skipped": 0}
        self._closed = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._scanner = threading.Thread(target=self._scan_loop, name="galahad-store-scan", daemon=True)
        self._scanner.start()
        _log.info(
            "[galahad] store %s opened: namespace %s, max_bytes %d, %d I/O threads",
            self._root.path,
            ns_hex[:16],
            self._max_bytes,
            threads,
        )

    def _open_namespace(self, canonical_json: bytes | None) -> tuple[bool, str]:
        """Make the namespace folder (and its namespace.json) if absent: (whether it holds no
        entry folder yet, why nothing can be written in it: "" when it can). A namespace folder
        this store does not trust (logged) holds nothing, and nothing is written there."""
        if not ensure_namespace(self._tree, self._ns_hex, canonical_json):
            return True, ""
        ns = self._tree.borrow(self._ns_rel)
        if ns is None:
            return True, ""
        try:  # one listing: no entry folder yet
            return not any(_FANOUT.fullmatch(n) for n in names_in(ns.fd)), _read_only(ns)
        except OSError as exc:
            raise unavailable("list", self._ns_dir, exc) from exc
        finally:
            self._tree.give_back(ns)

    # -- the port ---------------------------------------------------------------------------

    def put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer]) -> bool:
        return self._put(key, part, data, split=True)

    def get(self, key: ChainKey, part: int) -> bytes | None:
        return self._get(key, part, CLOCK.tick())

    def part_size(self, key: ChainKey, part: int) -> int | None:
        check_part(part)
        self._check_open()
        keyhex = key.hex
        found = self._tree.find(leaf_dir(self._ns_rel, keyhex), part_name(keyhex, part))
        if found is None:
            return None
        self._tree.give_back(found[0])
        return found[1].st_size if stat.S_ISREG(found[1].st_mode) else None

    def read_into(self, key: ChainKey, part: int, buf: memoryview) -> int | None:
        return self._read_into(key, part, buf, CLOCK.tick(), split=True)

    def open_reader(self, key: ChainKey, part: int) -> FileReader | None:
        check_part(part)
        self._check_open()
        eid = (self._ns_hex, key.raw)
        tick = CLOCK.tick()

        def opening(leaf: Folder, name: str, path: str) -> tuple[str, int, int] | None:
            got = self._medium.open_part(leaf.fd, name, path, tick)
            return None if got is None else (path, *got)

        self._index.pin(eid)  # until the reader is closed: eviction passes the entry by
        try:
            opened = self._with_part(key.hex, part, opening)
        except BaseException:
            self._index.unpin(eid)
            raise
        if opened is None:
            self._index.unpin(eid)
            return None
        self._index.touch(eid, tick)
        path, fd, size = opened
        return FileReader(self._medium, path, fd, size, on_close=lambda: self._index.unpin(eid))

    def has_part(self, key: ChainKey, part: int) -> bool:
        return self.part_size(key, part) is not None

    def resident_share(self, key: ChainKey, part: int) -> float | None:
        """Share of the part's bytes in the page cache now (`mincore`); None when unknown or absent."""
        check_part(part)
        self._check_open()
        return self._with_part(key.hex, part, lambda leaf, name, _path: resident_share(name, dir_fd=leaf.fd))

    def commit(self, key: ChainKey, parts: tuple[int, ...]) -> bool:
        wanted = _normalise_parts(parts)
        self._check_open()
        keyhex = key.hex
        found = self._tree.find(leaf_dir(self._ns_rel, keyhex), part_name(keyhex, wanted[0]))
        if found is None:
            return False
        leaf = found[0]
        try:
            sizes = {p: file_size(part_name(keyhex, p), leaf.fd, leaf.path) for p in wanted}
            if any(size is None for size in sizes.values()):
                return False
            present = {p: s for p, s in sizes.items() if s is not None}
            if self._committed_in(leaf, keyhex) is not None:
                return True
            unlink_quietly(marker_name(keyhex), leaf.fd)  # a stale marker, if any
            tick = CLOCK.tick()
            if not write_file(leaf.fd, leaf.path, marker_name(keyhex), marker.encode(present), tick):
                return self._committed_in(leaf, keyhex) is not None  # another process committed it
        finally:
            self._tree.give_back(leaf)
        self._index.learn((self._ns_hex, key.raw), present, tick)
        return True

    def is_committed(self, key: ChainKey) -> bool:
        if self._closed:
            self._check_open()
        keyhex = key.raw.hex()
        return self._committed_parts(leaf_dir(self._ns_rel, keyhex), keyhex) is not None

    def quarantine(self, key: ChainKey, reason: str) -> bool:
        check_reason(reason)
        self._check_open()
        self._index.remove((self._ns_hex, key.raw))
        keyhex = key.hex
        leaf = self._tree.borrow(leaf_dir(self._ns_rel, keyhex), fresh=True)
        if leaf is None:  # nothing there, or a folder this store does not trust (a miss already)
            return False
        changed = False
        try:
            if unlink(marker_name(keyhex), leaf.fd):
                changed = True
                os.fsync(leaf.fd)  # no rank offers the entry again, even after a crash
            names = part_names(leaf.fd, leaf.path, keyhex)
            if names:
                changed = self._set_aside(leaf, names, reason) or changed
        except StoreUnavailable:
            raise
        except OSError as exc:
            raise unavailable("quarantine", f"{leaf.path}/{marker_name(keyhex)}", exc) from exc
        finally:
            self._tree.give_back(leaf)
            if changed:  # an entry already gone (evicted since its lookup) is not counted
                self._count("quarantined", f"quarantined_{reason}")
        return changed

    def committed(self) -> Iterator[ChainKey]:
        self._check_open()
        return self._walk_committed()

    def used_bytes(self) -> int:
        """Bytes of all parts in the root (all namespaces) known to this process: what the cap
        limits. Exact once `wait_indexed()` is True, apart from other processes' changes since."""
        return self._index.used()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._scanner.join(timeout=30)
        self._pool.shutdown(wait=True)
        self._tree.close()

    # -- beyond the port ---------------------------------------------------------------------

    @property
    def root(self) -> StoreRoot:
        return self._root

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def fresh(self) -> bool:
        """Whether this namespace had no entry at all when the store was opened."""
        return self._fresh

    def other_layouts(self) -> list[tuple[str, dict[str, Any]]]:
        """(digest hex, namespace) of every other namespace in the root that differs from this one
        only in its tensor / pipeline parallel sizes (and so in the per-rank shapes of its KV
        groups): the same model saved by a differently split server. Reads each namespace
        folder's namespace.json once; nothing below them."""
        if self._namespace_doc is None:
            return []
        mine = _without_layout(self._namespace_doc)
        found = []
        for digest in self._root.namespaces():
            if digest == self._ns_hex:
                continue
            info = self._root.namespace_info(digest)
            if info is not None and _without_layout(info) == mine:
                found.append((digest, info))
        return found

    def committed_in(self, ns_hex: str, key: ChainKey) -> bool:
        """Whether `key` is committed (marker and every part present) in namespace `ns_hex` of this
        root: a few stats in one leaf folder, nothing read."""
        self._check_open()
        keyhex = key.hex
        return self._committed_parts(leaf_dir(namespace_name(ns_hex), keyhex), keyhex) is not None

    def recent(self, wait_s: float | None = None) -> list[tuple[ChainKey, dict[int, int]]]:
        """`KnowsRecency.recent`: the entries of this namespace the index knows, most recently
        used first, with their parts' sizes; waits up to `wait_s` for the scan started at open
        (after a restart that scan is what knows the entries and when each was last used)."""
        self._check_open()
        self.wait_indexed(wait_s)
        return [(ChainKey(raw), parts) for raw, parts in self._index.recent(self._ns_hex)]

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Wait for the scan started at open to finish; whether it has."""
        return self._ready.wait(timeout)

    def evict(self, to_bytes: int) -> int:
        """Evict least recently used entries (not those being read) until `used_bytes() <= to_bytes`;
        how many entries went."""
        if not isinstance(to_bytes, int) or to_bytes < 0:
            raise ValueError(f"to_bytes must be a non-negative int, got {to_bytes!r}")
        self._check_open()
        victims = self._index.trim(to_bytes)
        self._delete_evicted(victims)
        return len(victims)

    def get_many(self, items: Iterable[tuple[ChainKey, int]]) -> list[bytes | None]:
        """`get` of each (key, part), in parallel; recency is recorded in the order given."""
        todo = [(key, part, CLOCK.tick()) for key, part in items]
        return self._batch(lambda item: self._get(*item), todo)

    def read_many(self, items: Iterable[tuple[ChainKey, int, memoryview]]) -> list[int | None]:
        """`read_into` of each (key, part, buffer), in parallel; recency recorded in the order given."""
        todo = [(key, part, buf, CLOCK.tick()) for key, part, buf in items]
        return self._batch(lambda item: self._read_into(*item, split=False), todo)

    def put_many(self, items: Iterable[tuple[ChainKey, int, Buffer | Sequence[Buffer]]]) -> list[bool]:
        """`put` of each (key, part, data), in parallel. When some fail, the others are still
        stored and the first failure is raised once all have ended."""
        return self._batch(lambda item: self._put(*item, split=False), list(items))

    def stats(self) -> dict[str, int]:
        """Counters (evictions, quarantines by reason, skipped puts) and the size accounting."""
        with self._lock:
            out = dict(self._counts)
        out["used_bytes"] = self._index.used()
        out["entries"] = len(self._index)
        out["max_bytes"] = self._max_bytes
        out["indexed"] = int(self._ready.is_set())
        return out

    def __enter__(self) -> FilesystemBlockStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes and reads --------------------------------------------------------------------

    def _put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer], *, split: bool) -> bool:
        """Write `data` as the part's file."""
        check_part(part)
        views = byte_views(data)
        self._check_open()
        rel = leaf_dir(self._ns_rel, key.hex)
        name = part_name(key.hex, part)
        found = self._tree.find(rel, name)
        if found is not None:
            self._tree.give_back(found[0])
            return False
        eid = (self._ns_hex, key.raw)
        size = sum(len(v) for v in views)
        victims = self._index.reserve(eid, size, self._max_bytes)
        if victims is None:
            self._count("puts_skipped")
            raise StoreUnavailable(
                errno.ENOSPC, f"store {self._root.path} is full: {size} bytes do not fit under max_bytes={self._max_bytes} "
                "even with every entry not being read evicted; raise GALAHAD_MAX_BYTES"
            )
        try:
            self._delete_evicted(victims)
            placed, tick = self._write_part(rel, name, views, split)
        except BaseException as exc:
            self._index.release(size)
            if isinstance(exc, StoreUnavailable):
                self._count("puts_skipped")
            raise
        if placed:
            self._index.settle(eid, part, size, tick)
        else:
            self._index.release(size)
        return placed

    def _get(self, key: ChainKey, part: int, tick: int) -> bytes | None:
        check_part(part)
        self._check_open()
        eid = (self._ns_hex, key.raw)
        self._index.pin(eid)
        try:
            blob = self._with_part(key.hex, part, lambda leaf, name, path: self._medium.read(leaf.fd, name, path, tick))
        finally:
            self._index.unpin(eid)
        if blob is not None:
            self._index.touch(eid, tick)
        return blob

    def _read_into(self, key: ChainKey, part: int, buf: memoryview, tick: int, *, split: bool) -> int | None:
        check_part(part)
        target = memoryview(buf).cast("B")
        if target.readonly:
            raise ValueError("read_into needs a writable buffer")
        self._check_open()
        eid = (self._ns_hex, key.raw)
        self._index.pin(eid)
        try:
            count = self._with_part(key.hex, part, lambda leaf, name, path: self._medium.read_into(
                leaf.fd, name, path, target, tick, split=split))
        finally:
            self._index.unpin(eid)
        if count is not None:
            self._index.touch(eid, tick)
        return count

    def _batch(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """`fn` over `items` on the pool; all have ended before the first failure is raised."""
        self._check_open()
        if len(items) <= 1:
            return [fn(item) for item in items]
        return run_all(self._pool, fn, items)

    # -- entries -----------------------------------------------------------------------------

    def _committed_parts(self, rel: str, keyhex: str) -> dict[int, int] | None:
        """The entry's parts if it is committed: its marker reads and lists only present parts.

        Asked for every 64 tokens of a prompt on vLLM's engine thread, and again for the same
        entries on every turn of a conversation: an absent marker costs one `lstat` of its path
        (a miss is a miss whatever the folders on the way are); a present one is looked at again
        through its leaf folder's trusted descriptor (tree.py), and a marker already read is
        known by its file's identity (inode, size, and the times a new marker is stamped with),
        so asking again costs those two `lstat`s, not an open, a read and a parse; its parts are
        looked at every time. Plain `os` calls, no buffered file object; a marker that is not a
        regular file (a link or a FIFO planted there) is no marker, and is never opened."""
        found = self._tree.find(rel, marker_name(keyhex))
        if found is None:
            return None
        leaf, st = found
        try:
            return self._committed_in(leaf, keyhex, st)
        finally:
            self._tree.give_back(leaf)

    def _committed_in(self, leaf: Folder, keyhex: str, st: os.stat_result | None = None) -> dict[int, int] | None:
        """`_committed_parts` in a leaf folder already borrowed; `st`: the marker's `lstat`, if known."""
        name = marker_name(keyhex)
        if st is None:
            try:
                st = os.stat(name, dir_fd=leaf.fd, follow_symlinks=False)
            except OSError as exc:
                if exc.errno in ABSENT:
                    return None
                raise unavailable("look up", f"{leaf.path}/{name}", exc) from exc
        if not stat.S_ISREG(st.st_mode):
            return None
        known = self._markers.get(keyhex)
        if known is not None and known[0] == _identity(st):
            sizes: dict[int, int] | None = known[1]
        else:
            sizes = self._read_marker(leaf, keyhex)
        if sizes is None:
            return None
        for part, size in sizes.items():
            if file_size(part_name(keyhex, part), leaf.fd, leaf.path) != size:
                return None
        return sizes

    def _read_marker(self, leaf: Folder, keyhex: str) -> dict[int, int] | None:
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
            self._markers.pop(keyhex, None)
            return None
        if len(self._markers) >= _MARKERS_KEPT:
            self._markers.clear()  # bounded; the next lookups read their markers again
        self._markers[keyhex] = (_identity(st), sizes)
        return sizes

    def _delete_evicted(self, victims: list[tuple[EntryId, int]]) -> None:
        """Remove evicted entries' files: the marker first, so no process offers them meanwhile.
        An entry under a folder this store does not trust is only forgotten: nothing there is
        removed."""
        for (ns_hex, raw), nbytes in victims:
            keyhex = raw.hex()
            leaf = self._tree.borrow(leaf_dir(namespace_name(ns_hex), keyhex), fresh=True)
            if leaf is not None:
                try:
                    unlink_quietly(marker_name(keyhex), leaf.fd)
                    for name in part_names(leaf.fd, leaf.path, keyhex):
                        unlink_quietly(name, leaf.fd)
                finally:
                    self._tree.give_back(leaf)
            self._count("evictions", amount=1)
            self._count("evicted_bytes", amount=nbytes)
        if victims:
            _log.debug("evicted %d entries from %s", len(victims), self._root.path)

    def _walk_committed(self) -> Iterator[ChainKey]:
        leaves = self._tree.walk(self._ns_rel, _FANOUT, 2)
        try:
            for rel, fd in leaves:
                try:
                    names = sorted(names_in(fd))
                except OSError as exc:
                    raise unavailable("list", self._tree.path(rel), exc) from exc
                for name in names:
                    parsed = parse_name(name)
                    if parsed and parsed[1] is None and self._committed_parts(rel, parsed[0]) is not None:
                        yield ChainKey.from_hex(parsed[0])
        finally:
            leaves.close()

    # -- the background scan -----------------------------------------------------------------

    def _scan_loop(self) -> None:
        first, failed = True, False
        while not self._stop.is_set():
            seconds = 0.0
            try:
                report = scan_root(self._tree, self._index, grace_ns=self._grace_ns, stop=self._stop)
                if report is not None:
                    seconds = report.seconds
                    log = _log.info if first else _log.debug
                    log(
                        "[galahad] store %s indexed: %d entries, %d bytes in %.2f s; %d stale files removed",
                        self._root.path, report.entries, report.nbytes, report.seconds, report.removed,
                    )  # fmt: skip
                    self._delete_evicted(self._index.trim(self._max_bytes))
            except Exception:  # a thread boundary: log (once loudly), keep serving without an exact index
                log = _log.debug if failed else _log.warning
                log("[galahad] scan of store %s failed; its size accounting may be off", self._root.path, exc_info=True)
                failed = True
            finally:
                first = False
                self._ready.set()
            if self._rescan_s is None:
                return
            self._stop.wait(max(self._rescan_s, 10 * seconds))

    # -- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(errno.EBADF, f"store {self._root.path} is closed")

    def _leaf(self, keyhex: str) -> str:
        """The path of the entry's leaf folder (for messages and tests; files are reached through
        the folder's trusted descriptor)."""
        return leaf_dir(self._ns_dir, keyhex)

    def _with_part(self, keyhex: str, part: int, use: Callable[[Folder, str, str], _R]) -> _R | None:
        """`use(leaf, name, path)` on the part's trusted leaf folder (borrowed meanwhile), its
        file name and path; None when the part is not there or a folder on the way is refused."""
        name = part_name(keyhex, part)
        found = self._tree.find(leaf_dir(self._ns_rel, keyhex), name)
        if found is None:
            return None
        leaf = found[0]
        try:
            return use(leaf, name, f"{leaf.path}/{name}")
        finally:
            self._tree.give_back(leaf)

    def _set_aside(self, leaf: Folder, names: list[str], reason: str) -> bool:
        """Move the parts `names` of `leaf` into the namespace's quarantine folder as
        `<name>.<reason>` and prune it; whether any moved. When the quarantine folder is refused
        (a link planted there, another user's...: logged), they are removed instead: nothing is
        ever moved into a folder this store does not trust."""
        try:
            folder: Folder | None = self._tree.borrow(f"{self._ns_rel}/{QUARANTINE_DIR}", create=True, fresh=True)
        except RefusedFolder:
            folder = None
        moved = False
        try:
            for name in names:
                if folder is None:
                    moved = unlink(name, leaf.fd) or moved
                    continue
                aside = f"{name}.{reason}"
                try:
                    os.replace(name, aside, src_dir_fd=leaf.fd, dst_dir_fd=folder.fd)
                except FileNotFoundError:
                    continue  # evicted or quarantined by another process meanwhile
                moved = True
                tick = CLOCK.tick()  # quarantine time, for pruning the oldest
                os.utime(aside, ns=(tick, tick), dir_fd=folder.fd, follow_symlinks=False)
            if folder is not None:
                prune_quarantine(folder.fd, QUARANTINE_KEEP)
        finally:
            if folder is not None:
                self._tree.give_back(folder)
        return moved

    def _write_part(self, rel: str, name: str, views: Sequence[memoryview], split: bool) -> tuple[bool, int]:
        """Write one part into its leaf folder (made if absent): (placed, its tick). A leaf that
        has gone since its descriptor was checked (the store's folder removed under a running
        server) is made again, once: the temp file's create failed, nothing was written. A leaf
        this store does not trust raises `RefusedFolder`: nothing is written there."""
        again = False
        while True:
            leaf = self._tree.borrow(rel, create=True, fresh=True)
            if leaf is None:  # not reached: `create` makes the folder or raises
                raise StoreUnavailable(errno.ENOENT, f"cannot create the folder {self._tree.path(rel)}")
            try:
                tick = CLOCK.tick()
                return self._medium.write_new(leaf.fd, leaf.path, name, views, tick, split=split), tick
            except StoreUnavailable as exc:
                if again or exc.errno != errno.ENOENT:
                    raise
            finally:
                self._tree.give_back(leaf)
            self._tree.renew(rel)
            again = True

    def _count(self, *names: str, amount: int = 1) -> None:
        with self._lock:
            for name in names:
                self._counts[name] = self._counts.get(name, 0) + amount


def _without_layout(namespace: dict[str, Any]) -> dict[str, Any]:
    """A namespace less what a split changes: the sizes, and the per-rank shapes of its KV groups
    (heads per rank, layers per stage)."""
    return {k: v for k, v in namespace.items() if k not in ("tp_size", "pp_size", "groups")}


def _normalise_parts(parts: tuple[int, ...]) -> tuple[int, ...]:
    for part in parts:
        check_part(part)
    if not parts:
        raise ValueError("an entry commits at least one part")
    return tuple(sorted(set(parts)))
