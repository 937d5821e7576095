"""The key file on a real filesystem: created 0600 with a fresh key, refused when too open,
malformed or unreadable (naming the file), and one key when several processes create it at once."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from galahad.adapters.crypto.aesgcm import AesGcmCipher, AesGcmCiphers
from galahad.adapters.crypto.key import KeyFileProvider, load_keyring
from galahad.domain.error import KeyRefused
from galahad.domain.secret import SecretKey

A, B = "a1" * 32, "b2" * 32


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_absent_key_file_is_created_0600_in_a_0700_folder_with_a_fresh_key(tmp_path: Path) -> None:
    path = tmp_path / "new" / "deeper" / "store.key"
    ring = KeyFileProvider(path).load()
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700 and _mode(path.parent.parent) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["store.key"]  # no temp file left behind
    assert KeyFileProvider(path).load().current() == ring.current()  # the same key after a restart
    other = KeyFileProvider(tmp_path / "other.key").load()
    assert other.current() != ring.current()  # fresh, not a constant
    assert ring.current().material != bytes(32) and ring.retired == ()


def test_an_absent_key_file_is_refused_when_creation_is_off(tmp_path: Path) -> None:
    path = tmp_path / "store.key"
    with pytest.raises(KeyRefused, match=f"{path}.*does not exist"):
        KeyFileProvider(path, create=False).load()
    assert not path.exists()


def test_an_existing_key_file_is_read_not_replaced(tmp_path: Path) -> None:
    path = _write(tmp_path / "k", f"# ours\n{A}\n{B}\n")
    ring = load_keyring(key_file=str(path))
    assert ring is not None
    assert ring.current() == SecretKey(bytes.fromhex(A))
    assert ring.by_id(SecretKey(bytes.fromhex(B)).key_id) == SecretKey(bytes.fromhex(B))
    assert path.read_text() == f"# ours\n{A}\n{B}\n"


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o604, 0o660, 0o601])
def test_a_key_file_others_can_read_is_refused_naming_the_file_and_the_fix(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path / "store.key", A + "\n", mode)
    with pytest.raises(KeyRefused) as caught:
        KeyFileProvider(path).load()
    message = str(caught.value)
    assert str(path) in message and f"{mode:04o}" in message and f"chmod 600 {path}" in message
    assert A not in message


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_key_file_is_accepted(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path / "store.key", A + "\n", mode)
    assert KeyFileProvider(path).current() == SecretKey(bytes.fromhex(A))


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "no key"), ("# nothing\n", "no key"), ("abc\n", "3 characters"), ("z" * 64, "not hexadecimal"),
     ("é" * 64, "not text")],
)
def test_a_malformed_key_file_is_refused_naming_the_file(tmp_path: Path, text: str, problem: str) -> None:
    path = _write(tmp_path / "store.key", text)
    with pytest.raises(KeyRefused) as caught:
        KeyFileProvider(path).load()
    assert str(path) in str(caught.value) and problem in str(caught.value)


def test_a_folder_in_place_of_the_key_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.key"
    path.mkdir(mode=0o700)
    with pytest.raises(KeyRefused, match=f"{path} is not a regular file"):
        KeyFileProvider(path).load()


def test_a_fifo_in_place_of_the_key_file_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "store.key"
    os.mkfifo(path, 0o600)
    with pytest.raises(KeyRefused, match=f"{path} is not a regular file"):
        KeyFileProvider(path).load()


def test_a_key_file_that_is_a_link_to_a_private_file_is_read_as_mounted_secrets_are(tmp_path: Path) -> None:
    """Kubernetes mounts a secret as a link (`store.key -> ..data/store.key`): the link is followed
    and the permissions checked are the target's."""
    (tmp_path / "..data").mkdir()
    target = _write(tmp_path / "..data" / "store.key", A)
    link = tmp_path / "store.key"
    link.symlink_to(target)
    assert KeyFileProvider(link, create=False).load().current().material == bytes.fromhex(A)
    target.chmod(0o644)
    with pytest.raises(KeyRefused, match=r"open to group or others \(mode 0644\)"):
        KeyFileProvider(link, create=False).load()


def _without_file_read_override() -> list[str] | None:
    """A command prefix that runs a process unable to bypass file permissions, or None."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"] if setpriv else None


def test_an_unreadable_key_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    prefix = _without_file_read_override()
    if prefix is None:
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    path = _write(tmp_path / "store.key", A + "\n", 0o000)
    code = textwrap.dedent(
        f"""
        from galahad.adapters.crypto.key import KeyFileProvider
        from galahad.domain.error import KeyRefused
        try:
            KeyFileProvider({str(path)!r}).load()
        except KeyRefused as exc:
            print("REFUSED", exc)
        """
    )
    done = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("REFUSED") and str(path) in done.stdout and "cannot be read" in done.stdout


def test_a_key_file_that_cannot_be_created_is_refused_naming_it(tmp_path: Path) -> None:
    blocker = _write(tmp_path / "file", "not a folder")
    path = blocker / "store.key"
    with pytest.raises(KeyRefused, match=f"{path} is absent and cannot be created"):
        KeyFileProvider(path).load()


def test_threads_racing_to_create_the_key_file_end_with_one_key(tmp_path: Path) -> None:
    path = tmp_path / "store.key"
    start, ids = threading.Barrier(16), []

    def create() -> None:
        start.wait()
        ids.append(KeyFileProvider(path).current().key_id)

    threads = [threading.Thread(target=create) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 16 and len(set(ids)) == 1
    assert KeyFileProvider(path).current().key_id == ids[0]


def test_without_hard_links_racing_creators_still_end_with_one_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    test_threads_racing_to_create_the_key_file_end_with_one_key(tmp_path)
    assert _mode(tmp_path / "store.key") == 0o600


def test_processes_racing_to_create_the_key_file_end_with_one_key(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "store.key"
    go = time.time() + 2.0  # every process is imported and spinning by then
    code = textwrap.dedent(
        f"""
        import time
        from galahad.adapters.crypto.key import KeyFileProvider
        while time.time() < {go!r}:
            pass
        print(KeyFileProvider({str(path)!r}).current().key_id.hex())
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    ids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(ids) == 1 and ids == {KeyFileProvider(path).current().key_id.hex()}
    assert sorted(p.name for p in path.parent.iterdir()) == ["store.key"]


def test_retired_keys_of_the_file_open_but_never_seal(tmp_path: Path) -> None:
    old, new = SecretKey(bytes.fromhex(B)), SecretKey(bytes.fromhex(A))
    salt, aad = os.urandom(16), b"header"
    sealed_before = AesGcmCipher(old).seal_frame(salt, aad, 0, b"kv")
    ciphers = AesGcmCiphers(KeyFileProvider(_write(tmp_path / "k", f"{A}\n{B}\n")))
    assert ciphers.for_sealing().key_id == new.key_id  # new frames: the first key only
    reader = ciphers.for_key_id(old.key_id)
    assert reader is not None and reader.open_frame(salt, aad, 0, sealed_before) == b"kv"
    with pytest.raises(KeyRefused, match="retired"):
        reader.seal_frame(salt, aad, 1, b"kv")
