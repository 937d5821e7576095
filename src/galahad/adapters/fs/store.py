"""The filesystem block store: one namespace of a store root on local disk (docs/store.md).

Every question about what exists or is committed is answered from the filesystem, so several
processes (the ranks of one server, several servers sharing a folder) see each other's entries
at once. The in-memory index (index.py) only serves the size cap; a background scan fills it at
open (open itself does not walk the folder) and refreshes it every `rescan_s` seconds.
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
from galahad.adapters.fs.folder import file_size, listdir, make_dirs, part_names, unlink
from galahad.adapters.fs.index import CLOCK, EntryId, Index
from galahad.adapters.fs.layout import (
    QUARANTINE_DIR,
    leaf_dir,
    marker_name,
    namespace_dir,
    parse_name,
    part_name,
)
from galahad.adapters.fs.medium import ABSENT, Medium, run_all, unavailable, unlink_quietly, write_file
from galahad.adapters.fs.reader import FileReader
from galahad.adapters.fs.residency import resident_share
from galahad.adapters.fs.root import StoreRoot, ensure_namespace
from galahad.adapters.fs.scan import QUARANTINE_KEEP, prune_quarantine, scan_root
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.domain.namespace import Namespace
from galahad.fanout import LastingPool
from galahad.ports.store import Buffer, byte_views, check_part, check_reason
from galahad.private_folder import fsync_folder
from galahad.regular_file import NotARegularFile, read_regular_with_stat

__all__ = ["FilesystemBlockStore"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")
_FANOUT = re.compile(r"[0-9a-f]{2}")
_MARKERS_KEPT = 1 << 14  # commit markers remembered by their file's identity (10 MB at most)


def _read_only(folder: str) -> str:
    """Why nothing can be written under `folder` ("" when it can): said once at open, so a store
    that serves reads only is not first noticed at the first skipped save."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "the filesystem is mounted read-only"
    except OSError:
        return ""
    return "" if os.access(folder, os.W_OK | os.X_OK) else "this user cannot write to it"


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one marker file from another at the same name: a marker is never changed in
    place by Galahad, but replaced by a new file stamped with a fresh nanosecond tick."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class FilesystemBlockStore:
    """A `BlockStore` for one namespace, in `root/ns-<digest>/` (layout in layout.py).

    `max_bytes`: the cap on the bytes of all parts in the root (all namespaces); None keeps the
    cap recorded in the root's manifest (80% of the free space when the root was created).
    `io_threads`: the thread pool for batches and large parts (default min(16, 2 * CPUs)).
    `o_direct`: use O_DIRECT where the filesystem takes it. `stale_grace_s`: age after which a
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
        o_direct: bool = False,
        stale_grace_s: float = 600.0,
        rescan_s: float | None = 300.0,
    ) -> None:
        self._open(root, namespace.hex, namespace.canonical_json(), max_bytes, io_threads, o_direct, stale_grace_s, rescan_s)

    @classmethod
    def for_digest(
        cls,
        root: str | os.PathLike[str],
        digest_hex: str,
        *,
        max_bytes: int | None = None,
        io_threads: int | None = None,
        o_direct: bool = False,
        stale_grace_s: float = 600.0,
        rescan_s: float | None = 300.0,
    ) -> FilesystemBlockStore:
        """Open an existing namespace folder by its digest (for tools that hold no `Namespace`)."""
        folder = namespace_dir(os.path.abspath(os.fspath(root)), digest_hex)
        if not os.path.isdir(folder):
            raise StoreUnavailable(errno.ENOENT, f"no namespace {digest_hex} in store {os.fspath(root)}")
        store = cls.__new__(cls)
        store._open(root, digest_hex, None, max_bytes, io_threads, o_direct, stale_grace_s, rescan_s)
        return store

    def _open(
        self,
        root: str | os.PathLike[str],
        ns_hex: str,
        canonical_json: bytes | None,
        max_bytes: int | None,
        io_threads: int | None,
        o_direct: bool,
        stale_grace_s: float,
        rescan_s: float | None,
    ) -> None:
        threads = io_threads if io_threads is not None else min(16, 2 * (os.cpu_count() or 1))
        if threads < 1 or stale_grace_s < 0 or (rescan_s is not None and rescan_s <= 0):
            raise ValueError("io_threads must be >= 1, stale_grace_s >= 0 and rescan_s > 0 or None")
        self._root = StoreRoot.open(root, writable=True, max_bytes=max_bytes)
        self._max_bytes = max_bytes if max_bytes is not None else self._root.max_bytes
        self._ns_hex = ns_hex
        self._ns_dir = ensure_namespace(self._root.path, ns_hex, canonical_json)
        self._namespace_doc = (self._root.namespace_info(ns_hex) if canonical_json is None
                               else json.loads(canonical_json))
        self._fresh = not listdir(self._ns_dir, _FANOUT)  # one listdir: no entry folder yet
        self.read_only = _read_only(self._ns_dir)
        if self.read_only:
            _log.warning("[galahad] store %s is read-only (%s): entries already there are served, nothing new "
                         "is saved; remount it read-write or point GALAHAD_CACHE_DIR at a writable folder",
                         self._root.path, self.read_only)
        self._grace_ns = int(stale_grace_s * 1e9)
        self._rescan_s = rescan_s
        self._pool = LastingPool(threads, thread_name_prefix="galahad-io")  # works on while the
        # interpreter exits, for a save queued before; `close` stops it for good
        self._medium = Medium(self._pool, direct=o_direct)
        self._index = Index()
        self._dirs: set[str] = set()
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
            "[galahad] store %s opened: namespace %s, max_bytes %d, %d I/O threads%s",
            self._root.path,
            ns_hex[:16],
            self._max_bytes,
            threads,
            ", O_DIRECT" if self._medium.direct else "",
        )

    # -- the port ---------------------------------------------------------------------------

    def put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer]) -> bool:
        return self._put(key, part, data, split=True)

    def put_via(self, key: ChainKey, part: int, nbytes: int, write: Callable[[int], None]) -> bool:
        """`WritableVia.put_via`: `put` of a part that `write(fd)` writes (another process may do
        it, on a copy of the descriptor): the same reservation, temp name, fsync and placing."""
        if nbytes <= 0:
            raise ValueError(f"a part needs a positive size, got {nbytes}")
        return self._put(key, part, None, split=False, via=(nbytes, write))

    def get(self, key: ChainKey, part: int) -> bytes | None:
        return self._get(key, part, CLOCK.tick())

    def part_size(self, key: ChainKey, part: int) -> int | None:
        check_part(part)
        self._check_open()
        return file_size(os.path.join(self._leaf(key.hex), part_name(key.hex, part)))

    def read_into(self, key: ChainKey, part: int, buf: memoryview) -> int | None:
        return self._read_into(key, part, buf, CLOCK.tick(), split=True)

    def open_reader(self, key: ChainKey, part: int) -> FileReader | None:
        check_part(part)
        self._check_open()
        eid = (self._ns_hex, key.raw)
        tick = CLOCK.tick()
        path = os.path.join(self._leaf(key.hex), part_name(key.hex, part))
        self._index.pin(eid)  # until the reader is closed: eviction passes the entry by
        try:
            opened = self._medium.open_part(path, tick)
        except BaseException:
            self._index.unpin(eid)
            raise
        if opened is None:
            self._index.unpin(eid)
            return None
        self._index.touch(eid, tick)
        fd, size, direct = opened
        return FileReader(self._medium, path, fd, size, direct, on_close=lambda: self._index.unpin(eid))

    def has_part(self, key: ChainKey, part: int) -> bool:
        return self.part_size(key, part) is not None

    def resident_share(self, key: ChainKey, part: int) -> float | None:
        """Share of the part's bytes in the page cache now (`mincore`); None when unknown or absent."""
        check_part(part)
        self._check_open()
        return resident_share(os.path.join(self._leaf(key.hex), part_name(key.hex, part)))

    def commit(self, key: ChainKey, parts: tuple[int, ...]) -> bool:
        wanted = _normalise_parts(parts)
        self._check_open()
        leaf = self._leaf(key.hex)
        sizes = {p: file_size(os.path.join(leaf, part_name(key.hex, p))) for p in wanted}
        if any(size is None for size in sizes.values()):
            return False
        present = {p: s for p, s in sizes.items() if s is not None}
        if self._committed_parts(leaf, key.hex) is not None:
            return True
        unlink_quietly(os.path.join(leaf, marker_name(key.hex)))  # a stale marker, if any
        tick = CLOCK.tick()
        if not write_file(leaf, marker_name(key.hex), marker.encode(present), tick):
            return self._committed_parts(leaf, key.hex) is not None  # another process committed it
        self._index.learn((self._ns_hex, key.raw), present, tick)
        return True

    def is_committed(self, key: ChainKey) -> bool:
        if self._closed:
            self._check_open()
        keyhex = key.raw.hex()
        return self._committed_parts(leaf_dir(self._ns_dir, keyhex), keyhex) is not None

    def quarantine(self, key: ChainKey, reason: str) -> bool:
        check_reason(reason)
        self._check_open()
        self._index.remove((self._ns_hex, key.raw))
        leaf = self._leaf(key.hex)
        path = os.path.join(leaf, marker_name(key.hex))
        changed = False
        try:
            if unlink(path):
                changed = True
                fsync_folder(leaf)  # no rank offers the entry again, even after a crash
            names = part_names(leaf, key.hex)
            folder = os.path.join(self._ns_dir, QUARANTINE_DIR)
            if names:
                make_dirs(folder)
            for name in names:
                path = os.path.join(folder, f"{name}.{reason}")
                try:
                    os.replace(os.path.join(leaf, name), path)
                    changed = True
                    tick = CLOCK.tick()
                    os.utime(path, ns=(tick, tick))  # quarantine time, for pruning the oldest
                except FileNotFoundError:
                    continue  # evicted or quarantined by another process meanwhile
        except StoreUnavailable:
            raise
        except OSError as exc:
            raise unavailable("quarantine", path, exc) from exc
        finally:
            if changed:  # an entry already gone (evicted since its lookup) is not counted
                self._count("quarantined", f"quarantined_{reason}")
        prune_quarantine(folder, QUARANTINE_KEEP)
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
        leaf = leaf_dir(namespace_dir(self._root.path, ns_hex), key.hex)
        return self._committed_parts(leaf, key.hex) is not None

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

    def _put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer] | None, *, split: bool,
             via: tuple[int, Callable[[int], None]] | None = None) -> bool:
        """Write `data`, or (`via`: its size and a function writing it into a descriptor) have it
        written, as the part's file."""
        check_part(part)
        views = byte_views(data) if via is None else []
        self._check_open()
        leaf = self._leaf(key.hex)
        name = part_name(key.hex, part)
        if file_size(os.path.join(leaf, name)) is not None:
            return False
        eid = (self._ns_hex, key.raw)
        size = sum(len(v) for v in views) if via is None else via[0]
        victims = self._index.reserve(eid, size, self._max_bytes)
        if victims is None:
            self._count("puts_skipped")
            raise StoreUnavailable(
                errno.ENOSPC, f"store {self._root.path} is full: {size} bytes do not fit under max_bytes={self._max_bytes} "
                "even with every entry not being read evicted; raise GALAHAD_MAX_BYTES"
            )
        try:
            self._delete_evicted(victims)
            placed, tick = self._write_part(leaf, name, views, via, split)
        except BaseException as exc:
            self._index.release(size)
            if isinstance(exc, StoreUnavailable):
                self._count("puts_skipped")
                self._dirs.discard(leaf)  # in case the folder itself went away
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
            blob = self._medium.read(os.path.join(self._leaf(key.hex), part_name(key.hex, part)), tick)
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
            path = os.path.join(self._leaf(key.hex), part_name(key.hex, part))
            count = self._medium.read_into(path, target, tick, split=split)
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

    def _committed_parts(self, leaf: str, keyhex: str) -> dict[int, int] | None:
        """The entry's parts if it is committed: its marker reads and lists only present parts.

        Asked for every 64 tokens of a prompt on vLLM's engine thread, and again for the same
        entries on every turn of a conversation: a marker already read is known by its file's
        identity (inode, size, and the times a new marker is stamped with), so asking again
        costs one `lstat` of it, not an open, a read and a parse; its parts are looked at every
        time. Plain `os` calls, no buffered file object; a marker that is not a regular file
        (a link or a FIFO planted there) is no marker, and is never opened."""
        path = f"{leaf}/{marker_name(keyhex)}"
        try:
            st = os.lstat(path)
        except OSError as exc:
            if exc.errno in ABSENT:
                return None
            raise unavailable("look up", path, exc) from exc
        if not stat.S_ISREG(st.st_mode):
            return None
        known = self._markers.get(keyhex)
        if known is not None and known[0] == _identity(st):
            sizes: dict[int, int] | None = known[1]
        else:
            sizes = self._read_marker(path, keyhex)
        if sizes is None:
            return None
        for part, size in sizes.items():
            if file_size(f"{leaf}/{part_name(keyhex, part)}") != size:
                return None
        return sizes

    def _read_marker(self, path: str, keyhex: str) -> dict[int, int] | None:
        """Read and parse a marker, and remember it by the identity of the file read."""
        try:
            raw, st = read_regular_with_stat(path, marker.MAX_BYTES, follow_links=False)
        except NotARegularFile:  # a link or a FIFO planted there: no marker
            raw = b""
        except OSError as exc:
            if exc.errno in ABSENT:
                return None
            raise unavailable("read", path, exc) from exc
        sizes = marker.decode(raw)
        if sizes is None:
            self._markers.pop(keyhex, None)
            return None
        if len(self._markers) >= _MARKERS_KEPT:
            self._markers.clear()  # bounded; the next lookups read their markers again
        self._markers[keyhex] = (_identity(st), sizes)
        return sizes

    def _delete_evicted(self, victims: list[tuple[EntryId, int]]) -> None:
        """Remove evicted entries' files: the marker first, so no process offers them meanwhile."""
        for (ns_hex, raw), nbytes in victims:
            keyhex = raw.hex()
            leaf = leaf_dir(namespace_dir(self._root.path, ns_hex), keyhex)
            unlink_quietly(os.path.join(leaf, marker_name(keyhex)))
            for name in part_names(leaf, keyhex):
                unlink_quietly(os.path.join(leaf, name))
            self._count("evictions", amount=1)
            self._count("evicted_bytes", amount=nbytes)
        if victims:
            _log.debug("evicted %d entries from %s", len(victims), self._root.path)

    def _walk_committed(self) -> Iterator[ChainKey]:
        for first in listdir(self._ns_dir, _FANOUT):
            for second in listdir(os.path.join(self._ns_dir, first), _FANOUT):
                leaf = os.path.join(self._ns_dir, first, second)
                for name in listdir(leaf):
                    parsed = parse_name(name)
                    if parsed and parsed[1] is None and self._committed_parts(leaf, parsed[0]) is not None:
                        yield ChainKey.from_hex(parsed[0])

    # -- the background scan -----------------------------------------------------------------

    def _scan_loop(self) -> None:
        first, failed = True, False
        while not self._stop.is_set():
            seconds = 0.0
            try:
                report = scan_root(self._root.path, self._index, grace_ns=self._grace_ns, stop=self._stop)
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
        return leaf_dir(self._ns_dir, keyhex)

    def _write_part(self, leaf: str, name: str, views: Sequence[memoryview],
                    via: tuple[int, Callable[[int], None]] | None, split: bool) -> tuple[bool, int]:
        """Write one part into its leaf folder: (placed, its tick). A leaf this process made
        before and that has gone since (the store's folder removed under a running server) is
        made again, once: the temp file's create failed, nothing was written."""
        known = leaf in self._dirs
        try:
            return self._write_in_leaf(leaf, name, views, via, split)
        except StoreUnavailable as exc:
            if not known or exc.errno not in ABSENT:
                raise
            self._dirs.discard(leaf)
        return self._write_in_leaf(leaf, name, views, via, split)

    def _write_in_leaf(self, leaf: str, name: str, views: Sequence[memoryview],
                       via: tuple[int, Callable[[int], None]] | None, split: bool) -> tuple[bool, int]:
        self._make_leaf(leaf)
        tick = CLOCK.tick()
        if via is None:
            return self._medium.write_new(leaf, name, views, tick, split=split), tick
        return self._medium.write_new_via(leaf, name, via[0], via[1], tick), tick

    def _make_leaf(self, leaf: str) -> None:
        if leaf not in self._dirs:
            try:
                make_dirs(leaf)
            except OSError as exc:
                raise unavailable("create the folder", leaf, exc) from exc
            self._dirs.add(leaf)

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
