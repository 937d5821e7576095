"""The filesystem block store: one namespace of a store root on a local disk, or on a shared
filesystem several machines mount (docs/store.md).

Every question about what exists or is committed is answered from the filesystem, so several
processes (the ranks of one server, several servers sharing a folder, on one machine or many)
see each other's entries at once. The in-memory index (index.py) only serves the size cap; a background scan fills it at
open (open itself does not walk the folder) and refreshes it every `rescan_s` seconds.

Every folder below the root is reached through tree.py: opened relative to its parent's
descriptor, never through a symbolic link, and trusted only when it is a folder of this user
that nobody else can write. Files are read, written, renamed and removed relative to their
folder's descriptor. What lies under a refused folder is absent: a miss, never an error.

This class holds the port and the size cap together; the pieces live beside it: bytes in and
out of files (medium.py, reader.py), commit markers (commit.py, marker.py), quarantine and
eviction (removal.py), the background scan (scan.py), the root and its namespaces (root.py),
and what happens when the filesystem stops answering (outage.py: every call goes through it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from galahad.adapters.fs.commit import Markers
from galahad.adapters.fs.folder import read_only
from galahad.adapters.fs.index import CLOCK, EntryId, Index
from galahad.adapters.fs.layout import leaf_dir, marker_name, namespace_dir, namespace_name, part_name
from galahad.adapters.fs.medium import Medium, run_all, unavailable
from galahad.adapters.fs.outage import OutageGuard
from galahad.adapters.fs.reader import FileReader
from galahad.adapters.fs.removal import quarantine_entry, remove_entry
from galahad.adapters.fs.residency import resident_share
from galahad.adapters.fs.root import StoreRoot, ensure_namespace
from galahad.adapters.fs.scan import Scanner
from galahad.adapters.fs.tree import Folder, FolderTree, RefusedFolder, names_in
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.domain.namespace import Namespace
from galahad.format.fanout import LastingPool
from galahad.ports.store import Buffer, byte_views, check_part, check_reason

__all__ = ["FilesystemBlockStore"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")
_FANOUT = re.compile(r"[0-9a-f]{2}")
# a write whose folder has gone meanwhile opens (or makes) the folders again this often, waiting
# a little longer each time (1.5 s in all: a FUSE client such as GlusterFS's keeps a name it saw
# removed, or not yet made, for a second)
_MAKE_TRIES = 6
# commit markers looked up in one ask of the outage guard on network storage (`first_committed`):
# at the 278 us a miss costs on a GlusterFS mount (docs/benchmarks.md), 18 ms, far inside its bound
_ASKS_AT_ONCE = 64
SHARED_RESCAN_S = 30.0  # at most this between scans on a shared filesystem: other nodes' writes count


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
        self._cap_is_recorded = max_bytes is None  # then each scan reads the manifest's cap again
        if self._root.shared and rescan_s is not None:
            rescan_s = min(rescan_s, SHARED_RESCAN_S)
        self._ns_hex = ns_hex
        self._ns_dir = namespace_dir(self._root.path, ns_hex)
        self._ns_rel = namespace_name(ns_hex)
        self._local = self._root.remote_fstype is None
        self._guard = OutageGuard(self._root.path, bounded=not self._local, on_back=lambda: self._tree.forget())
        self._tree = FolderTree(self._root.path, on_root=self._guard.moved)
        try:
            self._fresh, self.read_only = self._open_namespace(canonical_json)
        except BaseException:
            self._tree.close()
            self._guard.close()
            raise
        self._namespace_doc = (self._root.namespace_info(ns_hex) if canonical_json is None
                               else json.loads(canonical_json))
        if self.read_only:
            _log.warning("[galahad] store %s is read-only (%s): entries already there are served, nothing new "
                         "is saved; remount it read-write or point GALAHAD_CACHE_DIR at a writable folder",
                         self._root.path, self.read_only)
        self._pool = LastingPool(threads, thread_name_prefix="galahad-io")  # works on while the
        # interpreter exits, for a save queued before; `close` stops it for good
        self._medium = Medium(self._pool)
        self._index = Index()
        self._markers = Markers(self._tree)  # commit markers, those read so far remembered
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {"evictions": 0, "evicted_bytes": 0, "quarantined": 0, "puts_skipped": 0}
        self._closed = False
        self._scanner = Scanner(self._tree, self._index, grace_ns=int(stale_grace_s * 1e9), rescan_s=rescan_s,
                                after=self._after_scan, paused=lambda: self._guard.out)
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
            return not any(_FANOUT.fullmatch(n) for n in names_in(ns.fd)), read_only(ns.fd)
        except OSError as exc:
            raise unavailable("list", self._ns_dir, exc) from exc
        finally:
            self._tree.give_back(ns)

    # -- the port ---------------------------------------------------------------------------

    def put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer]) -> bool:
        return self._fenced(self._put, key, part, data, True)

    def put_placed(self, key: ChainKey, part: int, size: int, place: Callable[[int, str, int], bool]) -> bool:
        """`PlacesParts`: the part's file written and named by `place(dir_fd, name, tick)` (a
        writer process) in the leaf folder opened and checked here; every folder step, the size
        cap and the index as for `put`."""
        return self._fenced(self._place, key, part, size,
                            lambda fd, folder, name, tick: self._medium.write_placed(fd, folder, name, place, tick))

    def part_size(self, key: ChainKey, part: int) -> int | None:
        return self._guard.call(self._part_size, key, part)

    def _part_size(self, key: ChainKey, part: int) -> int | None:
        check_part(part)
        self._check_open()
        keyhex = key.hex
        found = self._tree.find(leaf_dir(self._ns_rel, keyhex), part_name(keyhex, part))
        if found is None:
            return None
        self._tree.give_back(found[0])
        return found[1].st_size if stat.S_ISREG(found[1].st_mode) else None

    def open_reader(self, key: ChainKey, part: int) -> FileReader | None:
        return self._fenced(self._open_reader, key, part)

    def _open_reader(self, key: ChainKey, part: int) -> FileReader | None:
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
        return self._guard.call(self._with_part, key.hex, part,
                                lambda leaf, name, _path: resident_share(name, dir_fd=leaf.fd))

    def commit(self, key: ChainKey, parts: tuple[int, ...]) -> bool:
        return self._fenced(self._commit, key, parts)

    def _commit(self, key: ChainKey, parts: tuple[int, ...]) -> bool:
        wanted = _normalise_parts(parts)
        self._check_open()
        committed, written = self._markers.commit(leaf_dir(self._ns_rel, key.hex), key.hex, wanted)
        if written is not None:
            self._index.learn((self._ns_hex, key.raw), *written)
        return committed

    def is_committed(self, key: ChainKey) -> bool:
        return self._guard.call(self._is_committed, key)

    def first_committed(self, keys: Sequence[ChainKey]) -> int | None:
        """`FindsCommitted`: one ask of the outage guard for all of `keys` on a local disk; on
        network storage one for each `_ASKS_AT_ONCE` of them, each within the guard's bound (a
        miss there is a round trip to the server: a long prompt's thousands of block ends in one
        ask could outlast the bound and put a store that answers out)."""
        if self._local:
            return self._guard.call(self._first_committed, keys)
        for at in range(0, len(keys), _ASKS_AT_ONCE):
            found = self._guard.call(self._first_committed, keys[at : at + _ASKS_AT_ONCE])
            if found is not None:
                return at + found
        return None

    def _first_committed(self, keys: Sequence[ChainKey]) -> int | None:
        is_committed = self._is_committed
        for i, key in enumerate(keys):
            if is_committed(key):
                return i
        return None

    def unseen(self, key: ChainKey) -> bool:
        """`KnowsSeen`: a scan has gone through the whole root and the index does not hold the
        entry (no system call, no lock). Until then, or where every scan failed, it cannot tell."""
        return self._scanner.indexed.is_set() and not self._index.knows((self._ns_hex, key.raw))

    def _is_committed(self, key: ChainKey) -> bool:
        if self._closed:
            self._check_open()
        keyhex = key.raw.hex()
        # Most asks miss (a new prompt is asked at every block end: 127 times at 2k tokens). A
        # marker absent by its path is absent whatever the folders on the way are (as in
        # `FolderTree.find`); on a local disk `os.access` says so without raising, in a third of
        # a full ask. Not on network storage: there an unreachable server must put the store
        # out (StoreUnavailable), and `os.access` cannot tell that from an absent marker.
        if self._local and not os.access(f"{leaf_dir(self._ns_dir, keyhex)}/{marker_name(keyhex)}", os.F_OK,
                                         follow_symlinks=False):
            return False
        return self._markers.parts(leaf_dir(self._ns_rel, keyhex), keyhex) is not None

    def quarantine(self, key: ChainKey, reason: str) -> bool:
        check_reason(reason)
        self._check_open()
        self._index.remove((self._ns_hex, key.raw))
        return self._fenced(quarantine_entry, self._tree, self._ns_rel, key.hex, reason,
                            lambda: self._count("quarantined", f"quarantined_{reason}"))

    def committed(self) -> Iterator[ChainKey]:
        self._check_open()
        self._guard.check()
        return self._markers.walk(self._ns_rel)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._scanner.stop()
        self._guard.close()
        self._pool.shutdown(wait=True)
        self._tree.close()

    # -- beyond the port (tests, tools and benchmarks; the in-memory store has the same) ------

    def get(self, key: ChainKey, part: int) -> bytes | None:
        return self._fenced(self._get, key, part, CLOCK.tick())

    def read_into(self, key: ChainKey, part: int, buf: memoryview) -> int | None:
        return self._fenced(self._read_into, key, part, buf, CLOCK.tick(), True)

    def used_bytes(self) -> int:
        """Bytes of all parts in the root (all namespaces) known to this process: what the cap
        limits. Exact once `wait_indexed()` is True, apart from other processes' changes since."""
        return self._index.used()

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
        only in its tensor / pipeline parallel sizes (`StoreRoot.other_layouts`): the same model
        saved by a differently split server."""
        if self._namespace_doc is None:
            return []
        return self._root.other_layouts(self._ns_hex, self._namespace_doc)

    def committed_in(self, ns_hex: str, key: ChainKey) -> bool:
        """Whether `key` is committed (marker and every part present) in namespace `ns_hex` of this
        root: a few stats in one leaf folder, nothing read."""
        self._check_open()
        keyhex = key.hex
        return self._guard.call(self._markers.parts, leaf_dir(namespace_name(ns_hex), keyhex), keyhex) is not None

    def recent(self, wait_s: float | None = None) -> list[tuple[ChainKey, dict[int, int]]]:
        """`KnowsRecency.recent`: the entries of this namespace the index knows, most recently
        used first, with their parts' sizes; waits up to `wait_s` for the scan started at open
        (after a restart that scan is what knows the entries and when each was last used)."""
        self._check_open()
        self.wait_indexed(wait_s)
        return [(ChainKey(raw), parts) for raw, parts in self._index.recent(self._ns_hex)]

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Wait for the scan started at open to finish; whether it has."""
        return self._scanner.ready.wait(timeout)

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
        return self._batch(lambda item: self._fenced(self._get, *item), todo)

    def read_many(self, items: Iterable[tuple[ChainKey, int, memoryview]]) -> list[int | None]:
        """`read_into` of each (key, part, buffer), in parallel; recency recorded in the order given."""
        todo = [(key, part, buf, CLOCK.tick()) for key, part, buf in items]
        return self._batch(lambda item: self._fenced(self._read_into, *item, False), todo)

    def put_many(self, items: Iterable[tuple[ChainKey, int, Buffer | Sequence[Buffer]]]) -> list[bool]:
        """`put` of each (key, part, data), in parallel. When some fail, the others are still
        stored and the first failure is raised once all have ended."""
        return self._batch(lambda item: self._fenced(self._put, *item, False), list(items))

    def evictions(self) -> int:
        """Entries evicted since open (`stats()["evictions"]`), read without the lock: one read of
        an int the eviction replaces whole."""
        return self._counts["evictions"]

    def stats(self) -> dict[str, int]:
        """Counters (evictions, quarantines by reason, skipped puts) and the size accounting."""
        with self._lock:
            out = dict(self._counts)
        out["used_bytes"] = self._index.used()
        out["entries"] = len(self._index)
        out["max_bytes"] = self._max_bytes
        out["indexed"] = int(self._scanner.ready.is_set())
        return out

    def __enter__(self) -> FilesystemBlockStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes and reads --------------------------------------------------------------------

    def _fenced(self, fn: Callable[..., _R], *args: Any) -> _R:
        """`fn(*args)` on this thread: refused at once while the store's filesystem is out
        (outage.py), and its failure looked at (one meaning the filesystem is unreachable puts
        the store out)."""
        self._guard.check()
        try:
            return fn(*args)
        except StoreUnavailable as exc:
            self._guard.note(exc)
            raise

    def _put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer], split: bool) -> bool:
        """Write `data` as the part's file."""
        views = byte_views(data)
        return self._place(key, part, sum(len(v) for v in views),
                           lambda fd, folder, name, tick: self._medium.write_new(fd, folder, name, views, tick, split=split))

    def _place(self, key: ChainKey, part: int, size: int, write: Callable[[int, str, str, int], bool]) -> bool:
        """Make room for a part of `size` bytes and have `write(folder_fd, folder, name, tick)`
        write it atomically into its leaf folder (`_write_part`)."""
        check_part(part)
        self._check_open()
        rel = leaf_dir(self._ns_rel, key.hex)
        name = part_name(key.hex, part)
        found = self._tree.find(rel, name)
        if found is not None:
            self._tree.give_back(found[0])
            return False
        eid = (self._ns_hex, key.raw)
        victims = self._index.reserve(eid, size, self._max_bytes)
        if victims is None:
            self._count("puts_skipped")
            raise StoreUnavailable(
                errno.ENOSPC, f"store {self._root.path} is full: {size} bytes do not fit under max_bytes={self._max_bytes} "
                "even with every entry not being read evicted; raise GALAHAD_MAX_BYTES"
            )
        try:
            self._delete_evicted(victims)
            placed, tick = self._write_part(rel, name, write)
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

    def _read_into(self, key: ChainKey, part: int, buf: memoryview, tick: int, split: bool) -> int | None:
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

    def _delete_evicted(self, victims: list[tuple[EntryId, int]]) -> None:
        """Remove evicted entries' files (`removal.remove_entry`), counting each."""
        for (ns_hex, raw), nbytes in victims:
            remove_entry(self._tree, ns_hex, raw)
            self._count("evictions", amount=1)
            self._count("evicted_bytes", amount=nbytes)
        if victims:
            _log.debug("evicted %d entries from %s", len(victims), self._root.path)

    # -- helpers -----------------------------------------------------------------------------

    def _after_scan(self) -> None:
        """After each scan: the cap the manifest records now (one cap for every server sharing the
        root; one may have set GALAHAD_MAX_BYTES), then evict down to it."""
        if self._cap_is_recorded:
            cap = self._root.recorded_cap()
            if cap is not None:
                self._max_bytes = cap
        self._delete_evicted(self._index.trim(self._max_bytes))

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

    def _write_part(self, rel: str, name: str, write: Callable[[int, str, str, int], bool]) -> tuple[bool, int]:
        """`write` one part into its leaf folder (made if absent): (placed, its tick). A folder step
        that fails as absent (ENOENT: the store's folder removed under a running server, or on a
        shared network filesystem now and then while other nodes write beside it) opens or makes
        the folders again, up to `_MAKE_TRIES` times: the failed step wrote nothing. A leaf this
        store does not trust raises `RefusedFolder`: nothing is written there."""
        for attempt in range(_MAKE_TRIES):
            if attempt > 1:  # the first retry at once (a folder removed here); then the cache's time
                time.sleep(0.025 * 2 ** attempt)
            try:
                leaf = self._tree.borrow(rel, create=True, fresh=True)
                if leaf is None:  # made, yet absent when opened (a network filesystem client, now and then)
                    raise StoreUnavailable(errno.ENOENT, f"cannot create the folder {self._tree.path(rel)}")
            except RefusedFolder:
                raise
            except StoreUnavailable as exc:
                if exc.errno != errno.ENOENT or attempt + 1 == _MAKE_TRIES:
                    raise
                self._tree.renew(rel)
                continue
            try:
                tick = CLOCK.tick()
                return write(leaf.fd, leaf.path, name, tick), tick
            except StoreUnavailable as exc:
                if exc.errno != errno.ENOENT or attempt + 1 == _MAKE_TRIES:
                    raise
            finally:
                self._tree.give_back(leaf)
            self._tree.renew(rel)
        raise AssertionError("not reached")

    def _count(self, *names: str, amount: int = 1) -> None:
        with self._lock:
            for name in names:
                self._counts[name] = self._counts.get(name, 0) + amount


def _normalise_parts(parts: tuple[int, ...]) -> tuple[int, ...]:
    for part in parts:
        check_part(part)
    if not parts:
        raise ValueError("an entry commits at least one part")
    return tuple(sorted(set(parts)))
