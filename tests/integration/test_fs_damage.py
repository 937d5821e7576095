"""Damage and failing media at the store level: missing, truncated and foreign files are misses,
never exceptions; a full disk, an I/O error or a read-only filesystem is `StoreUnavailable`,
leaving nothing behind and losing nothing already stored."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore
from galahad.adapters.fs.layout import TEMP_PREFIX
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from helpers.store_worker import NAMESPACE

KiB, MiB = 1 << 10, 1 << 20


def key(n: int) -> ChainKey:
    return ChainKey(hashlib.sha256(b"damage test %d" % n).digest())


def part_path(root: Path, k: ChainKey, part: int) -> Path:
    return root / f"ns-{NAMESPACE.hex}" / k.hex[0:2] / k.hex[2:4] / f"{k.hex}.p{part}.blk"


def open_store(root: Path, **options: object) -> FilesystemBlockStore:
    options.setdefault("max_bytes", 1 << 30)
    return FilesystemBlockStore(root, NAMESPACE, rescan_s=None, **options)  # type: ignore[arg-type]


def save(store: FilesystemBlockStore, n: int, size: int = 1000, parts: int = 2) -> list[bytes]:
    blobs = [hashlib.sha256(b"%d %d" % (n, p)).digest() * (size // 32) for p in range(parts)]
    for part, blob in enumerate(blobs):
        assert store.put(key(n), part, blob)
    assert store.commit(key(n), tuple(range(parts)))
    return blobs


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of our own (mounting needs root); skipped where mounting is not allowed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_deleted_part_uncommits_its_entry_and_reads_as_absent(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        blobs = save(store, 0)
        part_path(tmp_path, key(0), 1).unlink()
        assert not store.is_committed(key(0)) and list(store.committed()) == []
        assert store.get(key(0), 1) is None and store.read_into(key(0), 1, memoryview(bytearray(9))) is None
        assert store.get(key(0), 0) == blobs[0]
        assert store.put(key(0), 1, blobs[1]) and store.commit(key(0), (0, 1)) and store.is_committed(key(0))


def test_a_truncated_part_uncommits_its_entry(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        save(store, 0)
        os.truncate(part_path(tmp_path, key(0), 0), 10)
        assert not store.is_committed(key(0))
        assert store.get(key(0), 0) == part_path(tmp_path, key(0), 0).read_bytes()  # bytes as they are


@pytest.mark.parametrize(
    "garbage",
    [b"", b"{", b"[]", b'{"format":"galahad-commit","version":1,"parts":{"0":-1}}', os.urandom(70000)],
    ids=["empty", "torn", "not-an-object", "negative-size", "random-70k"],
)
def test_a_damaged_marker_is_a_miss_never_an_exception(tmp_path: Path, garbage: bytes) -> None:
    with open_store(tmp_path) as store:
        save(store, 0)
        marker = part_path(tmp_path, key(0), 0).with_name(f"{key(0).hex}.ok")
        marker.write_bytes(garbage)
        assert not store.is_committed(key(0)) and list(store.committed()) == []
        assert store.commit(key(0), (0, 1)) and store.is_committed(key(0))  # a commit mends it


def test_a_marker_read_before_is_known_again_by_its_file_and_read_again_once_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lookups ask about the same entries again and again (every 64 tokens of every turn): a
    marker already read is known by its file's identity, without opening it. Rewritten in
    place, or replaced by a new marker listing other sizes, it is read again."""
    import galahad.adapters.fs.store as fs_store

    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(fs_store.os, "open", lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1])
    with open_store(tmp_path) as store:
        save(store, 0)
        marker = part_path(tmp_path, key(0), 0).with_name(f"{key(0).hex}.ok")
        assert store.is_committed(key(0)) and store.is_committed(key(0)) and store.is_committed(key(0))
        assert opened.count(marker.name) == 1  # read once (by name, in its folder), then known by its identity
        marker.write_bytes(marker.read_bytes().replace(b'"version":1', b'"version":9'))  # in place
        assert not store.is_committed(key(0))
        assert store.commit(key(0), (0, 1)) and store.is_committed(key(0))  # a commit mends it
        # quarantined and saved again with parts of other sizes (as after a key change): the
        # new marker lists the new sizes, and it is the one believed
        store.quarantine(key(0), "damaged")
        for part in (0, 1):
            assert store.put(key(0), part, b"n" * (3000 + part))
        assert store.commit(key(0), (0, 1)) and store.is_committed(key(0))
        assert store.part_size(key(0), 1) == 3001


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_something_else_at_a_markers_name_is_no_marker_and_never_opened(tmp_path: Path, planted: str) -> None:
    """A link is not followed; a FIFO is not opened (opening one would wait for a writer)."""
    with open_store(tmp_path) as store:
        save(store, 0)
        marker = part_path(tmp_path, key(0), 0).with_name(f"{key(0).hex}.ok")
        copy = tmp_path / "elsewhere.ok"
        copy.write_bytes(marker.read_bytes())
        marker.unlink()
        if planted == "symlink":
            marker.symlink_to(copy)
        else:
            os.mkfifo(marker, 0o600)
        answers: list[bool] = []
        asking = threading.Thread(target=lambda: answers.append(
            store.is_committed(key(0)) or list(store.committed()) != []), daemon=True)
        asking.start()
        asking.join(10)
        assert answers == [False]  # answered, and not committed (a FIFO opened would still wait)


@pytest.mark.parametrize("planted", ["symlink", "folder", "fifo"])
def test_something_else_at_a_parts_name_is_absent_and_never_followed(tmp_path: Path, planted: str) -> None:
    with open_store(tmp_path) as store:
        save(store, 0)
        secret = tmp_path / "secret"
        secret.write_bytes(b"not yours")
        target = part_path(tmp_path, key(1), 0)
        target.parent.mkdir(parents=True, exist_ok=True)
        {"symlink": lambda: target.symlink_to(secret), "folder": target.mkdir, "fifo": lambda: os.mkfifo(target)}[planted]()
        assert store.get(key(1), 0) is None and store.read_into(key(1), 0, memoryview(bytearray(64))) is None
        assert store.part_size(key(1), 0) is None and not store.has_part(key(1), 0)


def test_a_full_disk_raises_store_unavailable_and_keeps_what_was_stored(tmpfs: Path) -> None:
    with open_store(tmpfs / "store") as store:
        kept = {n: save(store, n, size=100 * KiB, parts=1) for n in range(3)}
        used = store.used_bytes()
        with pytest.raises(StoreUnavailable) as caught:
            store.put(key(9), 0, os.urandom(2 * MiB))
        assert caught.value.errno == errno.ENOSPC
        assert "disk is full" in str(caught.value) and key(9).hex in str(caught.value)
        assert temp_files(tmpfs) == [] and not store.has_part(key(9), 0)
        assert store.used_bytes() == used and store.stats()["puts_skipped"] == 1
        for n, blobs in kept.items():
            assert store.is_committed(key(n)) and store.get(key(n), 0) == blobs[0]
        assert store.put(key(10), 0, b"small")  # the failed write's space came back


def test_a_write_failing_halfway_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    calls = []

    def fail_second(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, [memoryview(buffers[0])[:1000]], offset)  # a short write first

    with open_store(tmp_path) as store:
        blobs = save(store, 0)
        monkeypatch.setattr(os, "pwritev", fail_second)
        with pytest.raises(StoreUnavailable) as caught:
            store.put(key(1), 0, bytes(5000))
        monkeypatch.undo()
        assert type(caught.value) is StoreUnavailable and caught.value.errno == errno.ENOSPC
        assert temp_files(tmp_path) == [] and not store.has_part(key(1), 0)
        assert store.get(key(0), 0) == blobs[0] and store.is_committed(key(0))


def test_short_reads_and_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_w, real_r, real_pr = os.pwritev, os.preadv, os.pread
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: real_w(fd, [memoryview(bufs[0])[:7]], off))
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real_r(fd, [memoryview(bufs[0])[:7]], off))
    monkeypatch.setattr(os, "pread", lambda fd, n, off: real_pr(fd, min(n, 7), off))
    blob = os.urandom(3000)
    with open_store(tmp_path) as store:
        assert store.put(key(0), 0, [blob[:1000], blob[1000:]])
        buf = memoryview(bytearray(3000))
        assert store.read_into(key(0), 0, buf) == 3000 and buf == blob
        assert store.get(key(0), 0) == blob


def test_an_io_error_on_read_is_store_unavailable_not_a_bare_oserror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    with open_store(tmp_path) as store:
        save(store, 0)
        monkeypatch.setattr(os, "preadv", broken)
        monkeypatch.setattr(os, "pread", broken)
        for call in (lambda: store.read_into(key(0), 0, memoryview(bytearray(1000))), lambda: store.get(key(0), 0)):
            with pytest.raises(StoreUnavailable) as caught:
                call()
            assert type(caught.value) is StoreUnavailable and caught.value.errno == errno.EIO
            assert "I/O error" in str(caught.value)


def _make_read_only(root: Path, mnt: Path | None) -> None:
    if mnt is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    else:  # not root: take the write bits away (root would ignore them)
        for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
            folder.chmod(0o500)


def test_a_read_only_store_still_serves_reads_and_refuses_writes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mnt = None
    if os.geteuid() == 0:
        mnt = tmp_path / "mnt"
        mnt.mkdir(mode=0o700)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)]).returncode:
            pytest.skip("root, but cannot mount a tmpfs to make read-only")
    root = (mnt or tmp_path) / "store"
    try:
        with open_store(root) as store:
            blobs = save(store, 0)
            store.put(key(1), 0, b"uncommitted")
        _make_read_only(root, mnt)
        caplog.set_level(logging.WARNING, logger="galahad")
        with open_store(root) as store:
            said = [r.getMessage() for r in caplog.records if "is read-only" in r.getMessage()]
            assert len(said) == 1 and "nothing new is saved; remount it read-write" in said[0]  # at open, once
            assert store.is_committed(key(0)) and list(store.committed()) == [key(0)]
            assert store.get(key(0), 0) == blobs[0]
            buf = memoryview(bytearray(len(blobs[1])))
            assert store.read_into(key(0), 1, buf) == len(blobs[1]) and buf == blobs[1]
            for call in (lambda: store.put(key(2), 0, b"x"), lambda: store.commit(key(1), (0,)), lambda: store.quarantine(key(0), "io")):
                with pytest.raises(StoreUnavailable) as caught:
                    call()
                assert caught.value.errno in (errno.EROFS, errno.EACCES)
    finally:
        if mnt is not None:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        else:
            for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
                folder.chmod(0o700)
