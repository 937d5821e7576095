"""One store on a real distributed filesystem (GlusterFS), written and read by several nodes.

Each mount of one GlusterFS volume stands for one node (gluster_support.py). The store's rules
checked where it lives on such a filesystem: an entry committed on one node is found by another
without a restart; a read on one node survives eviction on another; one size cap for all nodes;
the record of retired keys kept whole when nodes write it at once; writers on two mounts never
tear, mix or lose an entry; a writer killed mid-save leaves nothing another node serves; and the
faults of a network filesystem (the server killed, stalled, the mount detached, its management
daemon stopped): calls fail fast or within a bounded wait, one line says so, and caching resumes
by itself when the filesystem is back.

Skipped where GlusterFS cannot run (not root, not installed); `.ci/run` installs it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from galahad.adapters.crypto.retired import RECORD_NAME, note_retired_keys
from galahad.adapters.fs import FilesystemBlockStore
from galahad.adapters.fs.layout import namespace_name
from galahad.adapters.posix.regular_file import read_regular
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from gluster_support import GlusterVolume, volume  # noqa: F401 - the fixture
from helpers.store_worker import NAMESPACE, blob, check
from test_fs_crash import campaign

pytestmark = pytest.mark.gluster

WORKER = Path(__file__).parent / "helpers" / "store_worker.py"
STRESS_S = float(os.environ.get("GALAHAD_STORE_STRESS_S", "30")) / 3


@pytest.fixture
def nodes(volume: GlusterVolume, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """One store folder as node A and node B see it, fresh for each test."""
    name = f"store-{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]}"
    a, b = (mount / name for mount in volume.mounts[:2])
    return a, b


def _key(n: int) -> ChainKey:
    return ChainKey(hashlib.sha256(b"shared %d" % n).digest())


def _until(what: Callable[[], bool], timeout: float, every: float = 0.02) -> float:
    """Seconds until `what()` held (polled `every` seconds); AssertionError after `timeout`."""
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < timeout, "not within the bound"
        time.sleep(every)
    return time.monotonic() - start


def _put_entry(store: FilesystemBlockStore, key: ChainKey, size: int = 64 << 10) -> bytes:
    data = blob(key, 0, 1, size)
    store.put(key, 0, data)
    assert store.commit(key, (0,))
    return data


def test_the_startup_line_names_the_filesystem_and_says_it_is_shared(
        nodes: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with FilesystemBlockStore(nodes[0], NAMESPACE, max_bytes=1 << 30) as store:
        assert store.root.remote_fstype == "fuse.glusterfs" and store.root.shared
    said = [r.getMessage() for r in caplog.records if "shared network filesystem" in r.getMessage()]
    assert said == [f"[galahad] store {nodes[0]} is on fuse.glusterfs, a shared network filesystem: servers that "
                    "mount it with the same GALAHAD_CACHE_DIR share its entries; loads are slower than from a local "
                    "disk (docs/store.md, A store shared by several servers)"]


def test_an_entry_committed_on_one_node_is_found_by_another_without_a_restart(nodes: tuple[Path, Path]) -> None:
    a_root, b_root = nodes
    with FilesystemBlockStore(a_root, NAMESPACE, max_bytes=1 << 30) as a, \
            FilesystemBlockStore(b_root, NAMESPACE, max_bytes=1 << 30) as b:
        seen = []
        for n in range(5):
            key = _key(n)
            assert not b.is_committed(key)  # B looked, and missed, before A wrote it
            data = _put_entry(a, key)
            seen.append(_until(lambda k=key: b.is_committed(k), 5.0))  # type: ignore[misc]
            assert b.get(key, 0) == data
        assert max(seen) < 2.0, seen


@pytest.mark.parametrize("removal", ["evict", "quarantine"])
def test_a_read_on_one_node_survives_eviction_or_quarantine_on_another_and_a_later_lookup_is_a_miss(
        nodes: tuple[Path, Path], removal: str) -> None:
    a_root, b_root = nodes
    with FilesystemBlockStore(a_root, NAMESPACE, max_bytes=1 << 30) as a, \
            FilesystemBlockStore(b_root, NAMESPACE, max_bytes=1 << 30) as b:
        key = _key(100)
        data = _put_entry(a, key, 8 << 20)
        _until(lambda: b.is_committed(key), 5.0)
        with b.open_reader(key, 0) as reader:  # type: ignore[union-attr]
            first = bytearray(1 << 20)
            reader.preadv(0, [first])
            if removal == "evict":  # A removes the entry B is reading
                assert a.wait_indexed(30) and a.evict(0) == 1
            else:
                assert a.quarantine(key, "damaged")
            rest = bytearray(reader.size - len(first))
            reader.preadv(len(first), [rest])
        assert bytes(first + rest) == data  # whole, though evicted meanwhile
        _until(lambda: not b.is_committed(key), 5.0)
        # B's client keeps the part's old name about a second after B last opened it (GlusterFS's
        # metadata cache, 1 s, renewed by each open: polled faster, B would see the name for as
        # long as it polls). Until it lets go, what B reads there is the whole part, never an error.
        _until(lambda: _absent_or_whole(b, key, data), 10.0, every=1.5)
        assert b.get(key, 0) is None and b.quarantine(key, "missing") is False  # nothing left to set aside
        assert not a.is_committed(key) and a.get(key, 0) is None


def _absent_or_whole(store: FilesystemBlockStore, key: ChainKey, data: bytes) -> bool:
    """Whether the part reads as absent; while the node still sees the name, what it reads is the
    whole part or nothing, never an error."""
    reader = store.open_reader(key, 0)
    if reader is None:
        return True
    with reader:
        got = bytearray(reader.size)
        reader.preadv(0, [got])
    assert got == data
    return False


def test_one_size_cap_for_every_node_and_a_cap_changed_on_one_reaches_the_others(nodes: tuple[Path, Path]) -> None:
    a_root, b_root = nodes
    cap = 4 << 20
    FilesystemBlockStore(a_root, NAMESPACE, max_bytes=cap).close()  # recorded in the manifest
    with FilesystemBlockStore(a_root, NAMESPACE, rescan_s=0.5) as a, \
            FilesystemBlockStore(b_root, NAMESPACE, rescan_s=0.5) as b:
        assert a.max_bytes == b.max_bytes == cap
        for n in range(12):  # 6 MiB from each node, 12 MiB in all, under a 4 MiB cap
            _put_entry(a if n % 2 else b, _key(200 + n), 1 << 20)
        _until(lambda: _bytes_on_disk(a_root) <= cap, 10.0)
        assert a.stats()["evictions"] + b.stats()["evictions"] >= 8
        FilesystemBlockStore(a_root, NAMESPACE, max_bytes=2 << 20).close()  # an operator sets a new cap
        _until(lambda: b.max_bytes == 2 << 20, 10.0)
        _until(lambda: _bytes_on_disk(a_root) <= 2 << 20, 10.0)


def test_recency_written_on_one_node_orders_eviction_on_another(nodes: tuple[Path, Path]) -> None:
    """Recency is the files' modification times (nanoseconds), set by the node that wrote or
    read them: another node's scan orders the entries as their users did."""
    a_root, b_root = nodes
    keys = [_key(900 + n) for n in range(3)]
    with FilesystemBlockStore(a_root, NAMESPACE, max_bytes=1 << 30, rescan_s=None) as a:
        for key in keys:
            _put_entry(a, key)
            time.sleep(0.01)
        assert a.get(keys[0], 0) is not None  # the oldest write, used last
    with FilesystemBlockStore(b_root, NAMESPACE, max_bytes=1 << 30, rescan_s=None) as b:
        assert [key for key, _parts in b.recent(wait_s=30)] == [keys[0], keys[2], keys[1]]
        assert b.evict(b.used_bytes() - 1) == 1 and not b.is_committed(keys[1])  # the least recently used


def _bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / namespace_name(NAMESPACE.hex)).glob("??/??/*.blk"))


def _note(folder: str, n: int, barrier: object) -> None:
    # what this server logged (an update made without the lock says so) and how long its turn
    # took reach the test's captured stderr, shown when the test fails
    logging.getLogger("galahad").addHandler(logging.StreamHandler(sys.stderr))
    barrier.wait()  # type: ignore[attr-defined]
    start = time.monotonic()
    note_retired_keys(folder, bytes([0xBB, n]) + bytes(6), [bytes([0xAA, n]) + bytes(6)])
    print(f"server {n} on node {n % 2} noted its key in {time.monotonic() - start:.2f} s", file=sys.stderr)


def test_servers_on_two_nodes_noting_retired_keys_at_once_keep_every_id(nodes: tuple[Path, Path]) -> None:
    """The record is rewritten under a lock every node sees: a lock on a folder is local to one
    GlusterFS client, and under it two nodes would rewrite the record at once, losing ids."""
    servers = 12
    nodes[0].mkdir(mode=0o700)
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        name = f"round{round_}"
        (nodes[0] / name).mkdir(mode=0o700)
        barrier = ctx.Barrier(servers)
        starts = [ctx.Process(target=_note, args=(str(nodes[n % 2] / name), n, barrier)) for n in range(servers)]
        for p in starts:
            p.start()
        for p in starts:
            p.join(60)
            assert p.exitcode == 0
        assert _record_ids(nodes[1] / name) == {(bytes([0xAA, n]) + bytes(6)).hex() for n in range(servers)}


def _record_ids(folder: Path) -> set[str]:
    """The retired ids the record in `folder` lists, read as a server reads it: the folder listed
    first, so this node's client does not answer with a copy it cached before another node's update."""
    os.listdir(folder)
    lines = read_regular(folder / RECORD_NAME, 1 << 16).decode().split("\n")
    return {line.split()[0] for line in lines if line and not line.startswith("#")}


def test_a_node_that_just_read_the_record_reads_the_version_another_node_wrote_since(nodes: tuple[Path, Path]) -> None:
    """A GlusterFS client answers a name it looked up within the last second from its cache: the
    file that name held then, though another node has since renamed a new record over it (and
    every further read within a second renews that). Read under the lock, such a copy would make
    the update drop what the other node added: the update lists the folder first, which tells the
    client what each name holds now."""
    a, b = nodes
    a.mkdir(mode=0o700)
    ids = [bytes([0xAA, n]) + bytes(6) for n in range(3)]
    for round_ in range(10):
        folder_a, folder_b = a / f"round{round_}", b / f"round{round_}"
        folder_a.mkdir(mode=0o700)
        note_retired_keys(str(folder_a), b"\xbb" * 8, [ids[0]])
        note_retired_keys(str(folder_b), None, [])  # node B reads the record (a server without a key)
        note_retired_keys(str(folder_a), b"\xbb" * 8, [ids[1]])  # node A replaces it
        note_retired_keys(str(folder_b), b"\xbb" * 8, [ids[2]])  # node B, within the second
        assert _record_ids(folder_a) == {i.hex() for i in ids}


def _start(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _report(proc: subprocess.Popen[str], timeout: float) -> dict[str, object]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {out}\n{err}"
    return dict(json.loads(out.splitlines()[-1]))


def test_writers_on_two_nodes_sharing_keys_never_tear_mix_or_lose_a_committed_entry(nodes: tuple[Path, Path]) -> None:
    FilesystemBlockStore(nodes[0], NAMESPACE, max_bytes=1 << 40, rescan_s=None).close()
    workers = [_start("stress", nodes[n % 2], n, STRESS_S) for n in range(4)]
    reports = [_report(w, STRESS_S + 180) for w in workers]
    assert all(r["bad"] == [] for r in reports), "a read returned a torn, mixed or misplaced part"
    assert all(r["lost"] == [] for r in reports), "a committed entry read as absent"
    promised = {h for r in reports for h in r["committed"]}  # type: ignore[attr-defined]
    assert promised and sum(r["reads"] for r in reports) > 100  # type: ignore[misc]
    with FilesystemBlockStore(nodes[1], NAMESPACE, rescan_s=None) as store:
        assert promised <= {k.hex for k in store.committed()}


def test_readers_on_one_node_racing_eviction_on_another_get_whole_parts_or_none(nodes: tuple[Path, Path]) -> None:
    FilesystemBlockStore(nodes[0], NAMESPACE, max_bytes=1 << 40, rescan_s=None).close()
    churn = _start("churn", nodes[0], 4.0, 6 << 20)
    readers = [_start("read", nodes[1], n, 4.0) for n in range(2)]
    assert _report(churn, 180)["evictions"] > 0, "the churning node never evicted: the race was not run"
    reports = [_report(r, 180) for r in readers]
    assert all(r["bad"] == [] for r in reports), "a reader got part of a part"
    assert sum(r["hits"] for r in reports) > 0  # type: ignore[misc]


def test_a_writer_killed_mid_save_on_one_node_leaves_nothing_another_node_serves(nodes: tuple[Path, Path]) -> None:
    """The crash campaign of test_fs_crash.py, the writer on node A, every check through node B."""
    kills = int(os.environ.get("GALAHAD_SHARED_KILLS", "20"))
    done = campaign(nodes[0], kills, seen_from=nodes[1])
    assert done.committed_seen > 0


# -- the faults of a network filesystem --------------------------------------------------------


def _out_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is not answering" in r.getMessage()]


def _back_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "caching resumed" in r.getMessage()]


def test_a_killed_server_makes_calls_fail_at_once_and_caching_resumes_when_it_is_back(
        volume: GlusterVolume, nodes: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with FilesystemBlockStore(nodes[1], NAMESPACE, max_bytes=1 << 30) as store:
        before = _put_entry(store, _key(300))
        volume.kill_brick()
        try:
            start = time.monotonic()
            for n in range(50):
                with pytest.raises(StoreUnavailable):
                    store.is_committed(_key(301 + n))
                with pytest.raises(StoreUnavailable):
                    store.put(_key(400 + n), 0, b"x" * 1000)
            assert time.monotonic() - start < 2.0  # 100 calls: none waits
            assert len(_out_lines(caplog)) == 1, caplog.text
            assert "Transport endpoint is not connected" in _out_lines(caplog)[0]
        finally:
            volume.start_brick()
        _until(lambda: bool(_back_lines(caplog)), 30.0)
        assert store.get(_key(300), 0) == before
        _put_entry(store, _key(500))
        assert store.is_committed(_key(500))


def test_a_stalled_server_bounds_each_wait_then_fails_at_once_until_it_answers(
        volume: GlusterVolume, nodes: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with FilesystemBlockStore(nodes[1], NAMESPACE, max_bytes=1 << 30) as store:
        _put_entry(store, _key(600))
        volume.pause_brick()
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match="no answer within 2 s"):
                store.is_committed(_key(601))  # a name no cache holds: it reaches the stalled server
            assert time.monotonic() - start < 3.0
            start = time.monotonic()
            for n in range(20):
                with pytest.raises(StoreUnavailable):
                    store.is_committed(_key(602 + n))
            assert time.monotonic() - start < 0.5
            assert len(_out_lines(caplog)) == 1
        finally:
            volume.resume_brick()
        _until(lambda: bool(_back_lines(caplog)), 30.0)
        assert store.is_committed(_key(600))


def test_a_detached_mount_writes_nothing_beneath_it_and_caching_resumes_once_it_is_mounted_again(
        volume: GlusterVolume, nodes: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    point = volume.mounts[1]
    with FilesystemBlockStore(nodes[1], NAMESPACE, max_bytes=1 << 30) as store:
        data = _put_entry(store, _key(700))
        volume.unmount(point)
        try:
            beneath = sorted(os.listdir(point))
            for n in range(5):
                with pytest.raises(StoreUnavailable):
                    store.put(_key(701 + n), 0, b"y" * 1000)
            assert sorted(os.listdir(point)) == beneath  # nothing written to the disk beneath the mount
            assert "the mount went away" in " ".join(_out_lines(caplog))
        finally:
            volume.remount(point)
        _until(lambda: bool(_back_lines(caplog)), 30.0)
        assert store.get(_key(700), 0) == data
        _put_entry(store, _key(710))
        with FilesystemBlockStore(nodes[0], NAMESPACE, max_bytes=1 << 30) as other:
            assert other.is_committed(_key(710))  # written to the shared volume, not beneath it


def test_a_stopped_management_daemon_changes_nothing_for_mounted_nodes(
        volume: GlusterVolume, nodes: tuple[Path, Path]) -> None:
    with FilesystemBlockStore(nodes[0], NAMESPACE, max_bytes=1 << 30) as a, \
            FilesystemBlockStore(nodes[1], NAMESPACE, max_bytes=1 << 30) as b:
        volume.stop_glusterd()
        try:
            data = _put_entry(a, _key(800))
            _until(lambda: b.is_committed(_key(800)), 5.0)
            assert b.get(_key(800), 0) == data and check(_key(800), 0, data)
        finally:
            volume.start_glusterd()
