"""The service over the real filesystem store, for what vLLM's engine thread asks of it.

Commits written on the commit threads (`commit_later`, the engine's step does not wait): every
entry whose parts are durable is committed, each result is its own, an entry missing a part is
not committed, and committing again gives the same answers. A hit's page-cache residency is told from a spread sample of its entries.
The `evicted` counter is what the store evicted to stay under its size cap, each eviction counted once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.format.codec import cipher_lookup
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Chunking, Span
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.checksum import Xxh3FrameCheck
from galahad.app.service import KVCacheService, SegmentSpec

BLOCK = 16


def _service(root: Path, max_bytes: int | None = None, **options: Any) -> KVCacheService:
    ns = Namespace(model="commits", model_fingerprint="commits", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),),
                   payload_order=PayloadOrder.CHUNK)
    check = Xxh3FrameCheck()
    root.mkdir(mode=0o700, exist_ok=True)
    store = FilesystemBlockStore(root, ns, rescan_s=None, max_bytes=max_bytes)
    return KVCacheService(namespace=ns, store=store, chunking=Chunking(PayloadOrder.CHUNK, BLOCK),
                          layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check), **options)


def _saved(svc: KVCacheService, n: int, skip: int = -1) -> list:
    keys = svc.keys(list(range(n * 64 + 1)), svc.seed())
    entries = [keys[svc.chunking.key_index(64 * (i + 1))] for i in range(n)]
    segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
    for i, key in enumerate(entries):
        if i != skip:
            assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segment, [bytes([i]) * (2 * BLOCK * 4 * 4)])
    return entries


def _disk_asks(svc: KVCacheService) -> list[ChainKey]:
    """The keys the service's fs store asks the disk about from now on (a marker's look-up each)."""
    asked: list[ChainKey] = []
    is_committed = svc.store._is_committed

    def counted(key: ChainKey) -> bool:
        asked.append(key)
        return is_committed(key)

    svc.store._is_committed = counted  # type: ignore[method-assign]
    return asked


def test_commits_made_later_run_on_the_commit_threads_each_result_its_own(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    entries = _saved(svc, 20, skip=3)  # entry 3 never written: cannot be committed
    expect = [i != 3 for i in range(20)]
    assert [f.result(timeout=30) for f in [svc.commit_later(key) for key in entries]] == expect
    assert [svc.is_committed(k) for k in entries] == expect
    again = [f.result(timeout=30) for f in [svc.commit_later(key) for key in entries]]
    assert again == expect  # committing again: the same answers, no error
    svc.close()


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_hits_residency_is_told_from_a_spread_sample_of_its_entries(tmp_path: Path) -> None:
    svc = _service(tmp_path / "store")
    entries = _saved(svc, 20)
    for key in entries:
        svc.commit(key)
    hit = svc.lookup(list(range(20 * 64 + 1)), svc.seed())
    assert hit is not None and len(hit.entries) == 20
    store = svc.store
    asked: list[bytes] = []
    share_of = store.resident_share

    def counted(key, part):  # type: ignore[no-untyped-def]
        asked.append(key.raw)
        return share_of(key, part)

    store.resident_share = counted  # type: ignore[method-assign]
    nbytes, share = svc.residency(hit)
    assert nbytes == sum(store.part_size(k, 0) for _s, k in hit.entries)
    assert share == pytest.approx(1.0)
    assert len(asked) == 8 and asked[0] == hit.entries[0][1].raw and asked[-1] == hit.entries[-1][1].raw
    for _span, key in hit.entries[10:]:  # the page cache lets go of the second half
        _drop(os.path.join(store._leaf(key.hex), _part_name(key.hex)))
    _nbytes, share = svc.residency(hit)
    if share is not None and share > 0.9:
        pytest.skip("this filesystem keeps files in memory whatever (tmpfs)")
    assert share == pytest.approx(0.5, abs=0.15)
    svc.close()


def _part_name(keyhex: str) -> str:
    from galahad.adapters.fs.layout import part_name

    return part_name(keyhex, 0)


def _asks(svc: KVCacheService) -> list[bytes]:
    """The keys the store is asked `is_committed` of from now on, one by one or many at once
    (`first_committed`), in order."""
    asked: list[bytes] = []
    is_committed = svc.store.is_committed

    def counted(key: ChainKey) -> bool:
        asked.append(key.raw)
        return is_committed(key)

    def counted_many(keys: list[ChainKey]) -> int | None:  # FindsCommitted: asked in order, up to the first found
        found = first_committed(keys)
        asked.extend(key.raw for key in keys[: len(keys) if found is None else found + 1])
        return found

    first_committed = svc.store.first_committed
    svc.store.is_committed = counted  # type: ignore[method-assign]
    svc.store.first_committed = counted_many  # type: ignore[method-assign]
    svc.store = svc.store  # the service takes the store's (counted) capabilities again
    return asked


@pytest.mark.parametrize("order", [PayloadOrder.CHUNK, PayloadOrder.LAYER])
def test_a_lookup_after_an_earlier_hit_reads_only_beyond_it_and_finds_what_was_committed_since(
        tmp_path: Path, order: PayloadOrder) -> None:
    ns = Namespace(model="after", model_fingerprint="after", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),), payload_order=order)
    check = Xxh3FrameCheck()
    (tmp_path / "store").mkdir(mode=0o700)
    chunking = Chunking(order, BLOCK, min_tokens=64)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(tmp_path / "store", ns, rescan_s=None),
                         chunking=chunking, layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check))
    tokens = list(range(8 * chunking.step + 1))
    keys = svc.keys(tokens, svc.seed())
    ends = sorted(chunking.probe_ends(len(tokens)))
    segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]

    def commit(end: int) -> None:
        key = keys[chunking.key_index(end)]
        assert svc.save_part(key, chunking.span_ending_at(end), 0, segment, [bytes(2 * BLOCK * 4 * 4)])
        assert svc.commit(key)

    for end in (ends[:3] if order is PayloadOrder.CHUNK else [ends[2]]):
        commit(end)
    first = svc.lookup(tokens, svc.seed(), keys=keys)
    assert first is not None and first.end == ends[2]
    asked = _asks(svc)
    beyond = {keys[chunking.key_index(e)].raw for e in ends[3:]}
    assert svc.lookup(tokens, svc.seed(), keys=keys, after=first) == first  # nothing new: the same hit
    assert asked and set(asked) <= beyond  # and nothing at or before it was read again
    for end in (ends[3:5] if order is PayloadOrder.CHUNK else [ends[4]]):
        commit(end)
    asked.clear()
    later = svc.lookup(tokens, svc.seed(), keys=keys, after=first)
    assert later is not None and later.end == ends[4]
    if order is PayloadOrder.CHUNK:  # the entries found before, then the new ones (layer: one entry)
        assert later.entries[: len(first.entries)] == first.entries
    assert asked and set(asked) <= beyond
    svc.close()


def test_a_layer_order_lookup_asks_each_end_once_longest_first_and_respects_what_is_already_there(
        tmp_path: Path) -> None:
    """The default order's lookup, the one a miss pays for at every block end: each end asked about once, longest first; the longest committed prefix found; none
    when the engine already has that many tokens."""
    ns = Namespace(model="layer", model_fingerprint="layer", dtype="float32", kv_cache_dtype="auto",
                   block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),), payload_order=PayloadOrder.LAYER)
    check = Xxh3FrameCheck()
    (tmp_path / "store").mkdir(mode=0o700)
    chunking = Chunking(PayloadOrder.LAYER, BLOCK, min_tokens=BLOCK)
    svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(tmp_path / "store", ns, rescan_s=None),
                         chunking=chunking, layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check))
    tokens = list(range(40 * BLOCK + 5))
    keys = svc.keys(tokens, svc.seed())
    ends = chunking.probe_ends(len(tokens))  # longest first
    asked = _asks(svc)
    assert svc.lookup(tokens, svc.seed(), keys=keys) is None
    assert asked == [keys[chunking.key_index(e)].raw for e in ends]  # a miss: every end, once, in order
    for end in (ends[30], ends[12]):  # two prefixes stored: the longer one is the hit
        key = keys[chunking.key_index(end)]
        assert svc.save_part(key, chunking.span_ending_at(end), 0, [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))],
                             [bytes(2 * BLOCK * 4 * 4)])
        assert svc.commit(key)
    asked.clear()
    hit = svc.lookup(tokens, svc.seed(), keys=keys)
    assert hit is not None and hit.end == ends[12] and len(asked) == 13
    assert svc.lookup(tokens, svc.seed(), keys=keys, already=ends[12] - 1) == hit
    assert svc.lookup(tokens, svc.seed(), keys=keys, already=ends[12]) is None  # nothing longer than held
    svc.close()


def test_an_entry_evicted_after_its_lookup_is_a_missing_miss_not_a_quarantine(tmp_path: Path) -> None:
    """`quarantined` is an operator's damage alarm: an entry the cap evicted between the lookup
    and the load had nothing left to set aside, so it counts a `missing` miss and no quarantine.
    A committed entry whose part vanished (its marker still there) is set aside, and counted."""
    svc = _service(tmp_path / "store")
    gone, broken = _saved(svc, 2)
    for key in (gone, broken):
        assert svc.commit(key)
    assert svc.store.evict(svc.store.used_bytes() - svc.store.part_size(broken, 0)) == 1  # the older: `gone`
    assert not svc.store.is_committed(gone) and svc.store.is_committed(broken)
    assert svc.load_part(gone, 0) is None
    assert svc.counters.quarantined == 0 and svc.store.stats()["quarantined"] == 0
    assert svc.counters.as_dict()["refused_missing"] == 1
    os.unlink(os.path.join(svc.store._leaf(broken.hex), _part_name(broken.hex)))
    assert svc.load_part(broken, 0) is None
    assert svc.counters.quarantined == 1 and svc.store.stats()["quarantined_missing"] == 1
    assert not svc.store.is_committed(broken)
    svc.close()


@pytest.mark.parametrize("damage", ["truncated", "grown"])
def test_saving_a_damaged_entry_again_sets_it_aside_and_writes_it_anew(tmp_path: Path, damage: str) -> None:
    """A part cut short (or grown) after it was written: the next save of the entry used to find
    the name taken and skip, and the commit after it marked the damaged file committed again, so
    lookups hit an entry every load then refused. Now the save repairs it."""
    svc = _service(tmp_path / "store")
    (key,) = _saved(svc, 1)
    assert svc.commit(key)
    path = os.path.join(svc.store._leaf(key.hex), _part_name(key.hex))
    whole = open(path, "rb").read()
    if damage == "truncated":
        os.truncate(path, 1000)
    else:
        with open(path, "ab") as handle:
            handle.write(b"tail")
    segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
    assert svc.save_part(key, Span(0, 64), 0, segment, [bytes([0]) * (2 * BLOCK * 4 * 4)])  # written anew
    assert svc.commit(key)
    assert os.path.getsize(path) == len(whole)  # whole again (its salt is new, so not the same bytes)
    loaded = svc.load_part(key, 0)
    assert loaded is not None and bytes(loaded.payload) == bytes([0]) * (2 * BLOCK * 4 * 4)
    assert svc.counters.quarantined == 1 and svc.store.stats()["quarantined_damaged"] == 1
    assert not svc.save_part(key, Span(0, 64), 0, segment, [bytes([0]) * (2 * BLOCK * 4 * 4)])  # whole: skipped
    svc.close()


def test_the_evicted_counter_is_what_the_store_evicted_under_its_cap(tmp_path: Path) -> None:
    part = _service(tmp_path / "sizing")
    key = _saved(part, 1)[0]
    one = part.store.part_size(key, 0)
    part.close()
    svc = _service(tmp_path / "store", max_bytes=3 * one)  # room for three entries of one part
    assert svc.take_counters().evicted == 0
    for key in _saved(svc, 8):
        svc.commit(key)
    evictions = svc.store.stats()["evictions"]
    assert evictions >= 5  # eight entries, room for three
    assert svc.counted()
    assert svc.take_counters().evicted == evictions
    assert svc.take_counters().evicted == 0  # a delta: each eviction is counted once
    assert not svc.counted()  # nothing since: what the engine asks every step before it takes
    assert svc.store.evict(0) >= 1  # an eviction alone (no save counted beside it) is something to take
    assert svc.counted() and svc.take_counters().evicted >= 1 and not svc.counted()
    svc.count(lookups=1)
    assert svc.counted() and svc.take_counters().lookups == 1 and not svc.counted()
    svc.close()


@pytest.mark.parametrize("frame_kib", [4, 1024])
def test_parts_are_saved_with_the_services_frame_size_and_load_back_exact(tmp_path: Path, frame_kib: int) -> None:
    """The service's `frame_size` (4 MiB, the format's default) is the frame size written in the
    header of every part it saves, and such a part loads back byte for byte."""
    svc = _service(tmp_path / "store", frame_size=frame_kib << 10)
    key = svc.keys(list(range(65)), svc.seed())[svc.chunking.key_index(64)]
    payload = os.urandom(2 * BLOCK * 4 * 4 * 64)  # 32 KiB: several 4 KiB frames, one 1 MiB frame
    segment = [SegmentSpec(0, 0, 0, "float32", (64, 2, BLOCK, 4))]
    assert svc.save_part(key, Span(0, 64), 0, segment, [payload])
    assert svc.commit(key)
    part = svc.load_part(key, 0)
    assert part is not None and part.header.frame_size == frame_kib << 10
    assert b"".join(bytes(v) for v in part.segment_views()) == payload
    svc.close()


def test_a_saves_planning_asks_the_disk_only_about_entries_the_store_has_seen(tmp_path: Path) -> None:
    """A new prompt's save asks whether any of its 64-token entries is stored already, on the
    engine's thread. Once the store's scan at open is done, it asks the disk only about entries
    the store has seen (found by the scan, or written or committed through it since); the rest are
    new. One another process committed after the scan is saved again: the save finds its part in
    place and leaves it, and the entry stays committed."""
    svc = _service(tmp_path / "store")
    assert svc.store.wait_indexed(30)
    old = _saved(svc, 3)
    for key in old:
        assert svc.commit(key)
    asked = _disk_asks(svc)
    new = svc.keys(list(range(9000, 9000 + 10 * 64 + 1)), svc.seed())
    assert svc.first_committed(new) is None and asked == []  # all new: no system call
    assert svc.first_committed(new[:4] + [old[1]] + new[4:]) == 4 and asked == [old[1]]

    check = Xxh3FrameCheck()  # another process's service over the same store root
    other = KVCacheService(namespace=svc.namespace, store=FilesystemBlockStore(tmp_path / "store", svc.namespace,
                                                                                rescan_s=None),
                           chunking=svc.chunking, layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check))
    theirs = other.keys(list(range(4 * 64 + 1)), other.seed())[3]  # the three before it are `old`
    segment = [SegmentSpec(0, 0, 0, "float32", (1, 2, BLOCK, 4))]
    assert other.save_part(theirs, Span(192, 256), 0, segment, [bytes([3]) * (2 * BLOCK * 4 * 4)])
    assert other.commit(theirs)
    path = os.path.join(svc.store._leaf(theirs.hex), _part_name(theirs.hex))
    before = open(path, "rb").read()
    asked.clear()
    assert svc.first_committed([theirs]) is None and asked == []  # committed after the scan: taken as new
    assert not svc.save_part(theirs, Span(192, 256), 0, segment, [bytes([3]) * (2 * BLOCK * 4 * 4)])
    assert svc.has_part(theirs, 0) and svc.commit(theirs) and svc.store.is_committed(theirs)
    assert open(path, "rb").read() == before  # left as it was
    other.close()
    svc.close()


def test_a_store_whose_scan_failed_asks_the_disk_about_every_entry(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the scan at open did not go through the root, the index may lack entries the folder
    holds: a save's planning then asks the disk about each one, so an entry stored before (one to
    keep, or one sealed under a retired key to replace) is found. The scan is made to fail by
    replacing it with one that raises: as root, nothing in a real folder makes it fail here."""
    svc = _service(tmp_path / "store")
    old = _saved(svc, 2)
    for key in old:
        assert svc.commit(key)
    svc.close()

    def failing(*_args: Any, **_kwargs: Any) -> None:
        raise OSError("the store's root cannot be listed")

    monkeypatch.setattr("galahad.adapters.fs.scan.scan_root", failing)
    again = _service(tmp_path / "store")
    assert again.store.wait_indexed(30)  # the scan ended (failed)
    asked = _disk_asks(again)
    assert not again.store.unseen(old[1])
    assert again.first_committed(old) == 0 and asked == [old[0]]
    again.close()
