"""The store's answering-or-out state (outage.py) on a local folder: what runs everywhere, without
a network filesystem. A call that hangs is bounded, an unreachable filesystem's error puts the
store out, calls then fail at once, and the prober brings it back by itself. The same rules on a
real GlusterFS volume, faults included: test_fs_shared.py."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore
from galahad.adapters.fs.outage import OutageGuard
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from helpers.store_worker import NAMESPACE


def _until(what: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def test_a_call_that_hangs_is_bounded_then_calls_fail_at_once_until_the_folder_answers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    backs: list[int] = []
    guard = OutageGuard(str(tmp_path), bounded=True, on_back=lambda: backs.append(1), limit_s=0.3, probe_s=0.05)
    release = threading.Event()
    try:
        assert guard.call(lambda x: x + 1, 1) == 2
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"not answering \(no answer within 0.3 s\)") as caught:
            guard.call(release.wait)  # a filesystem call that does not come back
        assert caught.value.errno == errno.ETIMEDOUT and time.monotonic() - start < 1.0
        ran: list[int] = []
        with pytest.raises(StoreUnavailable):
            guard.call(ran.append, 1)  # out: refused without running
        assert ran == []
        _until(lambda: backs == [1])  # the folder itself answers the prober
        assert not guard.out
        assert guard.call(lambda: 3) == 3
    finally:
        release.set()
        guard.close()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "is not answering" in m]) == 1
    assert len([m for m in said if "caching resumed" in m]) == 1


@pytest.mark.parametrize("code", [errno.ENOTCONN, errno.ENODEV, errno.EHOSTDOWN])
def test_an_error_meaning_the_filesystem_is_unreachable_puts_the_store_out(tmp_path: Path, code: int) -> None:
    guard = OutageGuard(str(tmp_path), bounded=False, on_back=lambda: None, probe_s=0.05)
    try:
        def fail() -> None:
            raise StoreUnavailable(code, os.strerror(code))

        with pytest.raises(StoreUnavailable):
            guard.call(fail)
        assert guard.out
        _until(lambda: not guard.out)
    finally:
        guard.close()


@pytest.mark.parametrize("code", [errno.ENOENT, errno.EIO, errno.ENOSPC, errno.EACCES, errno.ESTALE])
def test_an_error_of_one_file_or_a_full_disk_leaves_the_store_answering(tmp_path: Path, code: int) -> None:
    guard = OutageGuard(str(tmp_path), bounded=False, on_back=lambda: None)
    try:
        def fail() -> None:
            raise StoreUnavailable(code, os.strerror(code))

        with pytest.raises(StoreUnavailable):
            guard.call(fail)
        assert not guard.out
    finally:
        guard.close()


def test_a_store_whose_folder_is_gone_saves_nothing_anywhere_and_resumes_when_it_is_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The store's own folder removed under it (what a detached mount looks like from a folder
    below the mount point): out, one line, nothing written; made again: back."""
    caplog.set_level(logging.WARNING)
    root = tmp_path / "store"
    with FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 30, rescan_s=None) as store:
        store.put(ChainKey(bytes(32)), 0, b"before")
        gone = tmp_path / "moved-away"
        root.rename(gone)
        with pytest.raises(StoreUnavailable, match="its folder is gone"):
            store.put(ChainKey(bytes([1]) * 32), 0, b"while gone")
        assert not root.exists()
        with pytest.raises(StoreUnavailable):
            store.is_committed(ChainKey(bytes(32)))
        gone.rename(root)
        _until(lambda: any("caching resumed" in r.getMessage() for r in caplog.records))
        assert store.get(ChainKey(bytes(32)), 0) == b"before"
        assert store.put(ChainKey(bytes([1]) * 32), 0, b"after")
    assert len([r for r in caplog.records if "is not answering" in r.getMessage()]) == 1


def test_a_long_prompts_marker_lookups_on_network_storage_are_bounded_a_few_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`first_committed` of thousands of keys (a long prompt's block ends, layer order) on network
    storage: each ask of the outage guard covers a few dozen of them, so a server that answers
    every lookup in time is never put out by the length of a prompt. Network storage is stood in
    for by a local folder with a bounded guard and a slowed lookup (no network here)."""
    from galahad.adapters.fs import store as fs_store

    store = FilesystemBlockStore(tmp_path / "store", NAMESPACE, rescan_s=None)
    guard = OutageGuard(str(tmp_path), bounded=True, on_back=lambda: None, limit_s=1.0, probe_s=0.05)
    monkeypatch.setattr(store, "_guard", guard)
    monkeypatch.setattr(store, "_local", False)
    is_committed = store._is_committed

    def slow(key: ChainKey) -> bool:  # a round trip to a slow server for each marker
        time.sleep(0.002)
        return is_committed(key)

    monkeypatch.setattr(store, "_is_committed", slow)
    keys = [ChainKey(os.urandom(32)) for _ in range(16 * fs_store._ASKS_AT_ONCE)]  # 2 s of lookups or more in all
    try:
        assert store.first_committed(keys) is None and not guard.out
        monkeypatch.setattr(fs_store, "_ASKS_AT_ONCE", len(keys))  # all in one ask: past the bound
        with pytest.raises(StoreUnavailable, match="not answering"):
            store.first_committed(keys)
    finally:
        guard.close()
        store.close()
