"""What a process knows of a store root's entries: their parts' sizes and when each was last used.

The filesystem is the truth for what exists and what is committed; this index only serves the
size cap (how many bytes are used, which entry was used least recently). It is filled by the
store's own writes and reads and by scans of the folder (see scan.py), which also carry other
processes' writes and uses in (through file sizes and modification times).

Recency is a tick: nanoseconds since the epoch, strictly increasing within a process (`CLOCK`).
Every write of a part or marker stamps the file's modification time with its tick, and every read
stamps the part it read, so a scan after a restart orders entries as the process that used them
did. Victims come from a heap of (tick, entry) with lazy deletion: an entry whose tick changed has
a newer item further down, so a popped item whose tick is not the entry's is just dropped.
"""

from __future__ import annotations

import heapq
import threading
import time

__all__ = ["CLOCK", "EntryId", "Index"]

EntryId = tuple[str, bytes]  # (namespace digest hex, raw chain key)


class _Clock:
    """Wall-clock nanoseconds, made strictly increasing within the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def tick(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1)
            return self._last


CLOCK = _Clock()


class _Entry:
    __slots__ = ("parts", "tick", "seen", "local")

    def __init__(self, parts: dict[int, int], tick: int, seen: int, local: int) -> None:
        self.parts = parts  # part -> size in bytes
        self.tick = tick  # last use
        self.seen = seen  # generation of the last scan that saw it on disk
        self.local = local  # tick of the last change this process made to it

    @property
    def nbytes(self) -> int:
        return sum(self.parts.values())


class Index:
    """Entries of one store root by (namespace hex, key): sizes, recency, in-flight reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[EntryId, _Entry] = {}
        self._heap: list[tuple[int, EntryId]] = []
        self._pins: dict[EntryId, int] = {}
        self._used = 0  # bytes of known parts plus reservations of puts in progress
        self._gen = 0
        self._scan_start = 0
        self._scanning = False
        self._removed: set[EntryId] = set()  # removed by us while a scan runs (it must not re-add them)

    def used(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def knows(self, eid: EntryId) -> bool:
        """Whether the index holds the entry (found by a scan, or written or committed by this
        process since), without the lock: one dict membership test, which the writers' updates
        never leave half-done."""
        return eid in self._entries

    # -- our own writes and reads ------------------------------------------------------------

    def reserve(self, eid: EntryId, size: int, max_bytes: int | None) -> list[tuple[EntryId, int]] | None:
        """Count `size` bytes about to be written, first forgetting the least recently used
        entries (never `eid`, never one being read) that must go to fit under `max_bytes`.

        Returns the forgotten entries with their bytes (deleting their files is the caller's
        job), or None, having changed nothing, when no choice of victims makes room.
        """
        with self._lock:
            victims: list[tuple[EntryId, int]] | None = []
            if max_bytes is not None:
                victims = self._choose(self._used + size - max_bytes, keep=eid, all_or_nothing=True)
                if victims is None:
                    return None
            self._used += size
            return victims

    def release(self, size: int) -> None:
        """Give back a reservation whose write did not happen."""
        with self._lock:
            self._used -= size

    def settle(self, eid: EntryId, part: int, size: int, tick: int) -> None:
        """A reserved write landed: the part now belongs to its entry, used at `tick`."""
        with self._lock:
            entry = self._entries.get(eid)
            if entry is None:
                entry = self._entries[eid] = _Entry({}, 0, self._gen, 0)
            self._used -= entry.parts.get(part, 0)  # the reservation becomes the part
            entry.parts[part] = size
            self._use(eid, entry, tick)

    def learn(self, eid: EntryId, parts: dict[int, int], tick: int) -> None:
        """Parts found present by this process (a commit's check): add those not known yet."""
        with self._lock:
            entry = self._entries.get(eid)
            if entry is None:
                entry = self._entries[eid] = _Entry({}, 0, self._gen, 0)
            for part, size in parts.items():
                self._used += size - entry.parts.get(part, 0)
                entry.parts[part] = size
            self._use(eid, entry, tick)

    def touch(self, eid: EntryId, tick: int) -> None:
        """A read of a known entry."""
        with self._lock:
            entry = self._entries.get(eid)
            if entry is not None:
                self._use(eid, entry, tick)

    def remove(self, eid: EntryId) -> int:
        """Forget an entry (evicted or quarantined); the bytes it held."""
        with self._lock:
            entry = self._entries.pop(eid, None)
            self._forgotten(eid)
            if entry is None:
                return 0
            self._used -= entry.nbytes
            return entry.nbytes

    def recent(self, ns_hex: str) -> list[tuple[bytes, dict[int, int]]]:
        """The entries of namespace `ns_hex` this process knows, most recently used first: (raw
        key, its parts' sizes). Committed or not: the filesystem says which."""
        with self._lock:
            known = [(e.tick, key, dict(e.parts)) for (ns, key), e in self._entries.items() if ns == ns_hex]
        known.sort(key=lambda item: item[0], reverse=True)
        return [(key, parts) for _tick, key, parts in known]

    def pin(self, eid: EntryId) -> None:
        with self._lock:
            self._pins[eid] = self._pins.get(eid, 0) + 1

    def unpin(self, eid: EntryId) -> None:
        with self._lock:
            left = self._pins[eid] - 1
            if left:
                self._pins[eid] = left
            else:
                del self._pins[eid]

    def trim(self, to_bytes: int) -> list[tuple[EntryId, int]]:
        """Remove least recently used entries (not those being read) until at most `to_bytes`
        are used or nothing more can go; the removed entries and their bytes."""
        with self._lock:
            return self._choose(self._used - to_bytes, keep=None, all_or_nothing=False) or []

    # -- scans -------------------------------------------------------------------------------

    def begin_scan(self, start_tick: int) -> int:
        with self._lock:
            self._gen += 1
            self._scan_start = start_tick
            self._scanning = True
            self._removed.clear()
            return self._gen

    def merge(self, found: list[tuple[EntryId, dict[int, int], int]], gen: int) -> None:
        """What a scan found of some entries: (entry, its parts' sizes, their newest mtime)."""
        with self._lock:
            for eid, parts, tick in found:
                if eid in self._removed:
                    continue
                entry = self._entries.get(eid)
                if entry is None:
                    entry = self._entries[eid] = _Entry({}, 0, gen, 0)
                elif entry.local >= self._scan_start:  # changed by us meanwhile: keep what we know too
                    parts = {**parts, **entry.parts}
                self._used += sum(parts.values()) - entry.nbytes
                entry.parts = parts
                entry.seen = gen
                if tick > entry.tick:
                    entry.tick = tick
                    heapq.heappush(self._heap, (tick, eid))

    def end_scan(self, gen: int) -> None:
        """Forget entries the scan did not find, unless we changed them since it began."""
        with self._lock:
            self._scanning = False
            self._removed.clear()
            gone = [e for e, v in self._entries.items() if v.seen != gen and v.local < self._scan_start]
            for eid in gone:
                self._used -= self._entries.pop(eid).nbytes
            self._compact()

    # -- inside the lock ---------------------------------------------------------------------

    def _forgotten(self, eid: EntryId) -> None:
        if self._scanning:
            self._removed.add(eid)

    def _use(self, eid: EntryId, entry: _Entry, tick: int) -> None:
        entry.local = max(entry.local, tick)
        if tick > entry.tick:
            entry.tick = tick
            heapq.heappush(self._heap, (tick, eid))
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap items once they outnumber the live ones (every use pushes one; only
        eviction pops them): a server that reads much and evicts little keeps a bounded heap."""
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._heap = [(v.tick, e) for e, v in self._entries.items()]
            heapq.heapify(self._heap)

    def _choose(self, excess: int, keep: EntryId | None, all_or_nothing: bool) -> list[tuple[EntryId, int]] | None:
        """Pop least recently used entries worth `excess` bytes and forget them (with their bytes).

        With `all_or_nothing`, when they are not enough, forget none and return None.
        """
        chosen: list[tuple[int, EntryId]] = []
        skipped: list[tuple[int, EntryId]] = []
        while excess > 0 and self._heap:
            tick, eid = heapq.heappop(self._heap)
            entry = self._entries.get(eid)
            if entry is None or entry.tick != tick:
                continue  # stale: the entry is gone, or a newer item for it is further down
            if eid == keep or eid in self._pins:
                skipped.append((tick, eid))
                continue
            chosen.append((tick, eid))
            excess -= entry.nbytes
        if excess > 0 and all_or_nothing:
            skipped += chosen
            chosen = []
        for item in skipped:
            heapq.heappush(self._heap, item)
        if excess > 0 and all_or_nothing:
            return None
        out: list[tuple[EntryId, int]] = []
        for _, eid in chosen:
            nbytes = self._entries.pop(eid).nbytes
            self._used -= nbytes
            self._forgotten(eid)
            out.append((eid, nbytes))
        return out
