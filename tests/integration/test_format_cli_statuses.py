"""`galahad-format` says "good" only of what it verified and a server would load.

A server with a key refuses an unencrypted (cipher 0, checksum only) part: anyone who can write the
store folder could have planted one. `verify --key-file` and `dump --verify --key-file` say so of
such a part, by name, and exit with status 3 (`NOT_VERIFIED`), as they do when a sealed file could
not be checked for want of its key; a problem found (status 1) still comes first. Real stores
written by the service's own writer, a real key file; the planted part is a genuine checksum-only
part for the same entry, made with the project's own writer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from galahad.adapters.crypto.key import Keyring
from galahad.cli import format as format_cli
from galahad.format.codec import seal_part
from galahad.domain.chain import ChainKey
from galahad.domain.chunking import Span
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import decode_header
from galahad.app.service import KVCacheService, SegmentSpec
from helpers.services import LAYERS, helper_service

SHAPE = (1, 2, 16, 64)  # float32: 8 KiB a layer
MATERIAL = bytes(range(32))


@pytest.fixture(autouse=True)
def _no_server_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GALAHAD_KEY_FILE", raising=False)
    monkeypatch.delenv("GALAHAD_KEY_COMMAND", raising=False)


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "key"
    path.write_text(MATERIAL.hex() + "\n")
    path.chmod(0o600)
    return path


def _saved(svc: KVCacheService, n: int) -> list[ChainKey]:
    keys = svc.keys(list(range(n * 64 + 1)), svc.seed())
    entries = []
    for i in range(n):
        key = keys[svc.chunking.key_index(64 * (i + 1))]
        payload = [os.urandom(4 * 2 * 16 * 64) for _ in range(LAYERS)]
        segments = [SegmentSpec(0, layer, 0, "float32", SHAPE) for layer in range(LAYERS)]
        assert svc.save_part(key, Span(64 * i, 64 * (i + 1)), 0, segments, payload) and svc.commit(key)
        entries.append(key)
    return entries


def _part_file(root: Path, key: ChainKey) -> Path:
    (found,) = (p for p in root.rglob(f"{key.hex}.p0.blk") if "quarantine" not in p.parts)
    return found


def _plant_unsealed(path: Path) -> None:
    """Replace the sealed part at `path` with a checksum-only part for the same entry, rank and
    namespace (every frame's checksum right): what anyone who can write the store can make."""
    h = decode_header(path.read_bytes())
    payload = [b"\x5a" * s.nbytes for s in h.segments]
    path.write_bytes(b"".join(bytes(c) for c in seal_part(h, payload, Xxh3FrameCheck())))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = format_cli.main(list(argv))
    return code, capsys.readouterr().out


def test_verify_with_a_key_names_a_planted_unsealed_part_and_exits_3_as_the_server_refuses_it(
        tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`verify --key-file` of a sealed store holding a planted checksum-only part used to count it
    good and exit 0. The server with that key refuses it (`refused_key`); the tool now says
    UNSEALED for it, counts it apart from the good parts, and exits 3; the JSON lists it."""
    root = tmp_path / "store"
    svc = helper_service(root, Keyring(SecretKey(MATERIAL)))
    try:
        keys = _saved(svc, 2)
        planted = _part_file(root, keys[1])
        _plant_unsealed(planted)
        assert svc.load_part(keys[1], 0) is None and svc.counters.refused == {"key": 1}  # the server's verdict
    finally:
        svc.close()
    code, out = _run(capsys, "verify", "--key-file", str(key_file), str(root))
    assert code == getattr(format_cli, "NOT_VERIFIED", None) == 3, out
    assert f"UNSEALED     {planted}: a checksum-only part (cipher 0, not encrypted): a server with a key refuses it" \
        in out
    assert "2 part file(s) checked: 1 good, 0 bad, 0 not checked, 1 unsealed" in out and "BAD" not in out
    code, out = _run(capsys, "verify", "--json", "--key-file", str(key_file), str(root))
    report = json.loads(out)
    assert code == 3 and report["good"] == 1 and [u["file"] for u in report["unsealed"]] == [str(planted)]
    code, out = _run(capsys, "dump", "--verify", "--key-file", str(key_file), str(planted))
    assert code == 3 and "verify     UNSEALED: every frame's checksum verified, but a checksum-only part" in out
    code, out = _run(capsys, "dump", "--verify", "--json", "--key-file", str(key_file), str(planted))
    (entry,) = json.loads(out)
    assert code == 3 and entry["frames_verified"] is True and entry["accepted"] is False


def test_verify_and_dump_verify_exit_3_for_a_sealed_file_they_could_not_check(
        tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the key (or with another), a sealed file's frames are not verified: each is named
    NOT CHECKED with the reason, and the status is 3, not 0. With the key: 0. A problem found
    beside files not checked is status 1."""
    root = tmp_path / "store"
    svc = helper_service(root, Keyring(SecretKey(MATERIAL)))
    try:
        keys = _saved(svc, 2)
    finally:
        svc.close()
    sealed = _part_file(root, keys[0])
    other = tmp_path / "other-key"
    other.write_text(os.urandom(32).hex() + "\n")
    other.chmod(0o600)
    code, out = _run(capsys, "verify", str(root))
    assert code == 3 and out.count("NOT CHECKED  ") == 2 and "0 good, 0 bad, 2 not checked" in out, out
    code, out = _run(capsys, "dump", "--verify", str(sealed))
    assert code == 3 and "verify     not checked: no key" in out
    code, out = _run(capsys, "dump", "--verify", "--key-file", str(other), str(sealed))
    assert code == 3 and "is not in the key file" in out
    code, out = _run(capsys, "dump", "--verify", "--json", str(sealed))
    (entry,) = json.loads(out)
    assert code == 3 and entry["frames_verified"] is False and entry["accepted"] is False
    code, out = _run(capsys, "verify", "--key-file", str(key_file), str(root))
    assert code == 0 and "2 good, 0 bad, 0 not checked, 0 unsealed" in out
    code, _ = _run(capsys, "dump", "--verify", "--key-file", str(key_file), str(sealed))
    assert code == 0
    damaged = _part_file(root, keys[1])
    data = bytearray(damaged.read_bytes())
    data[40] ^= 0x01  # in its header, whose checksum needs no key
    damaged.write_bytes(bytes(data))
    code, out = _run(capsys, "verify", str(root))  # one bad, one not checked: the problem wins
    assert code == 1 and "1 not checked" in out, out
    code, out = _run(capsys, "dump", "--verify", str(sealed), str(damaged))
    assert code == 1, out


def test_a_store_without_encryption_verifies_good_with_status_0(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Checksum-only parts are what a server without a key writes and loads: no key given, they
    are verified and good (status 0), never flagged as unsealed."""
    root = tmp_path / "store"
    svc = helper_service(root)
    try:
        keys = _saved(svc, 2)
    finally:
        svc.close()
    code, out = _run(capsys, "verify", str(root))
    assert code == 0 and "2 good, 0 bad, 0 not checked, 0 unsealed" in out
    code, out = _run(capsys, "dump", "--verify", str(_part_file(root, keys[0])))
    assert code == 0 and "verify     OK: every frame verified" in out
