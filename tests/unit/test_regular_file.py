"""The one reader of the small files Galahad trusts (store manifest, commit markers, namespace
files, licence, issuer keys, key file): never blocks, names what it found, follows a link only
where a user may point one, and reads no more than asked."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from galahad.adapters.posix.private_folder import make_private_folders
from galahad.adapters.posix.regular_file import NotARegularFile, read_regular, read_regular_with_stat

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


def test_a_fifo_is_named_at_once_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "manifest"
    os.mkfifo(fifo)
    for follow in (True, False):
        with pytest.raises(NotARegularFile) as info:
            read_regular(fifo, 100, follow_links=follow)
        assert info.value.kind == "a FIFO" and info.value.strerror == "a FIFO"
        assert str(info.value) == f"{fifo} is not a regular file (a FIFO)"


def test_a_link_is_followed_for_files_users_point_at_and_refused_inside_the_store(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"secret")
    link = tmp_path / "link"  # a mounted secret is a link of this kind
    link.symlink_to(target)
    assert read_regular(link, 100) == b"secret"
    with pytest.raises(NotARegularFile) as info:
        read_regular(link, 100, follow_links=False)
    assert info.value.kind == "a symbolic link" and info.value.errno == errno.ELOOP


def test_a_socket_which_cannot_be_opened_is_named(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(NotARegularFile, match=r"\(a socket\)"):
            read_regular(path, 100)


def test_a_folder_is_named_and_a_missing_file_is_the_plain_error(tmp_path: Path) -> None:
    with pytest.raises(NotARegularFile, match=r"\(a folder\)"):
        read_regular(tmp_path, 100)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "absent", 100)


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 5000])
def test_at_most_one_byte_past_the_limit_is_read_so_too_big_can_be_told(tmp_path: Path, size: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 20)
    os.truncate(path, size)
    raw, info = read_regular_with_stat(path, 100)
    assert raw == path.read_bytes()[:101] and info.st_size == size


def test_private_folders_are_0700_whatever_the_umask_and_existing_ones_are_left(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(mode=0o755)
    old = os.umask(0)
    try:
        make_private_folders(str(tmp_path / "a" / "b" / "c"))
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o755
    assert all((tmp_path / p).stat().st_mode & 0o777 == 0o700 for p in ("a/b", "a/b/c"))
