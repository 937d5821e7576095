"""The block store port: a core `BlockStore`, its `PartReader`, and the optional capabilities.

Everything a use case may ask of a store, in one place (contracts on each class below; checked
against every adapter by tests/property/test_store_contract.py):

Core, `BlockStore` (every store has these; the use cases in galahad.app call each of them):
    put(key, part, data) -> bool            save a part, atomically and durably (False: present)
    part_size(key, part) -> int | None      a part's size in bytes, reading nothing
    open_reader(key, part) -> PartReader    read a part range by range, straight into place
    has_part(key, part) -> bool             whether a save of the part would be a no-op
    resident_share(key, part) -> float      share of a part in memory now (pricing a load)
    commit(key, parts) -> bool              an entry becomes visible once all its parts are
    is_committed(key) -> bool               what a lookup asks, entry by entry
    quarantine(key, reason) -> bool         set a damaged or foreign entry aside for every rank
    committed() -> Iterator[ChainKey]       every committed entry (an operator's reset)
    close() -> None

Optional capabilities, found with `isinstance` (a store or reader without one still works):
    HashedReader     a `PartReader` that reads and hashes a checksum frame in one call
                     (galahad.format.codec's checksum-only path)
    ShareableReader  a `PartReader` whose descriptor a helper process may read from
                     (galahad.app.load: loads read by helper processes)
    FindsCommitted   a `BlockStore` that answers many `is_committed` asks in one call
                     (galahad.app.service: a layer-order lookup asks at every block end)
    PlacesParts      a `BlockStore` whose new part files another process may write and name
                     in the folder the store checked (galahad.app.save: writer processes)
    KnowsRecency     a `BlockStore` that lists its entries most recently used first
                     (galahad.app.readahead: what a restarted worker reads ahead)
    StoreStats       a `BlockStore` that counts what it did, evictions among them
                     (galahad.app.tally: the `evicted` counter)

Beyond the port: both adapters (galahad.adapters.fs, galahad.adapters.memory) also offer
`get`, `read_into`, `used_bytes`, `evict`, `get_many`, `read_many` and `put_many`. Tests, tools
and benchmarks call them on the concrete classes, and the contract tests hold the two adapters
to the same answers, but no use case needs them, so they are not part of `BlockStore`.
"""

from __future__ import annotations

import re

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeAlias, runtime_checkable

from galahad.domain.chain import ChainKey

__all__ = [
    "MAX_PART",
    "BlockStore",
    "Buffer",
    "FindsCommitted",
    "HashedReader",
    "KnowsRecency",
    "PartReader",
    "PlacesParts",
    "ShareableReader",
    "StoreStats",
    "byte_views",
    "check_part",
    "check_reason",
    "read_stepwise",
]

Buffer: TypeAlias = bytes | bytearray | memoryview


class PartReader(Protocol):
    """One part of a `BlockStore`, held open for reads of byte ranges (`BlockStore.open_reader`).

    Contract (tests/property/test_store_contract.py):
    - `size` is the part's size in bytes; the reader reads the part as it was when opened, whole,
      even if it is quarantined, removed by another process or the store closed meanwhile. While
      it is open, this store does not evict the part's entry.
    - `preadv(offset, buffers)` fills `buffers` (writable byte views), in order, with the part's
      bytes from `offset` on, and returns their count: less than the buffers hold only where the
      part ends (0 from `size` on). Several threads may call it at once. (The filesystem store
      reads straight into `buffers` with `os.preadv`, outside the interpreter lock.)
    - `read_stepwise(offset, view, step, each)` fills the writable byte view `view` with the
      part's bytes from `offset` on, `step` bytes at a time (the last piece may be shorter), and
      calls `each(piece)` on every piece as soon as it is read, in order (a checksum over bytes
      still in the core's cache). It returns the count read: less than `len(view)` only where the
      part ends, and then the piece the part ends in is not handed to `each`. The same bytes, the
      same errors and the same count as `preadv` of the pieces one after the other
      (`read_stepwise` below does exactly that; a store may do it with less work per piece). An
      exception from `each` passes through, and nothing more is read.
    - A failing medium raises `StoreUnavailable`; a negative offset, a read-only buffer or a step
      below 1 is a `ValueError`; so is a read after `close()`.
    - `close()` (or leaving a `with` block) releases the part; it may be called more than once.
    """

    @property
    def size(self) -> int: ...

    def preadv(self, offset: int, buffers: Sequence[memoryview]) -> int: ...

    def read_stepwise(self, offset: int, view: memoryview, step: int, each: Callable[[memoryview], object]) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> PartReader: ...

    def __exit__(self, *exc_info: object) -> None: ...


@runtime_checkable
class BlockStore(Protocol):
    """Sealed block files (opaque bytes) of one namespace, by entry key and rank part.

    Contract (checked against every adapter by tests/property/test_store_contract.py):
    - After `put`, `open_reader` gives a `PartReader` on exactly the bytes put (the
      concatenation, when `data` is a sequence of buffers), and `part_size` their count; an
      unknown part gives None from both, and `has_part` False. A part with an open reader counts
      as being read. `part_size`, `has_part` and `resident_share` read nothing.
    - A read (`open_reader`) makes its entry the most recently used.
    - `put` is atomic and durable when it returns: no reader ever sees part of a blob, a crash
      leaves either the whole blob or nothing. Putting a part that exists is a cheap no-op
      (returns False).
    - `commit(key, parts)` records the entry as committed iff every listed part is present and
      returns whether it did; `is_committed` and `committed()` see committed entries only.
    - `quarantine(key, reason)` uncommits the entry and removes (or moves aside) all its parts;
      afterwards `is_committed` is False and `open_reader` gives None for every part. It returns
      whether there was anything to set aside (a marker or a part), and only then counts
      `quarantined`: an entry already gone (evicted since it was looked up) is not counted as
      damage.
    - A size cap, where a store has one, removes whole entries, least recently used first,
      never a part being read.
    - A failing medium raises `StoreUnavailable` (never a bare OSError), except that a local
      store may answer `is_committed` False where the marker's path cannot be looked up (a miss
      costs one call; its reads and writes still report the medium); a full disk on `put`
      raises `StoreUnavailable` and loses nothing already stored.
    - Everything survives `close()` and reopening the same folder (a restart), except entries
      never committed, which a reopen may remove after a grace period.
    """

    def put(self, key: ChainKey, part: int, data: Buffer | Sequence[Buffer]) -> bool: ...

    def part_size(self, key: ChainKey, part: int) -> int | None: ...

    def open_reader(self, key: ChainKey, part: int) -> PartReader | None: ...

    def has_part(self, key: ChainKey, part: int) -> bool: ...

    def resident_share(self, key: ChainKey, part: int) -> float | None:
        """Share (0.0-1.0) of the part's bytes a read would find in memory (the page cache) now;
        None when the part is absent or the medium cannot tell. Reads nothing."""
        ...

    def commit(self, key: ChainKey, parts: tuple[int, ...]) -> bool: ...

    def is_committed(self, key: ChainKey) -> bool: ...

    def quarantine(self, key: ChainKey, reason: str) -> bool: ...

    def committed(self) -> Iterator[ChainKey]: ...

    def close(self) -> None: ...


MAX_PART = 1 << 16
_REASON = re.compile(r"[a-z0-9_-]{1,32}")


def byte_views(data: Buffer | Sequence[Buffer]) -> list[memoryview]:
    """`data` as byte views: one buffer (any buffer-protocol object), or a sequence of buffers."""
    if isinstance(data, Sequence) and not isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(item).cast("B") for item in data]
    return [memoryview(data).cast("B")]


@runtime_checkable
class HashedReader(Protocol):
    """A `PartReader` that reads a checksum frame and hashes it in one call, with less work per
    piece than `read_stepwise` with a hash's `update` (the filesystem store's compiled loop,
    `galahad.adapters.posix.readhash`).

    `read_hashed(offset, view, seed)` is `read_stepwise(offset, view, step, state.update)` for a
    fresh XXH3-128 state seeded with `seed`, returning the count read and that state's digest
    (16 bytes, canonical order) of exactly the bytes read: the same bytes in `view`, the same
    count and the same errors. It returns None, having read nothing, where it cannot take the read
    (no compiled loop, a closed reader): the caller then uses `read_stepwise`."""

    def read_hashed(self, offset: int, view: memoryview, seed: int) -> tuple[int, bytes] | None: ...


@runtime_checkable
class ShareableReader(Protocol):
    """A `PartReader` whose bytes another process of this user may read from a descriptor:
    `shareable_fd()` is one open on the part that buffered `os.preadv` reads as the reader would
    (the descriptor stays the reader's: the other process gets a copy), or None when it has none
    (closed)."""

    def shareable_fd(self) -> int | None: ...


@runtime_checkable
class PlacesParts(Protocol):
    """A `BlockStore` whose new part files another process of this user may write and name:
    `put_placed(key, part, size, place)` is `put` of a part of `size` bytes where
    `place(dir_fd, name, tick_ns)` writes the file `name` into the folder open on `dir_fd`
    atomically and durably (a temp file there, stamped with `tick_ns`, fsynced, linked to `name`
    only if it holds `size` bytes and the name is free, the folder fsynced; the store has just
    found the name absent), returning whether it took the name, and raising `OSError` where the
    disk or the folder refused a step. The store does every folder step, its checks, the size cap
    and its record of the part as `put` does: a no-op returning False when the part exists,
    `StoreUnavailable` when the medium fails. What the writer processes of a GPU worker write
    through (`galahad.adapters.helpers`)."""

    def put_placed(self, key: ChainKey, part: int, size: int, place: Callable[[int, str, int], bool]) -> bool: ...


@runtime_checkable
class FindsCommitted(Protocol):
    """A `BlockStore` that asks `is_committed` of many keys in one call: `first_committed(keys)`
    is the index of the first of `keys`, in order, that `is_committed` holds, or None when none
    does; the same answers and errors as asking each in turn, with the store's fixed cost of an
    ask (a network store's bounded wait on its own threads) paid once. A layer-order lookup of a
    new prompt asks at every block end (127 asks at 2k tokens of 16-token blocks)."""

    def first_committed(self, keys: Sequence[ChainKey]) -> int | None: ...


@runtime_checkable
class KnowsSeen(Protocol):
    """A `BlockStore` that remembers the entries it has seen: `unseen(key)` is True only for an
    entry its scan of the folder did not find and that was not written or committed through it
    since (False whenever it cannot tell). What a save planning a long prompt's entries asks,
    instead of the disk once per 64 tokens on the engine's thread: an unseen entry is new. One
    another process committed after the last scan is unseen too: its save finds its part in place
    and leaves it (`put` is a no-op then). Lookups never ask it: they ask the disk, which sees
    what other servers sharing the store committed."""

    def unseen(self, key: ChainKey) -> bool: ...


@runtime_checkable
class KnowsRecency(Protocol):
    """A `BlockStore` that knows when its entries were last used: `recent(wait_s)` lists the
    entries of its namespace, most recently used first, each with its parts' sizes in bytes
    (committed or not: `is_committed` says), waiting up to `wait_s` seconds for what it learns
    at open. What a restarted worker reads ahead (`GALAHAD_PRELOAD_BYTES`)."""

    def recent(self, wait_s: float | None = None) -> list[tuple[ChainKey, dict[int, int]]]: ...


@runtime_checkable
class StoreStats(Protocol):
    """A `BlockStore` that counts what it did: `stats()` gives running totals since it was
    opened, `evictions` among them (whole entries removed to stay under its size cap).
    `evictions()` is that one count alone, read without waiting for the store's locks: an engine
    asks it every step, while the store's own threads write and evict."""

    def stats(self) -> dict[str, int]: ...

    def evictions(self) -> int: ...


def read_stepwise(
    reader: PartReader, offset: int, view: memoryview, step: int, each: Callable[[memoryview], object]
) -> int:
    """`PartReader.read_stepwise` done with `reader.preadv`, one piece at a time (its reference
    behaviour, and what readers without a faster way of their own call)."""
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"a read step is an int of at least 1, got {step!r}")
    done = 0
    while done < len(view):
        piece = view[done : done + step]
        got = reader.preadv(offset + done, [piece])
        done += got
        if got < len(piece):
            break
        each(piece)
    if not len(view):
        reader.preadv(offset, [view])  # the same checks (offset, buffer, closed) as any read
    return done


def check_part(part: int) -> None:
    """The contract's part numbers: an int in [0, MAX_PART); anything else is a ValueError."""
    if not isinstance(part, int) or not 0 <= part < MAX_PART:
        raise ValueError(f"a part number is an int in [0, {MAX_PART}), got {part!r}")


def check_reason(reason: str) -> None:
    """The contract's quarantine reasons: 1 to 32 of [a-z0-9_-] (they end up in file names)."""
    if not isinstance(reason, str) or not _REASON.fullmatch(reason):
        raise ValueError(f"a quarantine reason is 1 to 32 of [a-z0-9_-], got {reason!r}")
