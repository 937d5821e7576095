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
    made = [root, *root.rglob("*")]
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
