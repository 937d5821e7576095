"""Permissions: what the store creates is private (files 0600, folders 0700, whatever the umask),
and a root other users could write to, or that belongs to someone else, is refused with the fix."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore, StoreRoot
from galahad.domain.chain import ChainKey
from galahad.domain.error import StoreUnavailable
from helpers.store_worker import NAMESPACE


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_everything_the_store_creates_is_private_even_with_umask_zero(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "a" / "store"
    with FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 30, rescan_s=None) as store:
        k = ChainKey(hashlib.sha256(b"private").digest())
        store.put(k, 0, b"x" * 100)
        store.put(k, 1, [b"y" * 50, b"z" * 50])
        store.commit(k, (0, 1))
        store.put(ChainKey(hashlib.sha256(b"aside").digest()), 0, b"q")
        store.quarantine(ChainKey(hashlib.sha256(b"aside").digest()), "damaged")
    made = [tmp_path / "a", root, *root.rglob("*")]  # the parent it had to make too
    assert {p.suffix for p in made if p.is_file()} >= {".json", ".blk", ".ok", ".damaged"}
    for path in made:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} has mode {mode:04o}"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702])
def test_a_root_others_can_write_to_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "store"
    FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 30, rescan_s=None).close()
    root.chmod(mode)
    for opening in (lambda: FilesystemBlockStore(root, NAMESPACE), lambda: StoreRoot.open(root)):
        with pytest.raises(StoreUnavailable) as caught:
            opening()
        assert str(root) in str(caught.value) and f"chmod 700 {root}" in str(caught.value)
    root.chmod(0o755)  # readable by others is allowed: the files inside are 0600
    FilesystemBlockStore(root, NAMESPACE, rescan_s=None).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_root_owned_by_another_user_is_refused_for_writing_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "store"
    FilesystemBlockStore(root, NAMESPACE, max_bytes=1 << 30, rescan_s=None).close()
    os.chown(root, 65534, 65534)
    with pytest.raises(StoreUnavailable) as caught:
        FilesystemBlockStore(root, NAMESPACE)
    assert str(root) in str(caught.value) and "chown" in str(caught.value) and "uid 65534" in str(caught.value)
    assert StoreRoot.open(root).max_bytes == 1 << 30  # tools may still look (they never write)


def test_a_store_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "store").write_bytes(b"")
    with pytest.raises(StoreUnavailable, match="not a folder"):
        StoreRoot.open(tmp_path / "store")


def test_the_servers_store_folder_and_its_missing_parents_are_made_private_and_a_file_there_is_named(
        tmp_path: Path, open_umask: None) -> None:
    """GALAHAD_CACHE_DIR may name folders that do not exist yet: the server makes each one 0700
    (a parent made 0777 under this umask would let anyone list, or replace, the store folder)."""
    from galahad.bootstrap import _open_store
    from galahad.config import read_settings

    deep = tmp_path / "srv" / "galahad" / "store"
    _open_store(read_settings({"GALAHAD_CACHE_DIR": str(deep)}), NAMESPACE).close()
    for folder in (tmp_path / "srv", tmp_path / "srv" / "galahad", deep):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(StoreUnavailable, match=r"GALAHAD_CACHE_DIR=.*afile is a file, not a folder; point"):
        _open_store(read_settings({"GALAHAD_CACHE_DIR": str(tmp_path / "afile")}), NAMESPACE)


@pytest.mark.parametrize("plant", ["fifo", "symlink", "folder"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_at_once_never_waited_on_or_followed(
        tmp_path: Path, plant: str) -> None:
    """A FIFO at galahad-store.json made the server's start wait forever for a writer; a symbolic
    link there was followed (to any file of the machine). Both are refused, naming what they are."""
    import threading

    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    manifest = root / "galahad-store.json"
    if plant == "fifo":
        os.mkfifo(manifest, 0o600)
    elif plant == "symlink":
        secret = tmp_path / "elsewhere.json"
        secret.write_text('{"format": "galahad-store", "version": 1, "max_bytes": 5, "created": "x"}')
        manifest.symlink_to(secret)
    else:
        manifest.mkdir()
    outcome: list[BaseException | None] = []

    def opening() -> None:
        try:
            FilesystemBlockStore(root, NAMESPACE, rescan_s=None).close()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    worker = threading.Thread(target=opening, daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # the old code: blocked in open() on the FIFO; let it go
        fd = os.open(manifest, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(5)
        pytest.fail("opening the store waited on a FIFO at its manifest")
    assert isinstance(outcome[0], StoreUnavailable), outcome
    what = {"fifo": "a FIFO", "symlink": "a symbolic link", "folder": "a folder"}[plant]
    assert f"{manifest} is not a regular file ({what}); move it away" in str(outcome[0])
