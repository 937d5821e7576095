"""Use cases: look up, save, load, commit and quarantine KV entries of one namespace.

The engine adapters (vLLM connector, SGLang backend) call this; it applies the failure policy
(a block that fails is a miss, counted, and its entry quarantined) and never lets a store, format
or cipher error reach the engine: every public method returns a value.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

import attrs

from galahad.format import codec
from galahad.domain.chain import ChainKey, ChainSeed, chain_keys
from galahad.domain.chunking import Chunking, Span
from galahad.domain.counter import Counters, MissReason
from galahad.domain.error import (
    ForeignBlock,
    FormatError,
    HelperLost,
    IntegrityError,
    NewerFormat,
    StoreUnavailable,
    UnknownKey,
)
from galahad.domain.namespace import Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.fanout import LastingPool
from galahad.format.codec import CipherLookup, Expect, OpenedPart
from galahad.format.v1 import DEFAULT_FRAME_SIZE, BlockHeader, CipherId, Segment
from galahad.ports.cipher import Cipher
from galahad.ports.store import (
    BlockStore, Buffer, KnowsRecency, PartReader, ShareableReader, StoreStats,
)
from galahad.app.priority import LoadsFirst
from galahad.ports.helpers import HelperRecipe, PartHelpers

__all__ = ["CipherLookup", "Hit", "KVCacheService", "LoadedPart", "OtherLayout", "SegmentSpec"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_SEAL_BUFFER_MAX = 256 << 20  # a sealed part larger than this gets a buffer of its own, not kept
_SEAL_BUFFERS_KEPT = 2  # buffers for sealed frames kept between saves (the rest are freed)
_RESIDENCY_SAMPLES = 8  # entries of a hit asked whether the page cache holds them (spread)
_OPENABLE_KEPT = 1 << 16  # entries whose header was asked whether this process can open them (`_opens`)
_UNOPENABLE = ("[galahad] the store holds entries this server cannot open (%s): they are misses, never "
               "errors. Entries sealed under a key this server does not hold are kept as they are (the key "
               "may come back: put it back as a retired line of the key file to read them); those under a "
               "key retired on purpose (by a key this server holds, or by hand: %s lists them; add the id "
               "of a key lost for good there) and those written without encryption while a key is set are set "
               "aside and written anew under the key in use when their prompt is saved again "
               "(docs/security.md, Rotation)")
# What this process does with a committed entry (`_verdict`): open it; keep it unopened (sealed
# under a key it does not hold, which may come back); or set it aside when its prompt is saved
# again (sealed under a key retired on purpose, or plain where a key is set)
_OPENS, _KEEP, _REPLACE = 0, 1, 2


def _segments(specs: tuple[SegmentSpec, ...]) -> tuple[Segment, ...]:
    """The header's segment table for these specs (cached: every part of a model has the same)."""
    try:
        return _cached_segments(specs)
    except TypeError:  # a spec with an unhashable field (a list for a shape): built each time
        return _build_segments(specs)


def _build_segments(specs: tuple[SegmentSpec, ...]) -> tuple[Segment, ...]:
    return tuple(Segment(group=s.group, kind=s.kind, dtype=s.dtype, layer=s.layer, shape=tuple(s.shape)) for s in specs)


_cached_segments = functools.lru_cache(maxsize=64)(_build_segments)


@attrs.frozen
class SegmentSpec:
    """One tensor slice of a part: a group's layer (kind 0: KV blocks, 1: state), dtype and shape."""

    group: int
    layer: int
    kind: int
    dtype: str
    shape: tuple[int, ...]


@attrs.frozen
class Hit:
    """The longest committed prefix found for a request: `end` tokens, in `entries` to load in order.

    `shared` is True for `chunk` order, where the prefix is assembled from 64-token entries that
    any prompt with the same beginning may have written (a chain hit).
    """

    end: int
    entries: tuple[tuple[Span, ChainKey], ...]
    shared: bool


@attrs.frozen
class OtherLayout:
    """The same model saved in the same store by a server split differently (other TP x PP sizes).

    Its entries are never read here (their keys, bytes and rank parts belong to its namespace);
    `committed(key)` only answers whether it holds an entry, so that a miss here can be counted
    as a namespace miss.
    """

    digest: bytes
    tp_size: int
    pp_size: int
    committed: Callable[[ChainKey], bool]

    def describe(self) -> str:
        return f"tp {self.tp_size} x pp {self.pp_size} (namespace {self.digest.hex()[:16]})"


LoadedPart = OpenedPart
"""A verified part: its header and plaintext payload (`segment_views()` cuts it per segment)."""


_RECENT_WAIT_S = 30.0  # `recent_parts` waits this long at most for the store's scan at open
_RECENT_ASKED = 10_000  # entries `recent_parts` looks at, newest first, at most


class KVCacheService:
    """Galahad's use cases over one namespace's store, with its cipher and counters."""

    def __init__(
        self,
        *,
        namespace: Namespace,
        store: BlockStore,
        chunking: Chunking,
        layout: RankLayout,
        cipher: Cipher,
        ciphers: CipherLookup,
        retired_keys: frozenset[bytes] = frozenset(),
        retired_record: str = "the store's record of retired keys",
        io_threads: int = 8,
        frame_threads: int = 4,
        fault_load_rate: float = 0.0,
        other_layouts: Sequence[OtherLayout] = (),
        helper_recipe: HelperRecipe | None = None,
        reader_processes: int = 0,
        save_yield_s: float = 0.0,
        frame_size: int = DEFAULT_FRAME_SIZE,
    ) -> None:
        self.namespace = namespace
        self.digest = namespace.digest()
        self.store = store
        self.chunking = chunking
        self.layout = layout
        self.counters = Counters()
        self._evictions_seen = 0  # the store's running count of evictions at the last take
        self._store_stats = store.stats if isinstance(store, StoreStats) else None  # asked once, not per take
        self._cipher = cipher
        self._ciphers = ciphers
        self.sealed = cipher.cipher_id != CipherId.XXH3  # saves are encrypted (loads may meet both)
        # Ids of keys retired on purpose, by a key this process holds or by hand
        # (`adapters/crypto/retired.py`): an entry sealed under one is written anew when its
        # prompt is saved again
        self._retired_keys = retired_keys
        self._retired_record = retired_record
        self._lock = threading.Lock()
        # Whether this process can open an entry, by key: asked of a committed entry's header
        # once, the first time a lookup would offer it (`_opens`).
        self._openable: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # `_verdict`s
        # The pools a save uses inside (frames, I/O, commits) keep working for a save queued
        # before the interpreter began to exit (`LastingPool`); the saves' own pool does not
        self._io = LastingPool(io_threads, thread_name_prefix="galahad-io")
        # Saves get their own threads: a load never waits in line behind writes to a slow disk.
        self._saves = ThreadPoolExecutor(io_threads, thread_name_prefix="galahad-save")
        self._frames: Executor = LastingPool(frame_threads, thread_name_prefix="galahad-frame")
        # Commit markers: each waits on the disk (fsync, rename, fsync of the folder), not the CPU
        self._commits = LastingPool(min(8, io_threads), thread_name_prefix="galahad-commit")
        self._fault_load_rate = fault_load_rate
        self.other_layouts = tuple(other_layouts)
        self._warned: set[str] = set()
        self._seal_buffers: list[bytearray] = []  # reused for sealed frames: no allocation per save
        self._readers: PartHelpers | None = None  # helper processes reading loads (`attach_readers`)
        self.helper_recipe = helper_recipe  # how such a helper builds `ciphers`; None: no helpers
        self.reader_processes = reader_processes  # how many the engine adapter starts (0: none)
        self.frame_size = frame_size  # the checksum frames of the parts this service saves
        self.loads_first = LoadsFirst(save_yield_s)  # saves wait a bounded while for running loads
        self._miss = threading.local()  # why this thread's last `load_part` missed (`last_miss`)

    # -- keys and lookups (pure: no counting, safe to call repeatedly) -------------------------

    def keys(self, tokens: Sequence[int], seed: ChainSeed) -> list[ChainKey]:
        """Chain keys at every saving step of `tokens` (key i covers `tokens[:(i+1)*step]`)."""
        return chain_keys(seed, tokens, self.chunking.step)

    def seed(self, *, cache_salt: str | None = None, lora: str | None = None,
             mm_hashes: Sequence[str] = ()) -> ChainSeed:
        return ChainSeed(self.digest, cache_salt, lora, tuple(mm_hashes))

    def lookup(
        self,
        tokens: Sequence[int],
        seed: ChainSeed,
        *,
        already: int = 0,
        keys: Sequence[ChainKey] | None = None,
        after: Hit | None = None,
        held: Callable[[ChainKey], bool] | None = None,
    ) -> Hit | None:
        """The longest committed prefix longer than `already` tokens, leaving one token to compute.

        `after`: a hit an earlier lookup of the same prompt found; only the entries beyond it
        are asked about (it is taken as still committed, as a hit is until it is loaded).
        `held(key)`: entries this server is still saving and can load from the copy its save
        holds, taken as committed without asking the store."""
        try:
            return self._lookup(tokens, seed, already, keys, after, held)
        except StoreUnavailable as exc:
            self._warn_once("lookup", "[galahad] store lookup failed, serving without hits: %s", exc)
            return None

    def _lookup(
        self, tokens: Sequence[int], seed: ChainSeed, already: int, keys: Sequence[ChainKey] | None,
        after: Hit | None = None, held: Callable[[ChainKey], bool] | None = None,
    ) -> Hit | None:
        ends = self.chunking.probe_ends(len(tokens))
        store_committed = self.store.is_committed
        is_committed = lambda k: store_committed(k) and self._opens(k)  # noqa: E731
        committed = is_committed if held is None else (lambda k: held(k) or is_committed(k))
        if not ends or ends[0] <= already:
            return None
        keys = list(keys) if keys is not None else self.keys(tokens, seed)
        ch = self.chunking
        known = after.end if after is not None else 0
        if ch.order is PayloadOrder.LAYER:  # a miss asks at every end: the loop is kept lean
            floor, step = max(already, known), ch.step
            for end in ends:
                if end <= floor:
                    break
                key = keys[end // step - 1]  # ch.key_index(end)
                if committed(key):
                    return Hit(end, ((ch.span_ending_at(end), key),), shared=False)
            return after if after is not None and after.end > already else None
        entries: list[tuple[Span, ChainKey]] = list(after.entries) if after is not None else []
        for end in reversed(ends):  # ascending: a chunk chain is usable up to its first gap
            if end <= known:
                continue
            key = keys[ch.key_index(end)]
            if not committed(key):
                break
            entries.append((ch.span_ending_at(end), key))
        if not entries or entries[-1][0].end <= already:
            return None
        return Hit(entries[-1][0].end, tuple(entries), shared=True)

    def _opens(self, key: ChainKey) -> bool:
        """Whether this process can open the committed entry `key`: its part 0's header names a
        cipher and key it holds. An entry it cannot open (checksum-only where a key is set, or
        sealed under a key not held: another server's, on the same folder) is not offered: a
        lookup would hit it on every request for a load that then fails (`refused_key`)."""
        return self._verdict(key) == _OPENS

    def _verdict(self, key: ChainKey) -> int:
        """`_OPENS`, `_KEEP` or `_REPLACE` for the committed entry `key` (see their comment). Read
        once per entry, then remembered; a header that does not read is left to the load to
        refuse, count and quarantine (`_OPENS`). A commit or a quarantine by this process
        forgets what was read (new files may take the entry's name)."""
        known = self._openable.get(key.raw)
        if known is None:
            reader = self.store.open_reader(key, 0)
            if reader is None:
                return _OPENS  # gone meanwhile: the load will say so
            with reader:
                named = codec.header_key(reader)
            known = _OPENS if named is None or self._ciphers(*named) is not None else self._unopenable(*named)
            self._remember_openable(key, known)
            if named is not None and named[0] == codec.NEWER_FORMAT:
                self._warn_once("newer", "[galahad] the store holds entries of a newer Galahad format (a newer "
                                "server shares this store): they are misses here, and kept for the servers "
                                "that read them")
            elif known != _OPENS and named is not None:
                what = ("written without encryption while a key is set" if named[0] == CipherId.XXH3
                        else f"for example sealed under key id {named[1].hex()}")
                self._warn_once("unopenable", _UNOPENABLE, what, self._retired_record)
        return known

    def _unopenable(self, cipher_id: int, key_id: bytes) -> int:
        if cipher_id == codec.NEWER_FORMAT:
            return _KEEP
        if cipher_id == CipherId.XXH3:
            return _REPLACE if self.sealed else _KEEP  # plain under a key: it could be forged
        return _REPLACE if key_id in self._retired_keys else _KEEP

    def _forget_openable(self, key: ChainKey) -> None:
        with self._lock:
            self._openable.pop(key.raw, None)

    def _remember_openable(self, key: ChainKey, verdict: int) -> None:
        with self._lock:
            self._openable[key.raw] = verdict
            self._openable.move_to_end(key.raw)
            while len(self._openable) > _OPENABLE_KEPT:
                self._openable.popitem(last=False)

    def in_other_layout(self, tokens: Sequence[int], seed: ChainSeed, *, already: int = 0) -> bool:
        """Whether another layout of this model (`other_layouts`) holds a committed entry for a
        prefix of `tokens` longer than `already`: a miss here that is a namespace miss. Nothing
        of that layout is read: its keys are derived and its commit markers looked at. Free when
        the store holds no other layout; otherwise a few stats per probe end."""
        if not self.other_layouts:
            return False
        ends = [end for end in self.chunking.probe_ends(len(tokens)) if end > already]
        try:
            for other in self.other_layouts:
                keys = chain_keys(attrs.evolve(seed, namespace_digest=other.digest), tokens,
                                  self.chunking.step)
                if any(other.committed(keys[self.chunking.key_index(end)]) for end in ends):
                    return True
        except StoreUnavailable:
            return False
        return False

    # -- saving ---------------------------------------------------------------------------------

    def save_part(
        self,
        key: ChainKey,
        span: Span,
        rank: int,
        segments: Sequence[SegmentSpec],
        payload: Sequence[Buffer],
    ) -> bool:
        """Seal and write one rank's part of an entry. False (counted) when skipped or present."""
        part = self.layout.part_of(rank)
        try:
            found = self.store.part_size(key, part)
            t0 = time.perf_counter()
            header = self._header(key, span, part, segments, payload)
            if found is not None and (found == codec.file_size(header) or not self._damaged_at(key, part)):
                return False  # present (or another writer's whole part of another size: first one stands)
            written, saved = self._seal_and_put(key, part, header, payload)
            elapsed = time.perf_counter() - t0
        except StoreUnavailable as exc:
            with self._lock:
                self.counters.saves_skipped += 1
            self._warn_once("save", "[galahad] save skipped (the store refused a write): %s", exc)
            return False
        except (FormatError, ValueError) as exc:
            with self._lock:
                self.counters.saves_skipped += 1
            self._warn_once("save-format", "[galahad] save skipped (cannot encode this part): %s", exc)
            return False
        if written:
            with self._lock:
                self.counters.saves += 1
                self.counters.bytes_saved += saved
                self.counters.save_seconds += elapsed
        return written

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
        self.quarantine(key, MissReason.DAMAGED)
        return True

    def _seal_and_put(self, key: ChainKey, part: int, header: BlockHeader, payload: Sequence[Buffer]) -> tuple[bool, int]:
        """Seal the part in this process and put it: (stored, file bytes)."""
        sealing = self._seal_buffer(header)
        try:
            out = None if sealing is None else memoryview(sealing)
            chunks = codec.seal_part(header, payload, self._cipher, pool=self._frames, out=out)
            written = self.store.put(key, part, chunks)
            saved = sum(memoryview(c).nbytes for c in chunks)
            del chunks, out  # no view of the buffer outlives the write
        finally:
            if sealing is not None:
                self._keep_seal_buffer(sealing)
        return written, saved

    def _header(
        self,
        key: ChainKey,
        span: Span,
        part: int,
        segments: Sequence[SegmentSpec],
        payload: Sequence[Buffer],
    ) -> BlockHeader:
        if len(segments) != len(payload):
            raise ValueError(f"{len(segments)} segments for {len(payload)} payload buffers")
        return BlockHeader(
            namespace=self.digest,
            chain_key=key.raw,
            token_start=span.start,
            token_end=span.end,
            rank=part,
            world=self.layout.world_size,
            block_size=self.namespace.block_size,
            segments=_segments(tuple(segments)),
            frame_size=self.frame_size,
        )

    def _seal_buffer(self, header: BlockHeader) -> bytearray | None:
        """A buffer for the sealed frames of `header` (None for the checksum, which copies nothing)."""
        if self._cipher.cipher_id == CipherId.XXH3:
            return None
        need = codec.sealed_len(header)
        with self._lock:
            for i, buf in enumerate(self._seal_buffers):
                if len(buf) >= need:
                    return self._seal_buffers.pop(i)
        return bytearray(need)

    def _keep_seal_buffer(self, buf: bytearray) -> None:
        if len(buf) > _SEAL_BUFFER_MAX:
            return
        with self._lock:
            self._seal_buffers.append(buf)
            self._seal_buffers.sort(key=len)
            if len(self._seal_buffers) > _SEAL_BUFFERS_KEPT:
                del self._seal_buffers[0]  # the smallest goes

    def commit(self, key: ChainKey) -> bool:
        """Record the entry as committed once every rank's part is durable (all ranks or nothing)."""
        try:
            committed = self.store.commit(key, self.layout.parts())
        except StoreUnavailable as exc:
            self._warn_once("commit", "[galahad] commit skipped: %s", exc)
            return False
        if committed:  # perhaps new files at the entry's name: its header is read again
            self._forget_openable(key)
        return committed

    def commit_later(self, key: ChainKey) -> Future[bool]:
        """`commit` on the commit threads: the caller (vLLM's engine thread) does not wait for
        the marker's disk round trip; the future says whether it was committed."""
        return self._commits.submit(self.commit, key)

    def is_committed(self, key: ChainKey) -> bool:
        try:
            return self.store.is_committed(key)
        except StoreUnavailable:
            return False

    def holds(self, key: ChainKey) -> bool:
        """Whether a save of `key` has nothing to do: the entry is committed, and this process can
        open it or keeps it unopened (sealed under a key it does not hold, which may come back: a
        wrong or missing key setting loses nothing). A committed entry sealed under a key retired
        on purpose, or checksum-only where a key is set (`_verdict`), is set aside first, as
        quarantine reason `key` (the store keeps the newest such files in its quarantine folder),
        so the save writes it anew under the key in use: after a rotation, a prompt used again is
        cached again instead of missing until the store evicts it (docs/security.md)."""
        try:
            if not self.store.is_committed(key):
                return False
            if self._verdict(key) != _REPLACE:
                return True
        except StoreUnavailable:
            return False  # the save will meet the same store, and count what it cannot do
        self._forget_openable(key)
        try:
            self.store.quarantine(key, MissReason.KEY)
        except StoreUnavailable as exc:
            self._warn_once("quarantine", "[galahad] quarantine failed: %s", exc)
            return True  # the old files stay in the way: nothing to write over them
        return False

    def offers(self, key: ChainKey) -> bool:
        """Whether a lookup offers the entry: committed, and one this process can open (`_opens`).
        For engines that ask entry by entry (SGLang's `exists`)."""
        try:
            return self.store.is_committed(key) and self._opens(key)
        except StoreUnavailable:
            return False

    def has_part(self, key: ChainKey, rank: int) -> bool:
        """Whether this rank's part of the entry is already stored (a save would be a no-op)."""
        try:
            return self.store.has_part(key, self.layout.part_of(rank))
        except StoreUnavailable:
            return False

    def residency(self, hit: Hit, held: Callable[[ChainKey], bool] | None = None) -> tuple[int, float | None]:
        """Bytes one rank reads to load `hit`, and the share of them in memory now (None: unknown).
        Entries `held` (loaded from the copy of a save still being written) read nothing.

        Reads nothing: sizes and page-cache residency come from the store (`resident_share`).
        A hit of many entries (chunk order: one per 64 tokens) is asked about at most
        `_RESIDENCY_SAMPLES` of them, spread evenly from its first to its last: this runs on the
        engine's thread for every hit, and each ask maps a file (about 80 us on a GPU host).
        """
        part = self.layout.part_of(0)
        entries = hit.entries if held is None else tuple(e for e in hit.entries if not held(e[1]))
        asked = set(_spread(len(entries), _RESIDENCY_SAMPLES))
        total, sampled, resident = 0, 0, 0.0
        try:
            for i, (_span, key) in enumerate(entries):
                size = self.store.part_size(key, part)
                if size is None:
                    return total, None
                total += size
                if i in asked:
                    share = self.store.resident_share(key, part)
                    if share is None:
                        return total, None
                    sampled += size
                    resident += size * share
        except StoreUnavailable:
            return total, None
        return total, (resident / sampled if sampled else None)

    def recent_parts(self, rank: int, budget: int, *, wait_s: float = _RECENT_WAIT_S,
                     cost: Callable[[int], int] | None = None) -> list[tuple[ChainKey, int]]:
        """This rank's parts of the most recently used committed entries, newest first, with
        their files' sizes, as many as fit in `budget` bytes (each taking `cost(size)` of it,
        the size itself by default): what a restarted worker reads ahead
        (`GALAHAD_PRELOAD_BYTES`). A part too large for what is left is passed over for the
        next; at most `_RECENT_ASKED` entries are looked at. Empty when the store does not know
        recency or cannot be read; waits up to `wait_s` for the store's scan at open."""
        store = self.store
        if budget <= 0 or not isinstance(store, KnowsRecency):
            return []
        part, weigh = self.layout.part_of(rank), cost or (lambda n: n)
        chosen: list[tuple[ChainKey, int]] = []
        try:
            for asked, (key, parts) in enumerate(store.recent(wait_s)):
                size = parts.get(part)
                if asked >= _RECENT_ASKED or budget <= 0:
                    break
                if size is None or weigh(size) > budget or not store.is_committed(key):
                    continue
                chosen.append((key, size))
                budget -= weigh(size)
        except StoreUnavailable as exc:
            self._warn_once("recent", "[galahad] cannot list the store's recent entries: %s", exc)
        return chosen

    def clear(self) -> int | None:
        """Set aside every committed entry of this namespace (an operator's reset); returns the
        count, or None when the store could not list them (said once)."""
        try:
            keys = list(self.store.committed())
        except StoreUnavailable as exc:
            self._warn_once("clear", "[galahad] clear failed: %s", exc)
            return None
        for key in keys:
            self.quarantine(key, "cleared")
        return len(keys)

    # -- loading --------------------------------------------------------------------------------

    def draw_fault(self) -> bool:
        """TEST ONLY (`GALAHAD_FAULT_LOAD_RATE`): whether a load should fail on purpose."""
        return bool(self._fault_load_rate) and random.random() < self._fault_load_rate

    def load_part(self, key: ChainKey, rank: int, *, out: memoryview | None = None,
                  fail: bool | None = None, progress: Callable[[int], None] | None = None,
                  fan_out: bool = True, region_offset: int | None = None,
                  segments: Sequence[SegmentSpec] | None = None,
                  max_bytes: int | None = None) -> LoadedPart | None:
        """Read and verify this rank's part of a committed entry; None on any miss (counted).

        Each frame is read straight into its place in `out` (or a new buffer) and verified there,
        on the frame pool. Nothing is returned before every frame verified; after a miss, `out`
        holds no meaningful bytes. A damaged or foreign part quarantines the entry for every rank.
        `fail` (test only): fail this load on purpose (None: draw it, see `draw_fault`).
        `progress(n)`: told each time the first n payload bytes are verified (`codec.open_part_from`).
        `fan_out=False`: every frame in the calling thread (the caller already reads several
        parts side by side: on a 16-core machine 8 threads of 9.4 MB parts read 13.8 GB/s so,
        10.4 with each part's frames fanned out too).
        `region_offset`: `out` is the attached helpers' shared region from this offset on,
        so a helper process may read the part (`attach_readers`); without `progress` only.
        `segments`: the segment table the engine expects of this part. `max_bytes`: the most
        payload bytes the engine can take from it (where it gives no `out`).

        Sizes in a part's header are not authenticated before its frames verified: they are
        compared first with what the caller expects, the table `segments` and the size of `out`,
        and a part that claims another table or a larger payload is refused (`refused_format`)
        and quarantined before anything is allocated or read by its claim. Without either, the
        payload goes to memory the kernel gives as frames arrive: a forged claim costs the
        frames read before its first bad one, and one larger than the machine's memory, or any
        memory the part cannot be given, is refused and quarantined the same way.
        """
        part = self.layout.part_of(rank)
        t0 = time.perf_counter()
        self._miss.reason = ""
        try:
            want = None if segments is None else _segments(tuple(segments))
        except (FormatError, ValueError) as exc:  # the caller's table, not the part: nothing set aside
            self._warn_once("load-segments", "[galahad] a load was given a segment table no part can hold: %s", exc)
            self._refuse(key, MissReason.ERROR, quarantine=False)
            return None
        try:
            if self.draw_fault() if fail is None else fail:
                # A test-only fault: a miss like a damaged block, but the entry is kept.
                self._refuse(key, MissReason.INJECTED, quarantine=False)
                return None
            reader = self.store.open_reader(key, part)
            if reader is None:
                self._refuse(key, MissReason.MISSING, quarantine=True)
                return None
            with reader:
                size = reader.size
                expect = Expect(namespace=self.digest, chain_key=key.raw, rank=part, world=self.layout.world_size,
                                segments=want, payload_max=_least(None if out is None else out.nbytes, max_bytes))
                opened = None if progress is not None else self._elsewhere(reader, expect, out, region_offset)
                if opened is None:
                    opened = codec.open_part_from(reader, expect=expect, ciphers=self._ciphers,
                                                  pool=self._frames if fan_out else None, out=out, progress=progress)
        except StoreUnavailable as exc:
            self._warn_once("load", "[galahad] load failed (store): %s", exc)
            # The medium could not read this part (EIO): set the entry aside as a damaged one, so
            # no rank offers it again. A failure that is not this part's (the store closed, too
            # many open files, no memory) leaves the entry for the next request.
            self._refuse(key, MissReason.IO, quarantine=exc.errno == errno.EIO)
            return None
        except UnknownKey:
            self._refuse(key, MissReason.KEY, quarantine=False)
            self._forget_openable(key)  # the next lookup reads its header: not offered again
            return None
        except ForeignBlock:
            self._refuse(key, MissReason.NAMESPACE, quarantine=True)
            return None
        except IntegrityError:
            self._refuse(key, MissReason.DAMAGED, quarantine=True)
            return None
        except NewerFormat:  # a newer server sharing the store reads it: kept
            self._refuse(key, MissReason.FORMAT, quarantine=False)
            return None
        except FormatError:
            self._refuse(key, MissReason.FORMAT, quarantine=True)
            return None
        except MemoryError:  # what a part's header claims could not be had: that part's fault
            self._warn_once("load-memory", "[galahad] a part asked for more memory than this process could get; "
                            "refused and set aside as a malformed part")
            self._refuse(key, MissReason.FORMAT, quarantine=True)
            return None
        with self._lock:
            self.counters.bytes_loaded += size
            self.counters.load_seconds += time.perf_counter() - t0
        return opened

    def attach_readers(self, readers: PartHelpers | None) -> None:
        """Let `readers` (helper processes over a shared region) read the parts of loads into
        that region (`load_part(region_offset=...)`); None detaches. The service closes it."""
        old, self._readers = self._readers, readers
        if old is not None and old is not readers:
            old.close()

    def _elsewhere(self, reader: PartReader, expect: Expect, out: memoryview | None,
                   region_offset: int | None) -> OpenedPart | None:
        """The part read by a helper process, or None: read it here (no pool, no shareable
        descriptor, or the pool just stopped: `HelperLost` was logged once)."""
        readers = self._readers
        if readers is None or out is None or region_offset is None or not readers.running:
            return None
        fd = reader.shareable_fd() if isinstance(reader, ShareableReader) else None
        if fd is None:
            return None
        try:
            return readers.open_part(fd, reader.size, region_offset, out, expect)
        except HelperLost:
            return None
        except RuntimeError as exc:  # the helper failed, not the part (no Galahad error): read it here
            self._warn_once("load-helper", "[galahad] a reader process could not read a part (%s); reading it "
                            "in this process", exc)
            return None

    def _refuse(self, key: ChainKey, reason: str, *, quarantine: bool) -> None:
        log.debug("[galahad] entry %s refused: %s", key.hex[:16], reason)
        self._miss.reason = reason
        self.count_refused(reason)
        if quarantine:
            self.quarantine(key, reason)
        return None

    def last_miss(self) -> str:
        """Why the last `load_part` of the calling thread returned None (a `MissReason`; "" if it
        did not miss)."""
        return str(getattr(self._miss, "reason", ""))

    def quarantine(self, key: ChainKey, reason: str) -> None:
        """Uncommit the entry and set its parts aside so no rank offers it again."""
        self._forget_openable(key)
        try:
            if not self.store.quarantine(key, reason):
                return  # already gone (evicted since the lookup): nothing set aside, nothing counted
        except StoreUnavailable as exc:
            self._warn_once("quarantine", "[galahad] quarantine failed: %s", exc)
            return
        with self._lock:
            self.counters.quarantined += 1

    # -- plumbing -------------------------------------------------------------------------------

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)` on the service's I/O pool."""
        return self._io.submit(fn, *args)

    def loading(self) -> contextlib.AbstractContextManager[None]:
        """Wrap a load on a request's path: saves starting meanwhile wait for it (`yield_to_loads`)."""
        return self.loads_first.loading()

    def yield_to_loads(self) -> None:
        """Before a part's save: wait while loads run, a bounded while (`save_yield_s`; counted)."""
        waited = self.loads_first.wait()
        if waited:
            with self._lock:
                self.counters.save_wait_seconds += waited

    def submit_save(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)` on the service's save pool (apart from loads)."""
        return self._saves.submit(fn, *args)

    def take_counters(self) -> Counters:
        """The counts since the last take, resetting them (per-report deltas). `evicted` is what
        this service's store evicted meanwhile (each service opens its own store)."""
        total = int(self._store_stats().get("evictions", 0)) if self._store_stats is not None else 0
        with self._lock:
            counters = self.counters.take()
            counters.evicted += max(0, total - self._evictions_seen)
            self._evictions_seen = max(total, self._evictions_seen)
            return counters

    def snapshot_counters(self) -> Counters:
        """A copy of the counts so far, without resetting them."""
        with self._lock:
            return attrs.evolve(self.counters, refused=dict(self.counters.refused))

    def count_refused(self, reason: str) -> None:
        """Count a part not loaded, by reason (`load_failures`, `refused_<reason>`; thread-safe)."""
        with self._lock:
            self.counters.refuse(reason)
            self.counters.load_failures += 1

    def count(self, **deltas: int | float) -> None:
        """Add to counters from an engine adapter (thread-safe)."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def _warn_once(self, topic: str, msg: str, *args: object) -> None:
        with self._lock:
            first = topic not in self._warned
            self._warned.add(topic)
        (log.warning if first else log.debug)(msg, *args)

    def close(self) -> None:
        """Finish queued saves and release the store."""
        self._saves.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._frames.shutdown(wait=True)
        self._commits.shutdown(wait=True)
        self.attach_readers(None)
        try:
            self.store.close()
        except StoreUnavailable as exc:
            log.warning("[galahad] closing the store: %s", exc)


def _spread(n: int, k: int) -> list[int]:
    """At most k indices of range(n), evenly spread, the first and the last included."""
    if n <= k:
        return list(range(n))
    if k <= 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _least(a: int | None, b: int | None) -> int | None:
    """The smaller of two bounds, either of which may be absent."""
    return b if a is None else a if b is None else min(a, b)
