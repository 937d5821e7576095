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

A, B = "a1b2c3d4" * 8, "b2c3d4e5" * 8


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


OTHER_UID = 54321  # no user of this machine: a file another user owns


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_key_file_another_user_owns_is_refused_even_for_root_naming_the_file_and_the_fix(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Root can read any file, so mode 0600 alone does not make a key file root's own: a file
    another user owns is that user's to read and replace. The server refuses it (one `NOT
    CACHING` line, caching off) and so does `galahad-format --key-file`, both through the same
    reader; given back to the server's user, it is read."""
    from galahad.bootstrap import open_cache
    from galahad.config import read_settings
    from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
    from galahad.domain.rank import RankLayout
    from vllm_support.licence import make_licence

    path = _write(tmp_path / "store.key", A + "\n")
    os.chown(path, OTHER_UID, -1)
    with pytest.raises(KeyRefused) as caught:
        KeyFileProvider(path).load()
    message = str(caught.value)
    assert message == (f"key file {path} belongs to uid {OTHER_UID}, not to uid 0 (root) that runs this "
                       f"process; its owner can read and replace the key: give it to this user (`chown root "
                       f"{path}`, as root) or run as its owner"), message
    assert A not in message

    lic, pub = make_licence(tmp_path / "lic")
    settings = read_settings({"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_KEY_FILE": str(path),
                              "GALAHAD_LICENCE_FILE": lic, "GALAHAD_LICENCE_ISSUER_KEY": pub})
    ns = Namespace(model="owner", model_fingerprint="owner", dtype="float32", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 1),), payload_order=PayloadOrder.LAYER)
    with caplog.at_level("WARNING", logger="galahad"):
        handle = open_cache(settings, ns, RankLayout())
    assert handle.service is None and handle.reason == message
    assert [r.getMessage() for r in caplog.records if "NOT CACHING" in r.getMessage()] == [
        f"[galahad] NOT CACHING: {message}"]

    os.chown(path, 0, -1)
    assert KeyFileProvider(path).load().current() == SecretKey(bytes.fromhex(A))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_galahad_format_refuses_a_key_file_another_user_owns_as_the_server_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from galahad.cli.format import main

    path = _write(tmp_path / "store.key", A + "\n")
    os.chown(path, OTHER_UID, -1)
    part = tmp_path / "part.blk"
    part.write_bytes(b"")
    assert main(["dump", "--verify", "--key-file", str(path), str(part)]) != 0
    err = capsys.readouterr().err
    assert f"key file {path} belongs to uid {OTHER_UID}, not to uid 0 (root)" in err and A not in err


@pytest.mark.parametrize(("text", "line", "what"), [("0" * 64, 1, "all zeros"), ("00" * 32, 1, "all zeros"),
                                                    ("11" * 32, 1, "one byte repeated"),
                                                    (f"{A}\n{'F' * 64}", 2, "one byte repeated")])
def test_a_placeholder_key_is_refused_naming_the_file_and_the_line(tmp_path: Path, text: str, line: int,
                                                                    what: str) -> None:
    """64 zeros (a template's placeholder) is well-formed hex but no secret: sealed with it, the
    store is readable and forgeable by anyone; retired or current, it is never used."""
    path = _write(tmp_path / "store.key", text + "\n")
    with pytest.raises(KeyRefused) as caught:
        KeyFileProvider(path).load()
    assert str(caught.value) == (f"key file {path}: line {line} is not a usable key ({what}: a placeholder "
                                 "anyone can guess); replace it with a random key (generate one with: "
                                 "openssl rand -hex 32)")


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
