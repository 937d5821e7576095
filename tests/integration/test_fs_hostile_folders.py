"""Folders inside the store replaced by someone who can write into the store folder: a symbolic
link to a folder outside it (the quarantine, a fanout or leaf folder, the namespace folder), a
folder of another user or one others can write, a FIFO or a file where a folder should be.

What lies under such a folder is absent to the store (a miss); nothing outside the store is
read, written, moved, stamped or removed; the store says once which folder it refused and how to
fix it; and nothing hangs or raises but a save, which fails the way the port says a save fails
(`StoreUnavailable`, counted; the service skips it). Real folders, real links, real stores,
restarted on the same root.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from helpers.store_worker import NAMESPACE


def key(n: int) -> ChainKey:
    return ChainKey(hashlib.sha256(b"hostile folder test %d" % n).digest())


def open_store(root: Path) -> FilesystemBlockStore:
    """A restart: a new store on the root, its scan at open finished (grace 0: it removes every
    stale file it may)."""
    store = FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 30, rescan_s=None, stale_grace_s=0)
    assert store.wait_indexed(30)
    return store


def save(store: FilesystemBlockStore, k: ChainKey) -> list[bytes]:
    blobs = [hashlib.sha256(k.raw + bytes([p])).digest() * 40 for p in (0, 1)]
    for part, blob in enumerate(blobs):
        assert store.put(k, part, blob)
    assert store.commit(k, (0, 1))
    return blobs


def ns_dir(root: Path) -> Path:
    return root / f"ns-{NAMESPACE.hex}"


def leaf(root: Path, k: ChainKey) -> Path:
    return ns_dir(root) / k.hex[0:2] / k.hex[2:4]


def folder_at(root: Path, level: str, k: ChainKey) -> Path:
    return {"namespace": ns_dir(root), "fanout": leaf(root, k).parent, "leaf": leaf(root, k),
            "quarantine": ns_dir(root) / "quarantine"}[level]


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def snapshot(folder: Path) -> dict[str, tuple[str, bytes, int]]:
    """Every name under `folder` (links not followed): its kind and mode, its bytes, its mtime."""
    found = {}
    for base, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(base, name)
            st = path.lstat()
            data = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            found[str(path.relative_to(folder))] = (stat.filemode(st.st_mode), data, st.st_mtime_ns)
    return found


def stale_leftovers(leaf_folder: Path, k: ChainKey) -> None:
    """What a scan removes in a leaf of its own: a temp file and an uncommitted part, both old."""
    (leaf_folder / ".tmp-0123456789abcdef").write_bytes(b"an unfinished write")
    (leaf_folder / f"{k.hex[:4]}{'0' * 60}.p0.blk").write_bytes(b"a part never committed")
    for path in leaf_folder.iterdir():
        age(path, 7200)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "refused" in r.getMessage()]


def answered(fn: Callable[[], object], timeout: float = 30) -> object:
    """`fn()` on a thread: its result (or the exception it raised), failing the test if it hangs."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        pytest.fail(f"no answer in {timeout} s: waiting on something planted in the store")
    return outcome[0]


def assert_misses(store: FilesystemBlockStore, k: ChainKey) -> None:
    """Every read and lookup of `k` answers "absent"."""
    assert not store.is_committed(k) and list(store.committed()) == []
    assert store.get(k, 0) is None and store.part_size(k, 0) is None and not store.has_part(k, 0)
    assert store.read_into(k, 0, memoryview(bytearray(4096))) is None
    assert store.open_reader(k, 0) is None and store.resident_share(k, 0) is None
    assert store.get_many([(k, 0), (k, 1)]) == [None, None]


def test_a_quarantine_folder_linked_outside_is_never_pruned_or_written_into(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The quarantine folder replaced by a link to a folder of the server's user (here one laid
    out like ~/.ssh, with more files than the quarantine keeps) used to be followed: the scan at
    start deleted all but its 8 newest files, and each part set aside was moved in there. The
    link is refused now (one warning naming it and the fix): after a restart and a quarantine,
    every file outside is there, unchanged (bytes and times), and nothing was added; the damaged
    entry is still taken out of service, its parts removed where they were."""
    root = tmp_path / "store"
    with open_store(root) as store:
        save(store, key(0))
        save(store, key(1))
        assert store.quarantine(key(0), "damaged")  # the quarantine folder now exists
    outside = tmp_path / "dot-ssh"
    outside.mkdir(mode=0o700)
    names = ["authorized_keys", "config", "id_ed25519", "id_ed25519.pub", "known_hosts"]
    for n, name in enumerate(names + [f"note-{i}" for i in range(7)]):
        (outside / name).write_bytes(b"%s %d\n" % (name.encode(), n))
        age(outside / name, 3600 + 60 * n)
    before = snapshot(outside)
    quarantine = ns_dir(root) / "quarantine"
    shutil.rmtree(quarantine)
    quarantine.symlink_to(outside)
    caplog.set_level(logging.WARNING, logger="galahad")
    with open_store(root) as store:  # the scan at open prunes every quarantine folder
        assert snapshot(outside) == before
        assert store.is_committed(key(1))
        assert store.quarantine(key(1), "damaged")  # a damaged part found: set aside
        assert_misses(store, key(1))
        assert store.stats()["quarantined_damaged"] == 1
    assert snapshot(outside) == before
    assert not list(leaf(root, key(1)).glob(f"{key(1).hex}*"))  # removed in place
    said = refusals(caplog)
    assert len(said) == 1 and f"{quarantine} is a symbolic link" in said[0] and f"rm {quarantine}" in said[0]


@pytest.mark.parametrize("level", ["fanout", "leaf"])
def test_a_fanout_or_leaf_folder_linked_outside_is_a_miss_and_nothing_there_is_read_written_or_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str) -> None:
    """A fanout (`ab/`) or leaf (`ab/cd/`) folder replaced by a link to a folder outside that
    holds a copy of a committed entry (and a stale temp file and an uncommitted part, which a
    scan removes in a folder of its own): after a restart, the entry is a miss through every
    read and lookup, a put there fails (counted) instead of writing outside, the scan, eviction
    and quarantine remove nothing there, and no read stamps a time there. One warning names the
    link and the fix; once the link is removed, the store makes the folder again and saves."""
    root = tmp_path / "store"
    with open_store(root) as store:
        save(store, key(0))
    real = folder_at(root, level, key(0))
    outside = tmp_path / "outside"
    shutil.copytree(real, outside)
    stale_leftovers(outside if level == "leaf" else outside / key(0).hex[2:4], key(0))
    for path in outside.rglob("*"):
        age(path, 7200)
    before = snapshot(outside)
    shutil.rmtree(real)
    real.symlink_to(outside)
    caplog.set_level(logging.WARNING, logger="galahad")
    with open_store(root) as store:
        assert_misses(store, key(0))
        assert not store.quarantine(key(0), "damaged")
        with pytest.raises(StoreUnavailable, match=f"store folder {real} is a symbolic link: refused"):
            store.put(key(0), 2, b"a new part")
        assert store.evict(0) == 0 and store.stats()["puts_skipped"] == 1
    assert snapshot(outside) == before
    said = refusals(caplog)
    assert len(said) == 1 and f"{real} is a symbolic link" in said[0] and f"fix: remove the link (rm {real})" in said[0]
    real.unlink()  # the fix the warning names
    with open_store(root) as store:
        assert store.put(key(0), 2, b"a new part") and store.get(key(0), 2) == b"a new part"
    assert real.is_dir() and not real.is_symlink() and snapshot(outside) == before


def test_a_namespace_folder_linked_outside_opens_as_an_empty_store_that_touches_nothing_there(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The namespace folder itself (`ns-<digest>`) replaced by a link to a copy of it outside:
    the store still opens (the server keeps serving), as an empty store: every lookup and read
    is a miss, a put fails (counted) instead of writing there, the scan, eviction and quarantine
    remove and stamp nothing there. One warning names the folder and the fix."""
    root = tmp_path / "store"
    with open_store(root) as store:
        save(store, key(0))
    ns = ns_dir(root)
    outside = tmp_path / "outside"
    shutil.copytree(ns, outside)
    stale_leftovers(outside / key(0).hex[0:2] / key(0).hex[2:4], key(0))
    for path in outside.rglob("*"):
        age(path, 7200)
    before = snapshot(outside)
    shutil.rmtree(ns)
    ns.symlink_to(outside)
    caplog.set_level(logging.WARNING, logger="galahad")
    with open_store(root) as store:
        assert store.fresh
        assert_misses(store, key(0))
        assert not store.quarantine(key(0), "damaged")
        with pytest.raises(StoreUnavailable, match="refused"):
            store.put(key(1), 0, b"a new entry")
        assert store.evict(0) == 0
    assert snapshot(outside) == before
    said = refusals(caplog)
    assert len(said) == 1 and f"{ns} is a symbolic link" in said[0]


@pytest.mark.parametrize("level", ["namespace", "fanout", "leaf"])
def test_a_folder_that_becomes_a_link_under_a_running_store_is_evicted_and_quarantined_without_touching_outside(
        tmp_path: Path, level: str) -> None:
    """The swap done while the server runs, after it has used the folder (it keeps folder
    descriptors open): the entry it wrote is a miss at once; evicting it (the index still knows
    it) and quarantining it remove nothing from the folder the link points to."""
    root = tmp_path / "store"
    with open_store(root) as store:
        save(store, key(0))
        assert store.is_committed(key(0)) and store.get(key(0), 0) is not None
        real = folder_at(root, level, key(0))
        outside = tmp_path / "outside"
        shutil.copytree(real, outside)
        before = snapshot(outside)
        shutil.rmtree(real)
        real.symlink_to(outside)
        assert not store.is_committed(key(0)) and store.get(key(0), 0) is None
        assert store.evict(0) == 1  # forgotten by the index; nothing removed through the link
        assert not store.quarantine(key(0), "damaged")
        with pytest.raises(StoreUnavailable, match="refused"):
            store.put(key(0), 0, b"again")
    assert snapshot(outside) == before


@pytest.mark.parametrize("level", ["namespace", "fanout", "leaf"])
@pytest.mark.parametrize("problem", ["another owner", "writable by others"])
def test_a_folder_of_another_user_or_that_others_can_write_is_refused_once_with_the_fix(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str, problem: str) -> None:
    """A folder below the root that another user owns (chown) or that group and others can
    write (0777) could hold anything anyone put there: what is under it is a miss, nothing is
    saved or removed there, and one warning names the folder and the command that fixes it.
    Fixed, the entries there are served again (refusing destroyed nothing)."""
    if problem == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    root = tmp_path / "store"
    with open_store(root) as store:
        save(store, key(0))
    folder = folder_at(root, level, key(0))
    if problem == "another owner":
        os.chown(folder, 65534, 65534)
        fix = f"chown -R {os.geteuid()} {folder} && chmod 700 {folder}"
    else:
        folder.chmod(0o777)
        fix = f"chmod 700 {folder}"
    before = snapshot(folder)
    caplog.set_level(logging.WARNING, logger="galahad")
    with open_store(root) as store:
        for _ in range(3):
            assert_misses(store, key(0))
        assert not store.quarantine(key(0), "damaged")
        with pytest.raises(StoreUnavailable, match="refused"):
            store.put(key(0), 2, b"a new part")
        assert store.evict(0) == 0
    assert snapshot(folder) == before
    said = refusals(caplog)
    assert len(said) == 1 and f"store folder {folder} is" in said[0] and f"fix: {fix}" in said[0]
    os.chown(folder, os.geteuid(), os.getegid())
    folder.chmod(0o700)
    with open_store(root) as store:
        assert store.is_committed(key(0)) and store.get(key(0), 0) is not None


@pytest.mark.parametrize("level", ["namespace", "fanout", "leaf", "quarantine"])
@pytest.mark.parametrize("what", ["a FIFO", "a file"])
def test_a_fifo_or_a_file_where_a_folder_should_be_is_a_miss_never_waited_on_or_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str, what: str) -> None:
    """A FIFO (which an open would wait on for a writer) or a plain file where the namespace,
    fanout, leaf or quarantine folder should be: the store opens, answers every lookup and read
    at once (a miss under it), a save there fails as saves fail (`StoreUnavailable`, counted),
    quarantine still takes a damaged entry out of service (removing its parts where they are
    when they cannot be set aside), and one warning names what is there and the fix."""
    root = tmp_path / "store"
    with open_store(root) as store:
        save(store, key(0))
        save(store, key(1))
        assert store.quarantine(key(1), "damaged")  # the quarantine folder now exists
    planted = folder_at(root, level, key(0))
    shutil.rmtree(planted)
    if what == "a FIFO":
        os.mkfifo(planted, 0o600)
    else:
        planted.write_bytes(b"not a folder")
    caplog.set_level(logging.WARNING, logger="galahad")

    def use() -> list[object]:
        with open_store(root) as store:
            seen: list[object] = [store.is_committed(key(0))]
            if level == "quarantine":  # the entry is whole: served, and set aside when damaged
                assert store.get(key(0), 0) is not None
                seen.append(store.quarantine(key(0), "damaged"))
                assert not list(leaf(root, key(0)).glob(f"{key(0).hex}*"))
            else:
                assert_misses(store, key(0))
                seen.append(store.quarantine(key(0), "damaged"))
                try:
                    seen.append(store.put(key(0), 2, b"a new part"))
                except StoreUnavailable:
                    seen.append("save skipped")
            seen.append(store.evict(0) >= 0)
            return seen

    outcome = answered(use)
    assert outcome == ([True, True, True] if level == "quarantine" else [False, False, "save skipped", True]), outcome
    assert (stat.S_ISFIFO if what == "a FIFO" else stat.S_ISREG)(planted.lstat().st_mode)  # left as it was
    said = refusals(caplog)
    assert len(said) == 1 and f"{planted} is {what}, not a folder" in said[0] and f"rm {planted}" in said[0]


def test_a_store_root_that_is_a_link_is_followed_as_the_operator_chose(tmp_path: Path) -> None:
    """GALAHAD_CACHE_DIR itself may be a link (a mounted volume, a deploy's `current` link): it
    is the operator's choice, followed, and everything below it works as usual, across a restart."""
    real = tmp_path / "volume" / "galahad"
    real.mkdir(parents=True, mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(real)
    with open_store(link) as store:
        blobs = save(store, key(0))
        assert store.quarantine(key(0), "damaged")
        save(store, key(0))
    with open_store(link) as store:
        assert store.is_committed(key(0)) and store.get(key(0), 1) == blobs[1]
        assert store.used_bytes() == sum(map(len, blobs))
    assert (real / f"ns-{NAMESPACE.hex}" / "quarantine").is_dir()
