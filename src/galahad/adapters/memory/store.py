"""The reference block store: dictionaries behind a lock.

It states the `BlockStore` contract in the plainest code we could write, so that
tests/property/test_store_contract.py can run every other adapter against it. It is written
independently of the filesystem store on purpose (it shares no code with it): a shared helper
would make both wrong together.

Recency, for the size cap: every entry carries a tick from a counter. A new part, a commit
that writes its marker, and a read (`get`, `read_into`, `open_reader`) give the entry a fresh
tick; nothing else does (a `put` of an existing part, a `commit` of a committed entry,
`has_part`, `part_size`, `is_committed`). Eviction removes whole entries, lowest tick first,
never the entry being written to, never an entry being read (one with an open reader); when
that cannot make room for a put, nothing is evicted and the put is skipped, while `evict`
removes what it can.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.ports.store import Buffer, byte_views, check_part, check_reason, read_stepwise

__all__ = ["InMemoryBlockStore"]


class InMemoryBlockStore:
    """A `BlockStore` in memory: the reference the filesystem store is checked against.

    `max_bytes` caps the bytes of all parts (None: unlimited). `close()` makes every later call
    raise `StoreUnavailable`; contents are kept only by the object itself.
    """

    def __init__(self, *, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._parts: dict[ChainKey, dict[int, bytes]] = {}
        self._markers: dict[ChainKey, tuple[int, ...]] = {}
        self._ticks: dict[ChainKey, int] = {}
        self._readers: dict[ChainKey, int] = {}  # open readers per entry: not evicted meanwhile
        self._clock = 0
        self._closed = False
        self._counts: dict[str, int] = {"evictions": 0, "evicted_bytes": 0, "quarantined": 0, "puts_skipped": 0}

    # -- the port ---------------------------------------------------------------------------

    def put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer]) -> bool:
        check_part(part)
        blob = b"".join(byte_views(data))
        with self._lock:
            self._check_open()
            if part in self._parts.get(key, {}):
                return False
            if not self._make_room(len(blob), keep=key):
                self._counts["puts_skipped"] += 1
                raise StoreUnavailable(errno.ENOSPC, f"store full: {len(blob)} bytes do not fit under max_bytes={self._max_bytes}")
            self._parts.setdefault(key, {})[part] = blob
            self._touch(key)
            return True

    def part_size(self, key: ChainKey, part: int) -> int | None:
        check_part(part)
        with self._lock:
            self._check_open()
            blob = self._parts.get(key, {}).get(part)
            return None if blob is None else len(blob)

    def open_reader(self, key: ChainKey, part: int) -> _BlobReader | None:
        check_part(part)
        with self._lock:
            self._check_open()
            blob = self._parts.get(key, {}).get(part)
            if blob is None:
                return None
            self._touch(key)
            self._readers[key] = self._readers.get(key, 0) + 1
        return _BlobReader(blob, lambda: self._reader_closed(key))

    def _reader_closed(self, key: ChainKey) -> None:
        with self._lock:
            left = self._readers[key] - 1
            if left:
                self._readers[key] = left
            else:
                del self._readers[key]

    def has_part(self, key: ChainKey, part: int) -> bool:
        check_part(part)
        with self._lock:
            self._check_open()
            return part in self._parts.get(key, {})

    def resident_share(self, key: ChainKey, part: int) -> float | None:
        """Every stored byte is in memory: 1.0 for a part held, None for one absent."""
        return 1.0 if self.has_part(key, part) else None

    def commit(self, key: ChainKey, parts: tuple[int, ...]) -> bool:
        wanted = _normalise_parts(parts)
        with self._lock:
            self._check_open()
            present = self._parts.get(key, {})
            if not all(p in present for p in wanted):
                return False
            if self._is_committed(key):
                return True
            self._markers[key] = wanted
            self._touch(key)
            return True

    def is_committed(self, key: ChainKey) -> bool:
        with self._lock:
            self._check_open()
            return self._is_committed(key)

    def first_committed(self, keys: Sequence[ChainKey]) -> int | None:
        """`FindsCommitted`: the first of `keys` committed, under one hold of the lock."""
        with self._lock:
            self._check_open()
            return next((i for i, key in enumerate(keys) if self._is_committed(key)), None)

    def quarantine(self, key: ChainKey, reason: str) -> bool:
        check_reason(reason)
        with self._lock:
            self._check_open()
            if not self._drop(key):
                return False
            self._counts["quarantined"] += 1
            name = f"quarantined_{reason}"
            self._counts[name] = self._counts.get(name, 0) + 1
            return True

    def committed(self) -> Iterator[ChainKey]:
        with self._lock:
            self._check_open()
            keys = [k for k in self._markers if self._is_committed(k)]
        return iter(keys)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    # -- beyond the port: the same extras as FilesystemBlockStore ----------------------------

    def get(self, key: ChainKey, part: int) -> bytes | None:
        check_part(part)
        with self._lock:
            self._check_open()
            blob = self._parts.get(key, {}).get(part)
            if blob is not None:
                self._touch(key)
            return blob

    def read_into(self, key: ChainKey, part: int, buf: memoryview) -> int | None:
        check_part(part)
        target = memoryview(buf).cast("B")
        if target.readonly:
            raise ValueError("read_into needs a writable buffer")
        with self._lock:
            self._check_open()
            blob = self._parts.get(key, {}).get(part)
            if blob is None:
                return None
            if len(target) < len(blob):
                raise ValueError(f"buffer of {len(target)} bytes is too small for a part of {len(blob)} bytes")
            target[: len(blob)] = blob
            self._touch(key)
            return len(blob)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def evict(self, to_bytes: int) -> int:
        """Evict least recently used entries until `used_bytes() <= to_bytes`; return how many."""
        if not isinstance(to_bytes, int) or to_bytes < 0:
            raise ValueError(f"to_bytes must be a non-negative int, got {to_bytes!r}")
        with self._lock:
            self._check_open()
            victims = self._victims(self._used() - to_bytes, keep=None, all_or_nothing=False) or []
            for key in victims:
                self._evict(key)
            return len(victims)

    def get_many(self, items: Iterable[tuple[ChainKey, int]]) -> list[bytes | None]:
        """`get` of each (key, part), in order."""
        return [self.get(key, part) for key, part in items]

    def read_many(self, items: Iterable[tuple[ChainKey, int, memoryview]]) -> list[int | None]:
        """`read_into` of each (key, part, buffer), in order."""
        return [self.read_into(key, part, buf) for key, part, buf in items]

    def put_many(self, items: Iterable[tuple[ChainKey, int, Buffer | Sequence[Buffer]]]) -> list[bool]:
        """`put` of each (key, part, data); raises the first `StoreUnavailable` after trying all."""
        results: list[bool] = []
        failure: StoreUnavailable | None = None
        for key, part, data in items:
            try:
                results.append(self.put(key, part, data))
            except StoreUnavailable as exc:
                failure = failure or exc
                results.append(False)
        if failure is not None:
            raise failure
        return results

    def evictions(self) -> int:
        """Entries evicted since open (`stats()["evictions"]`), read without the lock: one read of
        an int the eviction replaces whole."""
        return self._counts["evictions"]

    def stats(self) -> dict[str, int]:
        """Counters (evictions, quarantines by reason, skipped puts) and the current size."""
        with self._lock:
            out = dict(self._counts)
            out["used_bytes"] = self._used()
            out["entries"] = len(self._parts)
            if self._max_bytes is not None:
                out["max_bytes"] = self._max_bytes
            return out

    # -- inside the lock ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(errno.EBADF, "the in-memory store is closed")

    def _touch(self, key: ChainKey) -> None:
        self._clock += 1
        self._ticks[key] = self._clock

    def _used(self) -> int:
        return sum(len(b) for parts in self._parts.values() for b in parts.values())

    def _entry_bytes(self, key: ChainKey) -> int:
        return sum(len(b) for b in self._parts.get(key, {}).values())

    def _is_committed(self, key: ChainKey) -> bool:
        listed = self._markers.get(key)
        present = self._parts.get(key, {})
        return listed is not None and all(p in present for p in listed)

    def _victims(self, excess: int, keep: ChainKey | None, all_or_nothing: bool = True) -> list[ChainKey] | None:
        """The least recently used entries (not `keep`, none being read) whose removal frees
        `excess` bytes; when they are not enough, None, or (not `all_or_nothing`) all there are."""
        chosen: list[ChainKey] = []
        for key in sorted(self._parts, key=lambda k: self._ticks[k]):
            if excess <= 0:
                break
            if key != keep and key not in self._readers:
                chosen.append(key)
                excess -= self._entry_bytes(key)
        return chosen if excess <= 0 or not all_or_nothing else None

    def _make_room(self, size: int, keep: ChainKey) -> bool:
        if self._max_bytes is None:
            return True
        victims = self._victims(self._used() + size - self._max_bytes, keep=keep)
        if victims is None:
            return False
        for key in victims:
            self._evict(key)
        return True

    def _evict(self, key: ChainKey) -> None:
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += self._entry_bytes(key)
        self._drop(key)

    def _drop(self, key: ChainKey) -> bool:
        """Forget the entry; whether it had a marker or a part."""
        had = self._markers.pop(key, None) is not None
        had = bool(self._parts.pop(key, None)) or had
        self._ticks.pop(key, None)
        return had


class _BlobReader:
    """A `PartReader` on the bytes a part had when it was opened."""

    def __init__(self, blob: bytes, on_close: Callable[[], None]) -> None:
        self._blob: memoryview | None = memoryview(blob)
        self._on_close = on_close
        self._lock = threading.Lock()
        self._size = len(blob)

    @property
    def size(self) -> int:
        return self._size

    def preadv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        blob = self._blob
        if blob is None:
            raise ValueError("read from a closed reader")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"a read offset is a non-negative int, got {offset!r}")
        targets = [memoryview(buf).cast("B") for buf in buffers]
        if any(t.readonly for t in targets):
            raise ValueError("preadv needs writable buffers")
        done = 0
        for target in targets:
            piece = blob[offset + done : offset + done + len(target)]
            target[: len(piece)] = piece
            done += len(piece)
            if len(piece) < len(target):
                break
        return done

    def read_stepwise(self, offset: int, view: memoryview, step: int, each: Callable[[memoryview], object]) -> int:
        return read_stepwise(self, offset, view, step, each)

    def close(self) -> None:
        with self._lock:
            was_open, self._blob = self._blob is not None, None
        if was_open:
            self._on_close()

    def __enter__(self) -> _BlobReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _normalise_parts(parts: tuple[int, ...]) -> tuple[int, ...]:
    for part in parts:
        check_part(part)
    if not parts:
        raise ValueError("an entry commits at least one part")
    return tuple(sorted(set(parts)))
