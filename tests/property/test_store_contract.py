"""The BlockStore contract: every store adapter agrees with the in-memory reference, step by step.

One `RuleBasedStateMachine` drives the reference (`InMemoryBlockStore`) and a store under test
through the same puts, reads, commits, quarantines, evictions under a small size cap and restarts
(close and reopen the same folder), and checks after every step that they agree: the results,
the errors, the bytes used, the committed entries, which parts exist and the counters. Reads
include ranged reads through `open_reader`, and readers held open across other steps (the parts
they hold must read the same whatever happens to them meanwhile, and their entries must not be
evicted while they are open).

A variant is a pair: a factory opening the store under test on a folder (called again at each
restart) and a transform applied to every generated payload before it is put into both stores.
The encrypted variant seals payloads with `galahad.format.codec` there, so both stores hold sealed
blocks of the same sizes. To add one:

    TestEncryptedStore = contract_test(StoreVariant("encrypted", open_filesystem_store, seal))
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from galahad.format import codec
from galahad.adapters.crypto.aesgcm import AesGcmCipher
from galahad.adapters.fs import FilesystemBlockStore
from galahad.adapters.memory import InMemoryBlockStore
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from galahad.domain.namespace import GroupKind, KVGroup, Namespace
from galahad.domain.secret import SecretKey
from galahad.format.v1 import BlockHeader, Segment
from galahad.ports.store import BlockStore, PartReader

NAMESPACE = Namespace(
    model="contract-test",
    model_fingerprint="0" * 64,
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    block_size=16,
    groups=(KVGroup(GroupKind.FULL, 16, 2),),
)
KEYS = [ChainKey(hashlib.sha256(b"contract key %d" % i).digest()) for i in range(3)]
PARTS = range(2)
REASONS = ["damaged", "missing", "io"]
CAPS = [None, 3, 6]  # caps in units of a transformed 200-byte payload (payloads are 0 to 400 bytes)
COUNTERS = ("evictions", "evicted_bytes", "quarantined", "puts_skipped") + tuple(f"quarantined_{r}" for r in REASONS)

# The machine checks agreement, not durability (tests/integration/test_fs_crash.py does): RAM
# makes its fsyncs free.
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

keys = st.sampled_from(KEYS)
parts = st.sampled_from(PARTS)
# Sizes drawn outright (Hypothesis keeps generated binaries short): tiny, or 100 to 400 bytes.
payloads = st.one_of(
    st.binary(max_size=8),
    st.builds(lambda size, seed: random.Random(seed).randbytes(size), st.integers(100, 400), st.integers(0, 255)),
)
cuts = st.lists(st.integers(0, 400), max_size=3)  # where a blob is cut into a sequence of buffers
# ranged reads: (offset, the sizes of the buffers one preadv fills), offsets past the end included
ranges = st.tuples(st.integers(0, 700), st.lists(st.integers(0, 300), min_size=1, max_size=3))
kinds = st.sampled_from(["bytes", "bytearray", "memoryview", "buffers"])


def identity(key: ChainKey, part: int, payload: bytes) -> bytes:
    return payload


def open_filesystem_store(folder: Path, max_bytes: int | None, **options: Any) -> FilesystemBlockStore:
    """The filesystem store on `folder`, indexed (so its size accounting is complete)."""
    store = FilesystemBlockStore(folder, NAMESPACE, max_bytes=max_bytes or 1 << 40, **options)
    if not store.wait_indexed(timeout=30):
        raise AssertionError("the store's scan did not finish")
    return store


@attrs.frozen
class StoreVariant:
    """A store under test: how to open it on a folder with a cap, and what a payload becomes."""

    name: str
    open_store: Callable[[Path, int | None], BlockStore]
    transform: Callable[[ChainKey, int, bytes], bytes] = identity


class StoreComparison(RuleBasedStateMachine):
    variant: ClassVar[StoreVariant]

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="galahad-contract-", dir=SCRATCH))
        self.subject: Any = None
        self.held: list[tuple[PartReader, PartReader]] = []  # (reference's, subject's), open

    @initialize(units=st.sampled_from(CAPS))
    def open_stores(self, units: int | None) -> None:
        # A unit is what a 200-byte payload becomes, so a transform that adds a header and tags
        # (the encrypted variant) meets caps as tight as the plain one does.
        self.unit = len(self.variant.transform(KEYS[0], 0, bytes(200)))
        self.cap = None if units is None else units * self.unit
        self.reference = InMemoryBlockStore(max_bytes=self.cap)
        self.subject = self.variant.open_store(self.folder / "store", self.cap)
        self.baseline: dict[str, int] = {}

    def teardown(self) -> None:
        self.release_all()
        if self.subject is not None:
            self.subject.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def agree(self, call: Callable[[Any], Any]) -> Any:
        """Run `call` on both stores: same result, or the same error class. Returns the result."""
        outcomes = []
        for store in (self.reference, self.subject):
            try:
                outcomes.append(("returned", call(store)))
            except (StoreUnavailable, ValueError) as exc:
                outcomes.append(("raised", type(exc)))
        assert outcomes[0] == outcomes[1], f"reference {outcomes[0]!r} but {self.variant.name} {outcomes[1]!r}"
        return outcomes[0][1]

    # -- rules: puts weigh triple and removals a fraction, or restarts would find empty stores --

    def _put(self, key: ChainKey, part: int, payload: bytes, cuts: list[int], kind: str) -> None:
        blob = self.variant.transform(key, part, payload)
        data: Any = {"bytes": blob, "bytearray": bytearray(blob), "memoryview": memoryview(blob)}.get(kind)
        if data is None:
            bounds = [0, *sorted(c % (len(blob) + 1) for c in cuts), len(blob)]
            data = [memoryview(blob)[a:b] for a, b in zip(bounds, bounds[1:])]
        self.agree(lambda s: s.put(key, part, data))

    @rule(key=keys, part=parts, payload=payloads, cuts=cuts, kind=kinds)
    def put(self, key: ChainKey, part: int, payload: bytes, cuts: list[int], kind: str) -> None:
        self._put(key, part, payload, cuts, kind)

    @rule(key=keys, part=parts, payload=payloads, cuts=cuts, kind=kinds)
    def put_again(self, key: ChainKey, part: int, payload: bytes, cuts: list[int], kind: str) -> None:
        self._put(key, part, payload, cuts, kind)

    @rule(key=keys, part=parts, payload=payloads, cuts=cuts, kind=kinds)
    def put_once_more(self, key: ChainKey, part: int, payload: bytes, cuts: list[int], kind: str) -> None:
        self._put(key, part, payload, cuts, kind)

    def _aim(self, key: ChainKey, part: int, pick: int | None) -> tuple[ChainKey, int]:
        """(key, part) as drawn, or with `pick`, one of the parts present (reads that hit)."""
        present = [(k, p) for k in KEYS for p in PARTS if self.reference.has_part(k, p)]
        return present[pick % len(present)] if pick is not None and present else (key, part)

    @rule(key=keys, part=parts, pick=st.none() | st.integers(0, 5))
    def get(self, key: ChainKey, part: int, pick: int | None) -> None:
        key, part = self._aim(key, part, pick)
        self.agree(lambda s: s.get(key, part))

    @rule(key=keys, part=parts, pick=st.none() | st.integers(0, 5), slack=st.integers(-2, 8))
    def read_into(self, key: ChainKey, part: int, pick: int | None, slack: int) -> None:
        key, part = self._aim(key, part, pick)
        size = self.reference.part_size(key, part) or 0

        def read(store: InMemoryBlockStore | FilesystemBlockStore) -> tuple[int | None, bytes]:  # beyond the port
            buf = bytearray(b"\xa5" * max(0, size + slack))
            return store.read_into(key, part, memoryview(buf)), bytes(buf)

        self.agree(read)

    @rule(key=keys, part=parts, pick=st.none() | st.integers(0, 5), reads=st.lists(ranges, max_size=4))
    def read_ranges(self, key: ChainKey, part: int, pick: int | None, reads: list[tuple[int, list[int]]]) -> None:
        key, part = self._aim(key, part, pick)

        def read(store: BlockStore) -> tuple[int, list[tuple[int, list[bytes]]]] | None:
            reader = store.open_reader(key, part)
            if reader is None:
                return None
            with reader:
                return reader.size, [_ranged(reader, offset, sizes) for offset, sizes in reads]

        self.agree(read)

    @rule(key=keys, part=parts, pick=st.none() | st.integers(0, 5), offset=st.integers(0, 700),
          size=st.integers(0, 700), step=st.integers(1, 300))  # fmt: skip
    def read_stepwise(self, key: ChainKey, part: int, pick: int | None, offset: int, size: int, step: int) -> None:
        """`read_stepwise` agrees with the reference's (`preadv` piece by piece): the count, the
        pieces handed over and the bytes, the part's end (a short last piece) included."""
        key, part = self._aim(key, part, pick)

        def read(store: BlockStore) -> tuple[int, list[bytes], bytes] | None:
            reader = store.open_reader(key, part)
            if reader is None:
                return None
            with reader:
                return _stepwise(reader, offset, size, step)

        self.agree(read)

    @rule(which=st.integers(0, 1), offset=st.integers(0, 700), size=st.integers(0, 700), step=st.integers(1, 300))
    def read_held_stepwise(self, which: int, offset: int, size: int, step: int) -> None:
        if self.held:
            ours, theirs = self.held[which % len(self.held)]
            assert _stepwise(ours, offset, size, step) == _stepwise(theirs, offset, size, step)

    @rule(key=keys, part=parts, pick=st.none() | st.integers(0, 5))
    def hold_reader(self, key: ChainKey, part: int, pick: int | None) -> None:
        """Open a reader on both stores and keep it open across the steps that follow."""
        if len(self.held) >= 2:
            return
        key, part = self._aim(key, part, pick)
        ours, theirs = self.reference.open_reader(key, part), self.subject.open_reader(key, part)
        assert (ours is None) == (theirs is None), f"reference {ours!r} but {self.variant.name} {theirs!r}"
        if ours is not None and theirs is not None:
            assert ours.size == theirs.size
            self.held.append((ours, theirs))

    @rule(which=st.integers(0, 1), offset=st.integers(0, 700), sizes=st.lists(st.integers(0, 300), min_size=1,
                                                                              max_size=3))
    def read_held(self, which: int, offset: int, sizes: list[int]) -> None:
        if self.held:
            ours, theirs = self.held[which % len(self.held)]
            assert _ranged(ours, offset, sizes) == _ranged(theirs, offset, sizes)

    @rule(which=st.integers(0, 1))
    def release_reader(self, which: int) -> None:
        if self.held:
            for reader in self.held.pop(which % len(self.held)):
                reader.close()

    def release_all(self) -> None:
        while self.held:
            for reader in self.held.pop():
                reader.close()

    @rule(key=keys, part=parts, how=st.sampled_from(["part_size", "has_part", "is_committed"]))
    def probe(self, key: ChainKey, part: int, how: str) -> None:
        self.agree(lambda s: getattr(s, how)(key) if how == "is_committed" else getattr(s, how)(key, part))

    @rule(asked=st.lists(keys, max_size=5))
    def first_committed(self, asked: list[ChainKey]) -> None:
        """`FindsCommitted`: the same answer in every store, and that of asking each in turn."""
        found = self.agree(lambda s: s.first_committed(asked))
        assert found == next((i for i, key in enumerate(asked) if self.reference.is_committed(key)), None)

    @rule(items=st.lists(st.tuples(keys, parts), max_size=4))
    def get_many(self, items: list[tuple[ChainKey, int]]) -> None:
        self.agree(lambda s: s.get_many(items))

    @rule(key=keys, wanted=st.sets(parts, max_size=3).map(lambda s: tuple(sorted(s))), whole=st.booleans())
    def commit(self, key: ChainKey, wanted: tuple[int, ...], whole: bool) -> None:
        """Commit the drawn parts, or (`whole`) the parts the entry has: commits that succeed."""
        present = tuple(p for p in PARTS if self.reference.has_part(key, p))
        if whole and present:
            wanted = present
        self.agree(lambda s: s.commit(key, wanted))

    @rule(key=keys, reason=st.sampled_from(REASONS), act=st.integers(0, 2))
    def quarantine(self, key: ChainKey, reason: str, act: int) -> None:
        if act == 0:
            self.agree(lambda s: s.quarantine(key, reason))

    @rule(free=st.integers(1, 600), act=st.integers(0, 1))
    def evict(self, free: int, act: int) -> None:
        """Free a few bytes: removes just the least recently used entries, so order shows."""
        to_bytes = max(0, self.reference.used_bytes() - free * self.unit // 200)
        if act == 0:
            self.agree(lambda s: s.evict(to_bytes))

    @rule(drain=st.booleans())
    def restart(self, drain: bool) -> None:
        """Close and reopen the same folder; with `drain`, then check that recency survived it by
        evicting every entry, least recently used first, one at a time."""
        self.release_all()
        self.subject.close()
        self.subject = self.variant.open_store(self.folder / "store", self.cap)
        self.baseline = {name: self.reference.stats().get(name, 0) for name in COUNTERS}
        while drain and self.reference.used_bytes():
            to_bytes = self.reference.used_bytes() - 1
            self.agree(lambda s: s.evict(to_bytes))
            self.same_parts_present()

    # -- after every step --------------------------------------------------------------------

    @invariant()
    def same_bytes_used(self) -> None:
        if self.subject is not None:
            assert self.reference.used_bytes() == self.subject.used_bytes()

    @invariant()
    def same_committed_entries(self) -> None:
        if self.subject is not None:
            assert set(self.reference.committed()) == set(self.subject.committed())

    @invariant()
    def same_parts_present(self) -> None:
        if self.subject is not None:
            for key in KEYS:
                for part in PARTS:
                    assert self.reference.has_part(key, part) == self.subject.has_part(key, part), (key, part)

    @invariant()
    def same_counters(self) -> None:
        if self.subject is not None:
            ours, theirs = self.reference.stats(), self.subject.stats()
            for name in COUNTERS:
                assert ours.get(name, 0) - self.baseline.get(name, 0) == theirs.get(name, 0), name


def _ranged(reader: PartReader, offset: int, sizes: list[int]) -> tuple[int, list[bytes]]:
    """One `preadv` into fresh buffers of `sizes` (prefilled, so untouched bytes show)."""
    buffers = [bytearray(b"\xa5" * n) for n in sizes]
    count = reader.preadv(offset, [memoryview(b) for b in buffers])
    return count, [bytes(b) for b in buffers]


def _stepwise(reader: PartReader, offset: int, size: int, step: int) -> tuple[int, list[bytes], bytes]:
    """One `read_stepwise` into a fresh buffer of `size` (prefilled, so untouched bytes show):
    the count, each piece as it was handed over, and the buffer after."""
    buffer = bytearray(b"\xa5" * size)
    seen: list[bytes] = []
    count = reader.read_stepwise(offset, memoryview(buffer), step, lambda piece: seen.append(bytes(piece)))
    return count, seen, bytes(buffer)


def contract_test(variant: StoreVariant, share: float = 1.0) -> type[unittest.TestCase]:
    """The state machine as a test case for one variant, with `share` of the profile's examples."""
    machine = type(f"{variant.name.title()}Comparison", (StoreComparison,), {"variant": variant})
    case: type[unittest.TestCase] = machine.TestCase
    case.settings = settings(  # type: ignore[attr-defined]
        settings.default,
        max_examples=max(10, int(settings.default.max_examples * share)),
        deadline=None,
        stateful_step_count=40,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return case


TestFilesystemStore = contract_test(StoreVariant("filesystem", open_filesystem_store))


# -- the encrypted variant: payloads sealed with AES-256-GCM through the codec, as the service does --

_SECRET = SecretKey(hashlib.sha256(b"contract test key").digest())
_CIPHER = AesGcmCipher(_SECRET)


def seal(key: ChainKey, part: int, payload: bytes) -> bytes:
    """A sealed block file holding `payload` (a deterministic salt, so both stores get equal bytes)."""
    header = BlockHeader(
        namespace=NAMESPACE.digest(), chain_key=key.raw, token_start=0, token_end=64, rank=part,
        world=max(part + 1, 1), block_size=NAMESPACE.block_size,
        segments=(Segment(group=0, kind=0, dtype="uint8", layer=0, shape=(len(payload),)),),
        frame_size=4096,
    )
    salt = hashlib.sha256(key.raw + part.to_bytes(4, "little")).digest()[:16]
    blob = b"".join(bytes(c) for c in codec.seal_part(header, [payload], _CIPHER, salt=salt))
    opened = codec.open_part(blob, expect=codec.Expect(chain_key=key.raw, rank=part),
                             ciphers=codec.cipher_lookup(_CIPHER))
    assert bytes(opened.payload) == payload
    return blob


TestEncryptedStore = contract_test(StoreVariant("encrypted", open_filesystem_store, seal), share=0.25)
