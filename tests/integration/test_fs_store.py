"""The filesystem store on a real folder: recency across restarts, large parts, batches, the cap
across namespaces, what a scan cleans, quarantine, in-flight reads, the manifest and tools' view."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from galahad.adapters.fs import FilesystemBlockStore, StoreRoot
from galahad.adapters.fs.layout import MANIFEST_NAME, QUARANTINE_DIR
from galahad.adapters.fs.scan import QUARANTINE_KEEP
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from helpers.store_worker import NAMESPACE

MiB = 1 << 20
OTHER = attrs.evolve(NAMESPACE, model="another model")


def key(n: int) -> ChainKey:
    return ChainKey(hashlib.sha256(b"store test %d" % n).digest())


def leaf(root: Path, k: ChainKey, ns: str = NAMESPACE.hex) -> Path:
    return root / f"ns-{ns}" / k.hex[0:2] / k.hex[2:4]


def open_store(root: Path, **options: object) -> FilesystemBlockStore:
    options.setdefault("max_bytes", 1 << 40)
    options.setdefault("rescan_s", None)
    store = FilesystemBlockStore(root, NAMESPACE, **options)  # type: ignore[arg-type]
    assert store.wait_indexed(30)
    return store


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _read(store: FilesystemBlockStore, how: str, k: ChainKey, buf: memoryview) -> None:
    def ranged() -> None:
        with store.open_reader(k, 0) as reader:  # type: ignore[union-attr]
            reader.preadv(0, [buf[:10]])

    {
        "get": lambda: store.get(k, 0),
        "read_into": lambda: store.read_into(k, 0, buf),
        "get_many": lambda: store.get_many([(k, 0)]),
        "read_many": lambda: store.read_many([(k, 0, buf)]),
        "open_reader": ranged,
    }[how]()


READS = ["get", "read_into", "get_many", "read_many", "open_reader"]


@pytest.mark.parametrize("read", READS)
def test_a_read_before_a_restart_still_counts_as_recent_after_it(tmp_path: Path, read: str) -> None:
    with open_store(tmp_path, max_bytes=1000) as store:
        for n in range(3):
            store.put(key(n), 0, bytes(300))
        _read(store, read, key(0), memoryview(bytearray(300)))
    with open_store(tmp_path, max_bytes=1000) as store:
        store.put(key(3), 0, bytes(300))  # over the cap: the least recently used goes
        assert [store.has_part(key(n), 0) for n in range(4)] == [True, False, True, True]


@pytest.mark.parametrize("read", READS)
def test_a_read_makes_its_entry_the_most_recently_used_at_once(tmp_path: Path, read: str) -> None:
    with open_store(tmp_path, max_bytes=1000) as store:
        for n in range(3):
            store.put(key(n), 0, bytes(300))
        _read(store, read, key(0), memoryview(bytearray(300)))
        store.put(key(3), 0, bytes(300))
        assert [store.has_part(key(n), 0) for n in range(4)] == [True, False, True, True]


def test_a_reader_reads_any_range_into_several_buffers_and_stops_at_the_end(tmp_path: Path) -> None:
    payload = os.urandom(3 * MiB + 4321)
    with open_store(tmp_path) as store:
        store.put(key(1), 0, payload)
        assert store.open_reader(key(2), 0) is None
        with store.open_reader(key(1), 0) as reader:  # type: ignore[union-attr]
            assert reader.size == len(payload)
            for offset, sizes in [(0, [len(payload)]), (1, [4095, 16, 5 * MiB]), (len(payload) - 5, [3, 3, 3]),
                                  (MiB + 17, [0, 2 * MiB + 1, 0, 7]), (len(payload), [10]), (len(payload) + 99, [1])]:
                buffers = [memoryview(bytearray(n)) for n in sizes]
                count = reader.preadv(offset, buffers)
                assert count == max(0, min(sum(sizes), len(payload) - offset))
                assert b"".join(bytes(b) for b in buffers)[:count] == payload[offset : offset + count]
            aligned = memoryview(mmap.mmap(-1, 2 * MiB))
            assert reader.preadv(4096, [aligned]) == 2 * MiB and aligned == payload[4096 : 4096 + 2 * MiB]
            with pytest.raises(ValueError):
                reader.preadv(0, [memoryview(bytes(10))])
            with pytest.raises(ValueError):
                reader.preadv(-1, [memoryview(bytearray(10))])
        with pytest.raises(ValueError, match="closed"):
            reader.preadv(0, [memoryview(bytearray(10))])
        reader.close()  # twice is fine


def test_a_reader_reads_step_by_step_handing_over_each_whole_piece_and_stops_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`read_stepwise`: the pieces in order, each handed over once read; the piece the part ends
    in is read but not handed over; buffered, one `os.preadv` a piece; bad arguments refused."""
    payload = os.urandom(3 * MiB + 4321)
    with open_store(tmp_path) as store:
        store.put(key(1), 0, payload)
        with store.open_reader(key(1), 0) as reader:  # type: ignore[union-attr]
            for offset, size, step in [(0, len(payload), 512 << 10), (4096, 2 * MiB, 512 << 10), (1, 5000, 999),
                                       (len(payload) - 700, 4096, 512), (len(payload), 10, 3), (17, 0, 5)]:
                view = memoryview(mmap.mmap(-1, max(size, 1)))[:size]
                seen: list[tuple[int, bytes]] = []
                count = reader.read_stepwise(offset, view, step, lambda p: seen.append((len(p), bytes(p))))
                want = max(0, min(size, len(payload) - offset))
                assert count == want and view[:count] == payload[offset : offset + count]
                last = [want % step] if want == size and want % step else []  # a short piece only if not the end
                assert [n for n, _ in seen] == [step] * (want // step) + last
                assert b"".join(b for _, b in seen) == payload[offset : offset + sum(n for n, _ in seen)]
            calls: list[int] = []
            real = os.preadv
            monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: calls.append(at) or real(fd, bufs, at))
            reader.read_stepwise(4096, memoryview(bytearray(2 * MiB)), 512 << 10, lambda p: None)
            monkeypatch.undo()
            assert calls == [4096 + k * (512 << 10) for k in range(4)]  # one read a piece, nothing else
            for offset, view, step in [(-1, memoryview(bytearray(10)), 4), (0, memoryview(bytes(10)), 4),
                                       (0, memoryview(bytearray(10)), 0)]:
                with pytest.raises(ValueError):
                    reader.read_stepwise(offset, view, step, lambda p: None)
            stop = RuntimeError("the check gave up")

            def fail(piece: memoryview) -> None:
                raise stop

            with pytest.raises(RuntimeError) as caught:
                reader.read_stepwise(0, memoryview(bytearray(4 * MiB)), MiB, fail)
            assert caught.value is stop
        with pytest.raises(ValueError, match="closed"):
            reader.read_stepwise(0, memoryview(bytearray(10)), 4, lambda p: None)


def test_a_part_held_by_a_reader_is_not_evicted_and_reads_whole_after_quarantine(tmp_path: Path) -> None:
    with open_store(tmp_path, max_bytes=1000) as store:
        store.put(key(0), 0, b"A" * 400)
        store.put(key(1), 0, b"B" * 400)
        reader = store.open_reader(key(0), 0)
        store.get(key(1), 0)  # key(0) is now the least recently used, but it is held
        store.put(key(2), 0, b"C" * 400)
        assert store.has_part(key(0), 0) and not store.has_part(key(1), 0)
        store.quarantine(key(0), "damaged")
        buf = memoryview(bytearray(400))
        assert reader is not None and reader.preadv(0, [buf]) == 400 and buf == b"A" * 400
        reader.close()
        store.put(key(3), 0, b"D" * 400)
        store.put(key(4), 0, b"E" * 400)  # nothing is held now: the cap applies to every entry
        assert [store.has_part(key(n), 0) for n in (2, 3, 4)] == [False, True, True]


@pytest.mark.parametrize("read", [
    lambda reader: reader.preadv(0, [memoryview(bytearray(10))]),
    lambda reader: reader.read_stepwise(0, memoryview(bytearray(5000)), 1000, lambda p: None),
], ids=["preadv", "read_stepwise"])
def test_a_reader_turns_a_failing_medium_into_store_unavailable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read: Callable[[Any], int]) -> None:
    with open_store(tmp_path) as store:
        store.put(key(0), 0, b"x" * 5000)
        with store.open_reader(key(0), 0) as reader:  # type: ignore[union-attr]
            def failing(*args: object) -> int:
                raise OSError(errno.EIO, "Input/output error")

            monkeypatch.setattr(os, "preadv", failing)
            with pytest.raises(StoreUnavailable, match="I/O error"):
                read(reader)


def test_a_batch_records_recency_in_the_order_given(tmp_path: Path) -> None:
    with open_store(tmp_path, max_bytes=10_000) as store:
        for n in range(6):
            store.put(key(n), 0, bytes(1000))
        store.get_many([(key(n), 0) for n in (5, 4, 3, 2, 1, 0)])
        store.evict(3000)
        assert [store.has_part(key(n), 0) for n in range(6)] == [True, True, True, False, False, False]


def test_parts_of_several_chunks_move_in_parallel_ranges_and_read_back_exactly(tmp_path: Path) -> None:
    payload = os.urandom(40 * MiB + 12345)
    pieces = [memoryview(payload)[a:b] for a, b in [(0, 7), (7, 16 * MiB + 3), (16 * MiB + 3, len(payload))]]
    with open_store(tmp_path, io_threads=4) as store:
        assert store.put(key(1), 0, pieces)
        assert store.get(key(1), 0) == payload
        aligned = memoryview(mmap.mmap(-1, 41 * MiB))
        assert store.read_into(key(1), 0, aligned) == len(payload)
        assert aligned[: len(payload)] == payload
        unaligned = memoryview(bytearray(len(payload) + 1))[1:]
        assert store.read_many([(key(1), 0, unaligned)]) == [len(payload)]
        assert unaligned == payload


def test_put_many_stores_what_it_can_and_then_raises_the_first_failure(tmp_path: Path) -> None:
    with open_store(tmp_path, max_bytes=1000) as store:
        items = [(key(0), 0, bytes(300)), (key(1), 0, bytes(5000)), (key(2), 0, bytes(300))]
        with pytest.raises(StoreUnavailable, match="full: 5000 bytes do not fit under max_bytes=1000 .*; raise GALAHAD_MAX_BYTES"):
            store.put_many(items)  # the message names the fix
        assert store.get_many([(key(0), 0), (key(1), 0), (key(2), 0)]) == [bytes(300), None, bytes(300)]
        assert store.put_many([(key(3), 0, b"a"), (key(3), 0, b"a")]) in ([True, False], [False, True])
        assert store.stats()["puts_skipped"] == 1


def test_a_store_folder_removed_under_a_running_store_takes_the_next_save_whole(tmp_path: Path) -> None:
    """An operator clearing the store's folder (`rm -rf`) while the server runs: the leaf folders
    this process had made are gone, and the first save into each used to be skipped."""
    root = tmp_path / "store"
    with open_store(root) as store:
        assert store.put(key(0), 0, b"first")
        shutil.rmtree(root / f"ns-{NAMESPACE.hex}")
        assert store.put(key(0), 1, b"second")  # the same leaf, made again
        assert store.put(key(1), 0, b"third")
        assert store.get(key(0), 1) == b"second" and store.get(key(1), 0) == b"third"
        assert store.stats()["puts_skipped"] == 0


def test_the_cap_covers_every_namespace_and_stale_ones_go_first(tmp_path: Path) -> None:
    with FilesystemBlockStore(tmp_path, OTHER, max_bytes=1000, rescan_s=None) as old:
        old.put(key(0), 0, bytes(400))
        old.put(key(1), 0, bytes(400))
    with open_store(tmp_path, max_bytes=1000) as store:
        assert store.used_bytes() == 800
        store.put(key(2), 0, bytes(400))
        assert store.used_bytes() == 800 and store.stats()["evictions"] == 1
        assert not (leaf(tmp_path, key(0), OTHER.hex) / f"{key(0).hex}.p0.blk").exists()
        assert (leaf(tmp_path, key(1), OTHER.hex) / f"{key(1).hex}.p0.blk").exists()


def test_a_scan_removes_stale_temp_files_and_uncommitted_parts_only(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        for n in range(4):
            store.put(key(n), 0, b"part")
        store.commit(key(0), (0,))
        store.commit(key(1), (0,))
    folder = leaf(tmp_path, key(2))
    folder.mkdir(parents=True, exist_ok=True)
    stale_tmp, fresh_tmp, stranger = folder / ".tmp-old", folder / ".tmp-new", folder / "notes.txt"
    for path in (stale_tmp, fresh_tmp, stranger):
        path.write_bytes(b"x")
    for path in (stale_tmp, stranger, leaf(tmp_path, key(1)) / f"{key(1).hex}.p0.blk", leaf(tmp_path, key(1)) / f"{key(1).hex}.ok"):
        age(path, 3600)
    age(leaf(tmp_path, key(2)) / f"{key(2).hex}.p0.blk", 3600)  # uncommitted and old: goes
    with open_store(tmp_path, stale_grace_s=600) as store:
        assert store.is_committed(key(0)) and store.is_committed(key(1))
        assert not store.has_part(key(2), 0)
        assert store.has_part(key(3), 0)  # uncommitted but young: another process may be saving it
        assert not stale_tmp.exists() and fresh_tmp.exists() and stranger.exists()


def test_quarantine_moves_parts_aside_keeps_a_bounded_number_and_counts_by_reason(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        for n in range(QUARANTINE_KEEP + 3):
            store.put(key(n), 0, b"a")
            store.put(key(n), 1, b"b")
            store.commit(key(n), (0, 1))
            store.quarantine(key(n), "damaged" if n % 2 else "io")
            assert not store.is_committed(key(n)) and store.get(key(n), 1) is None
        kept = sorted(p.name for p in (tmp_path / f"ns-{NAMESPACE.hex}" / QUARANTINE_DIR).iterdir())
        assert len(kept) == QUARANTINE_KEEP
        assert f"{key(QUARANTINE_KEEP + 2).hex}.p1.blk.io" in kept
        stats = store.stats()
        assert (stats["quarantined"], stats["quarantined_io"], stats["quarantined_damaged"]) == (11, 6, 5)
        with pytest.raises(ValueError):
            store.quarantine(key(0), "../../etc")


def test_a_part_being_read_is_not_evicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_store(tmp_path, max_bytes=1000) as store:
        store.put(key(0), 0, b"A" * 400)
        store.put(key(1), 0, b"B" * 400)
        entered, release = threading.Event(), threading.Event()
        real = store._medium.read_into

        def slow(*args: object, **kwargs: object) -> int | None:
            entered.set()
            release.wait(10)
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(store._medium, "read_into", slow)
        got: list[int | None] = []
        buf = memoryview(bytearray(400))
        reader = threading.Thread(target=lambda: got.append(store.read_into(key(0), 0, buf)))
        reader.start()
        assert entered.wait(10)
        store.put(key(2), 0, b"C" * 400)  # key(0) is least recently used, but being read
        assert store.has_part(key(0), 0) and not store.has_part(key(1), 0)
        release.set()
        reader.join(10)
        assert got == [400] and buf == b"A" * 400


def test_other_processes_writes_enter_the_size_accounting_at_the_next_scan(tmp_path: Path) -> None:
    with open_store(tmp_path, rescan_s=0.05) as watcher, open_store(tmp_path) as writer:
        writer.put(key(0), 0, bytes(1234))
        deadline = time.monotonic() + 10
        while watcher.used_bytes() != 1234 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.used_bytes() == 1234
        writer.evict(0)
        while watcher.used_bytes() != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.used_bytes() == 0


def test_a_new_root_records_80_percent_of_the_free_space_and_keeps_it(tmp_path: Path) -> None:
    vfs = os.statvfs(tmp_path)
    with FilesystemBlockStore(tmp_path / "store", NAMESPACE, rescan_s=None) as store:
        recorded = store.max_bytes
    assert abs(recorded - 0.8 * vfs.f_bavail * vfs.f_frsize) < 0.01 * recorded
    manifest = json.loads((tmp_path / "store" / MANIFEST_NAME).read_text())
    assert manifest["format"] == "galahad-store" and manifest["version"] == 1 and manifest["max_bytes"] == recorded
    (tmp_path / "filler").write_bytes(bytes(8 * MiB))
    with FilesystemBlockStore(tmp_path / "store", NAMESPACE, rescan_s=None) as store:
        assert store.max_bytes == recorded
    with FilesystemBlockStore(tmp_path / "store", NAMESPACE, max_bytes=12345, rescan_s=None) as store:
        assert store.max_bytes == 12345
    assert StoreRoot.open(tmp_path / "store").max_bytes == 12345


@pytest.mark.parametrize(
    ("text", "problem"),
    [("not json", "not JSON"), ('{"format":"galahad-store","version":2,"max_bytes":1,"created":"x"}', "newer Galahad")],
)
def test_a_bad_manifest_is_refused_naming_the_file(tmp_path: Path, text: str, problem: str) -> None:
    tmp_path.chmod(0o700)
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(StoreUnavailable, match=problem) as caught:
        FilesystemBlockStore(tmp_path, NAMESPACE)
    assert str(tmp_path / MANIFEST_NAME) in str(caught.value)


def test_tools_see_namespaces_and_open_one_by_digest(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.put(key(0), 0, b"x")
        store.commit(key(0), (0,))
    root = StoreRoot.open(tmp_path)
    assert list(root.namespaces()) == [NAMESPACE.hex]
    info = root.namespace_info(NAMESPACE.hex)
    assert info == NAMESPACE.as_dict()
    canonical = json.dumps(info, sort_keys=True, separators=(",", ":")).encode()
    assert hashlib.sha256(b"galahad-namespace-v1\x00" + canonical).hexdigest() == NAMESPACE.hex
    with FilesystemBlockStore.for_digest(tmp_path, NAMESPACE.hex, rescan_s=None) as tool:
        assert list(tool.committed()) == [key(0)] and tool.get(key(0), 0) == b"x"
    with pytest.raises(StoreUnavailable):
        FilesystemBlockStore.for_digest(tmp_path, OTHER.hex)
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with pytest.raises(StoreUnavailable, match="not a Galahad store"):
        StoreRoot.open(empty)


def test_a_closed_store_raises_store_unavailable(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.close()
    store.close()
    for call in (lambda: store.get(key(0), 0), lambda: store.put(key(0), 0, b"x"), lambda: store.is_committed(key(0))):
        with pytest.raises(StoreUnavailable, match="closed"):
            call()


def test_the_markers_a_store_remembers_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Markers already read are remembered (lookups re-ask about them every turn) up to a bound;
    past it the store forgets them all and reads them again: still the same answers."""
    import galahad.adapters.fs.commit as fs_store

    monkeypatch.setattr(fs_store, "_MARKERS_KEPT", 4)
    with open_store(tmp_path) as store:
        for n in range(10):
            assert store.put(key(n), 0, b"x" * 100) and store.commit(key(n), (0,))
        for _ in range(2):
            assert all(store.is_committed(key(n)) for n in range(10))
            assert 1 <= len(store._markers) <= 4
        store.quarantine(key(9), "damaged")
        assert not store.is_committed(key(9)) and store.is_committed(key(8))
