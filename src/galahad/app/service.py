"""Use cases: look up, save, load, commit and quarantine KV entries of one namespace.

The engine adapters (vLLM connector, SGLang backend) call this; it applies the failure policy
(a block that fails is a miss, counted, and its entry quarantined) and never lets a store, format
or cipher error reach the engine: every public method returns a value.

`KVCacheService` is the one object they hold; each concern is a collaborator it owns, in a
module of its own: lookups (lookup.py), which committed entries this process can open
(verdict.py), loads and their refusal policy (load.py), saves (save.py), what the store can
tell before reading (readahead.py) and the counters and warnings (tally.py). The service keeps
the thread pools, the helper processes and the commits, and lends the pools per call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from galahad.domain.chain import ChainKey, ChainSeed, chain_keys
from galahad.domain.chunking import Chunking, Span
from galahad.domain.counter import Counters, MissReason
from galahad.domain.error import StoreUnavailable
from galahad.domain.namespace import Namespace
from galahad.domain.rank import RankLayout
from galahad.format.codec import CipherLookup
from galahad.format.fanout import LastingPool, submit_all
from galahad.format.v1 import DEFAULT_FRAME_SIZE, CipherId
from galahad.ports.cipher import Cipher
from galahad.ports.helpers import HelperRecipe, PartHelpers, PartWriters
from galahad.ports.store import BlockStore, Buffer, FindsCommitted, KnowsSeen
from galahad.app import readahead
from galahad.app.load import LoadedPart, PartLoader
from galahad.app.lookup import Hit, OtherLayout, in_other_layouts, longest_hit
from galahad.app.priority import LoadsFirst
from galahad.app.save import PartSaver
from galahad.app.segment import SegmentSpec
from galahad.app.tally import Tally
from galahad.app.verdict import REPLACE, Verdicts

__all__ = ["CipherLookup", "Hit", "KVCacheService", "LoadedPart", "OtherLayout", "SegmentSpec"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


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
        writer_processes: int = 0,
        save_yield_s: float = 0.0,
        frame_size: int = DEFAULT_FRAME_SIZE,
        allocate_sealed: Callable[[int], Buffer] = bytearray,
    ) -> None:
        self.namespace = namespace
        self.digest = namespace.digest()
        self.chunking = chunking
        self.layout = layout
        self._tally = Tally(store)
        self.sealed = cipher.cipher_id != CipherId.XXH3  # saves are encrypted (loads may meet both)
        self._verdicts = Verdicts(store=store, ciphers=ciphers, sealed=self.sealed, retired_keys=retired_keys,
                                  retired_record=retired_record, tally=self._tally)
        self._loader = PartLoader(store=store, layout=layout, digest=self.digest, ciphers=ciphers, tally=self._tally,
                                  quarantine=self.quarantine, forget=self._verdicts.forget)
        self._saver = PartSaver(store=store, namespace=namespace, digest=self.digest, layout=layout, cipher=cipher,
                                frame_size=frame_size, tally=self._tally, quarantine=self.quarantine,
                                allocate=allocate_sealed)
        self.store = store
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
        self._readers: PartHelpers | None = None  # helper processes reading loads (`attach_readers`)
        self.helper_recipe = helper_recipe  # how such a helper builds `ciphers`; None: no helpers
        self.reader_processes = reader_processes  # how many the engine adapter starts (0: none)
        self.writer_processes = writer_processes  # helper processes sealing saves (`attach_writers`; 0: none)
        self.frame_size = frame_size  # the checksum frames of the parts this service saves
        self.loads_first = LoadsFirst(save_yield_s)  # saves wait a bounded while for running loads

    @property
    def store(self) -> BlockStore:
        """The namespace's store. Set, it is the store every use case uses from then on (a test
        wraps it in one that fails)."""
        return self._store

    @store.setter
    def store(self, store: BlockStore) -> None:
        self._store = self._verdicts.store = self._loader.store = self._saver.store = store
        self._finds = store.first_committed if isinstance(store, FindsCommitted) else None
        self._unseen = store.unseen if isinstance(store, KnowsSeen) else None

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
        holds, taken as committed without asking the store. Only entries this process can open
        are offered (verdict.py)."""
        try:
            ends = self.chunking.probe_ends(len(tokens))
            if not ends or ends[0] <= already:
                return None
            store_committed, opens = self.store.is_committed, self._verdicts.opens
            is_committed = lambda k: store_committed(k) and opens(k)  # noqa: E731
            committed = is_committed if held is None else (lambda k: held(k) or is_committed(k))
            keys = list(keys) if keys is not None else self.keys(tokens, seed)
            finds = self._finds
            first = None if finds is None else functools.partial(self._first_offered, finds, held)
            return longest_hit(self.chunking, ends, keys, already, after, committed, first)
        except StoreUnavailable as exc:
            self._tally.warn_once("lookup", "[galahad] store lookup failed, serving without hits: %s", exc)
            return None

    def _first_offered(self, finds: Callable[[Sequence[ChainKey]], int | None], held: Callable[[ChainKey], bool] | None,
                       keys: Sequence[ChainKey]) -> int | None:
        """The index of the first of `keys` a lookup offers (held, or committed and openable),
        the store asked of them all at once (`finds`: its `FindsCommitted.first_committed`)."""
        limit = len(keys)
        if held is not None:  # held entries are offered as they are: none beyond the first held
            limit = next((i for i, key in enumerate(keys) if held(key)), limit)
        at = 0
        while at < limit:
            found = finds(keys[at:limit])
            if found is None:
                break
            if self._verdicts.opens(keys[at + found]):
                return at + found
            at += found + 1  # committed, but not one this process can open: look further
        return limit if limit < len(keys) else None

    def in_other_layout(self, tokens: Sequence[int], seed: ChainSeed, *, already: int = 0) -> bool:
        """Whether another layout of this model (`other_layouts`) holds a committed entry for a
        prefix of `tokens` longer than `already`: a miss here that is a namespace miss. Nothing
        of that layout is read: its keys are derived and its commit markers looked at. Free when
        the store holds no other layout; otherwise a few stats per probe end."""
        if not self.other_layouts:
            return False
        try:
            return in_other_layouts(self.other_layouts, self.chunking, tokens, seed, already)
        except StoreUnavailable:
            return False

    # -- saving and committing ------------------------------------------------------------------

    def save_part(self, key: ChainKey, span: Span, rank: int, segments: Sequence[SegmentSpec],
                  payload: Sequence[Buffer], *, shared_at: int | None = None) -> bool:
        """Seal and write one rank's part of an entry. False (counted) when skipped or present.
        `shared_at`: the payload's buffers lie one after another in the attached writers' region
        from this byte on, so a writer process seals and writes the part (`attach_writers`)."""
        return self._saver.save(key, span, rank, segments, payload, pool=self._frames, shared_at=shared_at)

    def attach_writers(self, writers: PartWriters | None) -> None:
        """Let `writers` (helper processes over a shared region) seal and write the parts saved
        from that region (`save_part(shared_at=...)`); None detaches. The service closes it."""
        old, self._saver.writers = self._saver.writers, writers
        if old is not None and old is not writers:
            old.close()

    @property
    def writers(self) -> PartWriters | None:
        """The attached writer processes (None: every part is sealed in this process)."""
        return self._saver.writers

    def commit(self, key: ChainKey) -> bool:
        """Record the entry as committed once every rank's part is durable (all ranks or nothing)."""
        try:
            committed = self.store.commit(key, self.layout.parts())
        except StoreUnavailable as exc:
            self._tally.warn_once("commit", "[galahad] commit skipped: %s", exc)
            return False
        if committed:  # perhaps new files at the entry's name: its header is read again
            self._verdicts.forget(key)
        return committed

    def commit_later(self, key: ChainKey) -> Future[bool]:
        """`commit` on the commit threads: the caller (vLLM's engine thread) does not wait for
        the marker's disk round trip; the future says whether it was committed."""
        return self._commits.submit(self.commit, key)

    def commit_all_later(self, keys: Sequence[ChainKey]) -> list[Future[bool]]:
        """`commit_later` of each of `keys`, handed to the commit threads at once (`submit_all`):
        a step acknowledges dozens of entries, and each hand-over costs the engine thread."""
        return submit_all(self._commits, [functools.partial(self.commit, key) for key in keys])

    def is_committed(self, key: ChainKey) -> bool:
        try:
            return self.store.is_committed(key)
        except StoreUnavailable:
            return False

    def first_committed(self, keys: Sequence[ChainKey]) -> int | None:
        """The index of the first of `keys` the store holds committed (None: none, or the store
        cannot tell now), for a save's planning: a prompt's save asks about each of its 64-token
        entries, and most are new. Those the store has not seen are new, not asked about
        (`KnowsSeen`); the rest are asked in one call where the store can (`FindsCommitted`)."""
        unseen = self._unseen
        asked = range(len(keys)) if unseen is None else [i for i, k in enumerate(keys) if not unseen(k)]
        if not asked:
            return None
        some = keys if len(asked) == len(keys) else [keys[i] for i in asked]
        try:
            if self._finds is not None:
                found = self._finds(some)
            else:
                found = next((i for i, key in enumerate(some) if self.store.is_committed(key)), None)
        except StoreUnavailable:
            return 0  # unknown: every key is asked on its own (`holds`)
        return None if found is None else asked[found]

    def holds(self, key: ChainKey) -> bool:
        """Whether a save of `key` has nothing to do: the entry is committed, and this process can
        open it or keeps it unopened (sealed under a key it does not hold, which may come back: a
        wrong or missing key setting loses nothing). A committed entry sealed under a key retired
        on purpose, or checksum-only where a key is set (`REPLACE`, verdict.py), is set aside
        first, as quarantine reason `key` (the store keeps the newest such files in its
        quarantine folder), so the save writes it anew under the key in use: after a rotation, a
        prompt used again is cached again instead of missing until the store evicts it
        (docs/security.md)."""
        try:
            if not self.store.is_committed(key):
                return False
            if self._verdicts.verdict(key) != REPLACE:
                return True
        except StoreUnavailable:
            return False  # the save will meet the same store, and count what it cannot do
        self._verdicts.forget(key)
        try:
            self.store.quarantine(key, MissReason.KEY)
        except StoreUnavailable as exc:
            self._tally.warn_once("quarantine", "[galahad] quarantine failed: %s", exc)
            return True  # the old files stay in the way: nothing to write over them
        return False

    def offers(self, key: ChainKey) -> bool:
        """Whether a lookup offers the entry: committed, and one this process can open.
        For engines that ask entry by entry (SGLang's `exists`)."""
        try:
            return self.store.is_committed(key) and self._verdicts.opens(key)
        except StoreUnavailable:
            return False

    def has_part(self, key: ChainKey, rank: int) -> bool:
        """Whether this rank's part of the entry is already stored (a save would be a no-op)."""
        try:
            return self.store.has_part(key, self.layout.part_of(rank))
        except StoreUnavailable:
            return False

    # -- before reading (readahead.py) ----------------------------------------------------------

    def residency(self, hit: Hit, held: Callable[[ChainKey], bool] | None = None) -> tuple[int, float | None]:
        """Bytes one rank reads to load `hit`, and the share of them in memory now (None:
        unknown); entries `held` read nothing (`readahead.residency`)."""
        return readahead.residency(self.store, self.layout.part_of(0), hit, held)

    def recent_parts(self, rank: int, budget: int, *, wait_s: float = readahead.RECENT_WAIT_S,
                     cost: Callable[[int], int] | None = None) -> list[tuple[ChainKey, int]]:
        """This rank's parts of the most recently used committed entries, newest first, with
        their files' sizes, as many as fit in `budget` bytes (`readahead.recent_parts`): what a
        restarted worker reads ahead (`GALAHAD_PRELOAD_BYTES`)."""
        if budget <= 0:
            return []
        return readahead.recent_parts(self.store, self.layout.part_of(rank), budget, wait_s=wait_s,
                                      tally=self._tally, cost=cost)

    # -- loading and quarantine (load.py) -------------------------------------------------------

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
        return self._loader.load(
            key, rank, out=out, fail=self.draw_fault() if fail is None else fail, progress=progress,
            pool=self._frames if fan_out else None, readers=self._readers, region_offset=region_offset,
            segments=segments, max_bytes=max_bytes,
        )

    def attach_readers(self, readers: PartHelpers | None) -> None:
        """Let `readers` (helper processes over a shared region) read the parts of loads into
        that region (`load_part(region_offset=...)`); None detaches. The service closes it."""
        old, self._readers = self._readers, readers
        if old is not None and old is not readers:
            old.close()

    def last_miss(self) -> str:
        """Why the last `load_part` of the calling thread returned None (a `MissReason`; "" if it
        did not miss)."""
        return self._loader.last_miss()

    def quarantine(self, key: ChainKey, reason: str) -> None:
        """Uncommit the entry and set its parts aside so no rank offers it again."""
        self._verdicts.forget(key)
        try:
            if not self.store.quarantine(key, reason):
                return  # already gone (evicted since the lookup): nothing set aside, nothing counted
        except StoreUnavailable as exc:
            self._tally.warn_once("quarantine", "[galahad] quarantine failed: %s", exc)
            return
        self._tally.add(quarantined=1)

    def clear(self) -> int | None:
        """Set aside every committed entry of this namespace (an operator's reset); returns the
        count, or None when the store could not list them (said once)."""
        try:
            keys = list(self.store.committed())
        except StoreUnavailable as exc:
            self._tally.warn_once("clear", "[galahad] clear failed: %s", exc)
            return None
        for key in keys:
            self.quarantine(key, "cleared")
        return len(keys)

    # -- plumbing and counters ------------------------------------------------------------------

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
            self._tally.add(save_wait_seconds=waited)

    def submit_save(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)` on the service's save pool (apart from loads)."""
        return self._saves.submit(fn, *args)

    def submit_saves(self, fns: Sequence[Callable[[], _T]]) -> list[Future[_T]]:
        """Run each of `fns` on the save pool, handed over at once (`submit_all`)."""
        return submit_all(self._saves, fns)

    @property
    def counters(self) -> Counters:
        """The counts since the last `take_counters` (live: read them, do not keep them)."""
        return self._tally.counters

    def take_counters(self) -> Counters:
        """The counts since the last take, resetting them (per-report deltas). `evicted` is what
        this service's store evicted meanwhile (each service opens its own store)."""
        return self._tally.take()

    def counted(self) -> bool:
        """Whether `take_counters` would give anything now (cheap: asked every engine step)."""
        return not self._tally.idle()

    def snapshot_counters(self) -> Counters:
        """A copy of the counts so far, without resetting them."""
        return self._tally.snapshot()

    def count_refused(self, reason: str) -> None:
        """Count a part not loaded, by reason (`load_failures`, `refused_<reason>`; thread-safe)."""
        self._tally.refused(reason)

    def count_skipped(self, reason: str) -> None:
        """Count a part not saved, by reason (`SkipReason`; thread-safe)."""
        self._tally.skipped(reason)

    def count(self, **deltas: int | float) -> None:
        """Add to counters from an engine adapter (thread-safe)."""
        self._tally.add(**deltas)

    def close(self) -> None:
        """Finish queued saves and release the store."""
        self._saves.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._frames.shutdown(wait=True)
        self._commits.shutdown(wait=True)
        self.attach_readers(None)
        self.attach_writers(None)
        try:
            self.store.close()
        except StoreUnavailable as exc:
            log.warning("[galahad] closing the store: %s", exc)
