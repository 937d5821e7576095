"""Saving one rank's part of an entry: sealed, then put whole into the store.

A part whose payload lies in the region of attached writer processes (`PartWriters`) is sealed,
written and named by one of them, in the folder the store opened and checked for it; any other,
and every part once the writers are off, is sealed in this process and put.

A save never fails the engine: a store that refuses the write, or a part that cannot be encoded,
skips it (counted, said once), and the entry is a future miss. A part already stored is left as
it is, unless the file at its name is damaged (cut short or grown): then the entry is set aside
and the part written anew, so a commit never marks a damaged file committed again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.counter import MissReason, SkipReason
from galahad.domain.error import FormatError, HelperLost, StoreUnavailable
from galahad.domain.namespace import Namespace
from galahad.domain.rank import RankLayout
from galahad.format import codec
from galahad.format.v1 import BlockHeader, CipherId, encode_header
from galahad.ports.cipher import Cipher
from galahad.ports.helpers import PartWriters
from galahad.ports.store import BlockStore, Buffer, PlacesParts
from galahad.app.segment import SegmentSpec, header_segments
from galahad.app.tally import Tally

__all__ = ["PartSaver"]

_SEAL_BUFFER_MAX = 256 << 20  # a sealed part larger than this gets a buffer of its own, not kept
_SEAL_KEPT_BYTES = 512 << 20  # buffers for sealed frames kept between saves, in all (every save thread's
# at 64-token entries of an 8B model, 9 MiB each; the smallest go first beyond it)


class PartSaver:
    """Saves of one namespace's parts into `store`, sealed with `cipher` in frames of
    `frame_size` bytes. `quarantine(key, reason)` sets an entry aside (the service's).
    `allocate(n)` makes a buffer of n bytes for sealed frames: the composition passes memory the
    kernel zeroes as it is written (`galahad.adapters.posix.memory`), since a buffer zeroed at
    once holds the interpreter lock, and the engine's thread with it, while it is zeroed."""

    def __init__(self, *, store: BlockStore, namespace: Namespace, digest: bytes, layout: RankLayout, cipher: Cipher,
                 frame_size: int, tally: Tally, quarantine: Callable[[ChainKey, str], None],
                 allocate: Callable[[int], Buffer] = bytearray) -> None:
        self.store = store  # (its `PlacesParts` capability is looked up once: a save asks per part)
        self._namespace = namespace
        self._digest = digest
        self._layout = layout
        self._cipher = cipher
        self._frame_size = frame_size
        self._tally = tally
        self._quarantine = quarantine
        self._lock = threading.Lock()
        self._allocate = allocate
        self._seal_buffers: list[memoryview] = []  # reused for sealed frames: no allocation per save
        self.writers: PartWriters | None = None  # writer processes over a shared region (the service's)

    @property
    def store(self) -> BlockStore:
        return self._store

    @store.setter
    def store(self, store: BlockStore) -> None:
        self._store = store
        self._places = store if isinstance(store, PlacesParts) else None

    def save(self, key: ChainKey, span: Span, rank: int, segments: Sequence[SegmentSpec], payload: Sequence[Buffer],
             *, pool: Executor, shared_at: int | None = None) -> bool:
        """Seal (its frames on `pool`) and write one rank's part of an entry. False (counted)
        when skipped or present. `shared_at`: the payload's buffers lie one after another in the
        writers' region from this byte on (a writer process seals and writes it)."""
        part = self._layout.part_of(rank)
        try:
            t0 = time.perf_counter()
            header = self._header(key, span, part, segments, payload)
            # A writer process is given the part at once: the store looks its name up as it places
            # it, and only a name found taken is looked at here (one look-up a part, not two).
            written, saved = self._put_elsewhere(key, part, header, payload, shared_at)
            if not written:
                if self._present(key, part, header):
                    return False  # present (or another writer's whole part of another size: first one stands)
                if written is not None:  # a damaged file was at the name, now set aside
                    written, saved = self._put_elsewhere(key, part, header, payload, shared_at)
                if written is None:
                    written, saved = self._seal_and_put(key, part, header, payload, pool)
            elapsed = time.perf_counter() - t0
        except StoreUnavailable as exc:
            self._tally.skipped(SkipReason.STORE)
            self._tally.warn_once("save", "[galahad] save skipped (the store refused a write): %s", exc)
            return False
        except (FormatError, ValueError) as exc:
            self._tally.skipped(SkipReason.FORMAT)
            self._tally.warn_once("save-format", "[galahad] save skipped (cannot encode this part): %s", exc)
            return False
        if written:
            self._tally.add(saves=1, bytes_saved=saved, save_seconds=elapsed)
        return written

    def _present(self, key: ChainKey, part: int, header: BlockHeader) -> bool:
        """Whether a save of the part of `header` has nothing to write: a whole part is at its
        name (this save's size, or another writer's of another size). A damaged one is set aside
        (`_damaged_at`): then False, and the part is written anew."""
        found = self.store.part_size(key, part)
        return found is not None and (found == codec.file_size(header) or not self._damaged_at(key, part))

    def _damaged_at(self, key: ChainKey, part: int) -> bool:
        """Whether the part file at `key`'s name, whose size is not this save's, is damaged (cut
        short or grown: its header gives another size, or does not read). Then the entry is set
        aside, as a load that found it would, and this save writes the part anew: without that
        the save found the name taken, and the commit after it marked the damaged file committed
        again. A whole part of another size (another writer's) is left alone."""
        reader = self.store.open_reader(key, part)
        if reader is None:
            return True  # gone meanwhile: write it
        with reader:
            if codec.part_is_whole(reader):
                return False
        self._quarantine(key, MissReason.DAMAGED)
        return True

    def _put_elsewhere(self, key: ChainKey, part: int, header: BlockHeader, payload: Sequence[Buffer],
                       shared_at: int | None) -> tuple[bool | None, int]:
        """Have a writer process seal the part from the shared region and write and name its file
        in the folder the store gives it: (stored, file bytes), or (None, 0) where no writer can
        (none attached, off, a store that does not let another process place its files, a payload
        elsewhere): the part is sealed here. The bytes are those `_seal_and_put` writes (`codec.seal_part`)."""
        writers, store = self.writers, self._places
        if shared_at is None or writers is None or not writers.running or store is None:
            return None, 0
        blob, size = encode_header(header), codec.file_size(header)
        sizes = [memoryview(p).nbytes for p in payload]
        try:
            return store.put_placed(key, part, size, lambda dir_fd, name, tick: writers.seal_and_place(
                dir_fd, name, tick, size, blob, shared_at, sizes)), size
        except HelperLost:  # the pool said why, once; this part and the next are sealed here
            return None, 0

    def _seal_and_put(self, key: ChainKey, part: int, header: BlockHeader, payload: Sequence[Buffer],
                      pool: Executor) -> tuple[bool, int]:
        """Seal the part in this process and put it: (stored, file bytes)."""
        sealing = self._seal_buffer(header)
        try:
            out = None if sealing is None else memoryview(sealing)
            chunks = codec.seal_part(header, payload, self._cipher, pool=pool, out=out)
            written = self.store.put(key, part, chunks)
            saved = sum(memoryview(c).nbytes for c in chunks)
            del chunks, out  # no view of the buffer outlives the write
        finally:
            if sealing is not None:
                self._keep_seal_buffer(sealing)
        return written, saved

    def _header(self, key: ChainKey, span: Span, part: int, segments: Sequence[SegmentSpec],
                payload: Sequence[Buffer]) -> BlockHeader:
        if len(segments) != len(payload):
            raise ValueError(f"{len(segments)} segments for {len(payload)} payload buffers")
        return BlockHeader(
            namespace=self._digest,
            chain_key=key.raw,
            token_start=span.start,
            token_end=span.end,
            rank=part,
            world=self._layout.world_size,
            block_size=self._namespace.block_size,
            segments=header_segments(tuple(segments)),
            frame_size=self._frame_size,
            cipher_id=self._cipher.cipher_id,  # what sealing it sets: one header a part, not two
            key_id=self._cipher.key_id,
        )

    def _seal_buffer(self, header: BlockHeader) -> memoryview | None:
        """A buffer for the sealed frames of `header` (None for the checksum, which copies nothing):
        a kept one it fits in, else a new one (`allocate`)."""
        if self._cipher.cipher_id == CipherId.XXH3:
            return None
        need = codec.sealed_len(header)
        with self._lock:
            for i, buf in enumerate(self._seal_buffers):
                if len(buf) >= need:
                    return self._seal_buffers.pop(i)
        return memoryview(self._allocate(need)).cast("B")

    def _keep_seal_buffer(self, buf: memoryview) -> None:
        if len(buf) > _SEAL_BUFFER_MAX:
            return
        with self._lock:
            self._seal_buffers.append(buf)
            self._seal_buffers.sort(key=len)
            while sum(len(b) for b in self._seal_buffers) > _SEAL_KEPT_BYTES:
                del self._seal_buffers[0]  # the smallest goes
