"""`galahad-format` on real files: a store written by the filesystem adapter, then damaged by hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore
from galahad.cli.format import main
from galahad.format.codec import seal_part
from galahad.domain.chain import ChainKey, ChainSeed, chain_keys
from galahad.domain.namespace import GroupKind, KVGroup, Namespace
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader, DType, Segment, SegmentKind
from galahad.ports.cipher import Cipher

NS = Namespace(model="tiny-llama", model_fingerprint="fp", dtype="bfloat16", kv_cache_dtype="auto", block_size=16,
               groups=(KVGroup(GroupKind.FULL, 16, 2),), tp_size=2)
KEYS = chain_keys(ChainSeed(NS.digest()), list(range(64)), 16)  # four entries
SEGMENTS = [Segment(0, SegmentKind.KV, DType.BF16, layer, (2, 16, 8, 8)) for layer in range(2)]  # 8 KiB


def _part(key: ChainKey, rank: int, cipher: Cipher = Xxh3FrameCheck(), namespace: bytes | None = None) -> bytes:
    h = BlockHeader(namespace=namespace or NS.digest(), chain_key=key.raw, token_start=0, token_end=16, rank=rank,
                    world=2, block_size=16, segments=SEGMENTS, frame_size=4096)
    payload = [bytes([rank + layer]) * s.nbytes for layer, s in enumerate(SEGMENTS)]
    return b"".join(seal_part(h, payload, cipher))


def _path(root: Path, key: ChainKey, part: int) -> Path:
    return root / f"ns-{NS.hex}" / key.hex[0:2] / key.hex[2:4] / f"{key.hex}.p{part}.blk"


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """Four committed entries of two parts each; one more entry quarantined."""
    root = tmp_path / "store"
    with FilesystemBlockStore(root, NS, max_bytes=64 << 20, rescan_s=None) as fs:
        for key in KEYS:
            for rank in (0, 1):
                fs.put(key, rank, _part(key, rank))
            assert fs.commit(key, (0, 1))
        extra = ChainKey(b"\x07" * 32)
        fs.put(extra, 0, _part(extra, 0))
        fs.quarantine(extra, "damaged")
    return root


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_passes_a_healthy_store_and_lists_quarantined_files_apart(store: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "verify", str(store))
    assert code == 0, out
    assert "8 part file(s) checked: 8 good, 0 bad" in out
    assert "QUARANTINED" in out and "BAD" not in out


def test_verify_names_each_damaged_swapped_and_missing_part(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damaged, swapped = _path(store, KEYS[0], 1), _path(store, KEYS[1], 0)
    foreign, missing = _path(store, KEYS[2], 0), _path(store, KEYS[3], 1)
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0x01
    damaged.write_bytes(bytes(data))
    swapped.write_bytes(_part(KEYS[3], 0))  # another entry's part under this entry's name
    foreign.write_bytes(_part(KEYS[2], 0, namespace=b"\x00" * 32))  # another namespace's part
    missing.unlink()
    code, out, _ = _run(capsys, "verify", str(store))
    assert code == 1
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 4, out
    assert any(str(damaged) in line and "IntegrityError" in line for line in bad)
    assert any(str(swapped) in line and "chain_key" in line and "ForeignBlock" in line for line in bad)
    assert any(str(foreign) in line and "namespace" in line for line in bad)
    assert any(KEYS[3].hex + ".ok" in line and "part 1 is missing" in line for line in bad)
    assert not any(str(_path(store, KEYS[0], 0)) in line for line in bad)  # the good part of a bad entry


def test_verify_json_lists_the_bad_parts(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = _path(store, KEYS[2], 1)
    target.write_bytes(target.read_bytes()[:-1])
    code, out, _ = _run(capsys, "verify", "--json", str(store))
    report = json.loads(out)
    assert code == 1
    assert report["parts_checked"] == 8 and report["good"] == 7
    reasons = {b["file"]: b["reason"] for b in report["bad"]}
    marker = target.parent / f"{KEYS[2].hex}.ok"
    assert set(reasons) == {str(target), str(marker)}
    assert "truncated" in reasons[str(target)]
    assert "part 1 is" in reasons[str(marker)]  # the commit marker recorded the part's size
    assert len(report["quarantined"]) == 1


def test_a_file_in_the_wrong_folder_is_reported(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _path(store, KEYS[0], 0)
    shutil.move(source, source.parent.parent / source.name)
    code, out, _ = _run(capsys, "verify", str(store))
    assert code == 1 and f"BAD          {source.parent.parent / source.name}: outside its folder" in out


def test_stats_counts_entries_parts_ranks_and_namespaces(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "stats", "--json", str(store))
    assert code == 0
    stats = json.loads(out)
    assert stats["totals"]["committed_entries"] == 4 and stats["totals"]["parts"] == 8
    assert stats["totals"]["quarantined_files"] == 1 and stats["totals"]["namespaces"] == 1
    space = stats["namespaces"][NS.hex]
    assert space["ranks"] == [0, 1] and space["world_sizes"] == [2] and space["tokens"] == 4 * 16
    assert space["part_bytes"] == sum(p.stat().st_size for p in store.rglob("*.blk") if "quarantine" not in p.parts)
    assert space["model"] == "tiny-llama"
    code, out, _ = _run(capsys, "stats", str(store))
    assert code == 0 and "4 committed" in out and "8 (" in out


def test_dump_prints_header_segments_and_frames(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _path(store, KEYS[1], 1)
    code, out, _ = _run(capsys, "dump", str(path))
    assert code == 0
    assert f"chain key  {KEYS[1].hex}" in out and "rank       1 of 2" in out
    assert out.count(" kv     bf16 ") == 2
    assert "frames     2" in out and "verify" not in out
    code, out, _ = _run(capsys, "dump", "--json", str(path))
    (entry,) = json.loads(out)
    assert entry["header"]["chain_key"] == KEYS[1].hex and entry["header"]["payload_len"] == 8192
    assert [f["plain_len"] for f in entry["header"]["frames"]] == [4096, 4096]
    assert [s["shape"] for s in entry["header"]["segments"]] == [[2, 16, 8, 8]] * 2
    # written by the store today: the aligned layout, payload after a 4096-byte header, tags last
    assert entry["header"]["layout"] == "aligned" and entry["header"]["header_len"] == 4096
    assert [(f["data_offset"], f["tag_offset"]) for f in entry["header"]["frames"]] == [(4096, 12288), (8192, 12304)]
    assert path.stat().st_size == 12320


@pytest.mark.parametrize("name, layout, frames", [
    ("aligned-multi-segment", "aligned", [(0, 4096, 4096, 11368), (1, 3176, 8192, 11384)]),
    ("plain-multi-segment", "flat", [(0, 4096, 512, 4608), (1, 3176, 4624, 7800)]),
])
def test_dump_prints_where_each_frame_and_tag_lie_in_either_layout(
        capsys: pytest.CaptureFixture[str], name: str, layout: str, frames: list[tuple[int, int, int, int]]) -> None:
    path = Path(__file__).resolve().parents[2] / "spec" / "vectors" / f"{name}.blk"
    code, out, _ = _run(capsys, "dump", "--verify", str(path))
    assert code == 0 and f"layout     {layout} (" in out and "OK: every frame verified" in out
    for index, length, data, tag in frames:
        assert f"  {index:5d}  {index * 4096:14d}  {length:10d}  {data:14d}  {tag:14d}" in out


def test_dump_verify_checks_every_frame(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = _path(store, KEYS[0], 0), _path(store, KEYS[0], 1)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x80
    bad.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "dump", "--verify", str(good), str(bad))
    assert code == 1
    assert "verify     OK: every frame verified" in out
    assert "verify     FAILED: frame 1" in out
    code, out, _ = _run(capsys, "dump", "--verify", "--json", str(bad))
    assert json.loads(out)[0]["error"]["class"] == "IntegrityError"


def _sealer(tmp_path: Path) -> tuple[Cipher, Path]:
    """An AES-GCM cipher and a key file (0600) holding its key."""
    aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")
    material = bytes(range(32))
    key_file = tmp_path / "key"
    key_file.write_text(material.hex() + "\n")
    key_file.chmod(0o600)
    return aesgcm.AesGcmCipher(SecretKey(material)), key_file


def test_dump_verify_opens_sealed_files_with_the_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sealer, key_file = _sealer(tmp_path)
    sealed = tmp_path / "sealed.blk"
    sealed.write_bytes(_part(KEYS[0], 0, sealer))
    monkeypatch.delenv("GALAHAD_KEY_FILE", raising=False)
    code, out, _ = _run(capsys, "dump", "--verify", str(sealed))
    assert code == 3 and "not checked: no key" in out  # nothing wrong found, not all verified
    code, out, _ = _run(capsys, "dump", "--verify", "--key-file", str(key_file), str(sealed))
    assert code == 0 and "OK: every frame verified" in out
    monkeypatch.setenv("GALAHAD_KEY_FILE", str(key_file))
    code, out, _ = _run(capsys, "dump", "--verify", str(sealed))
    assert code == 0 and "OK: every frame verified" in out
    other = tmp_path / "other"
    other.write_text(bytes(range(100, 132)).hex() + "\n")
    other.chmod(0o600)
    code, out, _ = _run(capsys, "dump", "--verify", "--key-file", str(other), str(sealed))
    assert code == 3 and "is not in the key file" in out


def test_dump_and_verify_open_sealed_files_with_the_key_command_as_the_server_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sealer, key_file = _sealer(tmp_path)
    root = tmp_path / "store"
    with FilesystemBlockStore(root, NS, max_bytes=64 << 20, rescan_s=None) as fs:
        for rank in (0, 1):
            fs.put(KEYS[0], rank, _part(KEYS[0], rank, sealer))
        assert fs.commit(KEYS[0], (0, 1))
    sealed = _path(root, KEYS[0], 0)
    monkeypatch.delenv("GALAHAD_KEY_FILE", raising=False)
    monkeypatch.delenv("GALAHAD_KEY_COMMAND", raising=False)
    command = f"cat {key_file}"
    code, out, _ = _run(capsys, "dump", "--verify", "--key-command", command, str(sealed))
    assert code == 0 and "OK: every frame verified" in out
    code, out, _ = _run(capsys, "verify", "--key-command", command, str(root))
    assert code == 0 and "2 good, 0 bad, 0 not checked" in out
    code, out, _ = _run(capsys, "verify", str(root))  # without it, nothing is checked
    assert code == 3 and "0 good, 0 bad, 2 not checked" in out
    monkeypatch.setenv("GALAHAD_KEY_COMMAND", command)  # the server's setting is the default
    code, out, _ = _run(capsys, "verify", str(root))
    assert code == 0 and "2 good, 0 bad, 0 not checked" in out
    monkeypatch.setenv("GALAHAD_KEY_FILE", str(key_file))  # both set: refused, as the server refuses it
    code, _, err = _run(capsys, "verify", str(root))
    assert code == 2 and "GALAHAD_KEY_FILE and GALAHAD_KEY_COMMAND are both set" in err
    monkeypatch.delenv("GALAHAD_KEY_COMMAND")
    monkeypatch.setenv("GALAHAD_KEY_FILE", " ")  # blank: the server refuses it, never "no key"
    code, _, err = _run(capsys, "verify", str(root))
    assert code == 2 and "GALAHAD_KEY_FILE is set but empty" in err
    code, _, err = _run(capsys, "verify", "--key-file", str(key_file), "--key-command", command, str(root))
    assert code == 2 and "both given" in err
    code, out, _ = _run(capsys, "dump", "--verify", "--key-command", f"echo {bytes(range(100, 132)).hex()}", str(sealed))
    assert code == 3 and "is not in the keys printed by `echo …`" in out
    secret = "VAULT_TOKEN=s3cr3t"
    code, _, err = _run(capsys, "verify", "--key-command", f"{secret} false --token x", str(root))
    assert code == 2 and "`false …`" in err and "s3cr3t" not in err  # the program only, never its arguments


def _console(*argv: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("galahad-format")
    command = [exe, *argv] if exe else [sys.executable, "-m", "galahad.cli.format", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("GALAHAD_KEY_")})


@pytest.mark.parametrize("content", [b"", b"hello\n", b"GALAHAD\x1a" + bytes(40), bytes(range(256)) * 8])
def test_a_file_that_is_not_a_block_gets_one_line_and_a_failing_status(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    done = _console("dump", str(path))
    assert done.returncode == 1
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and str(path) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv", [("dump", "{}/absent.blk"), ("dump", "{}"), ("verify", "{}/absent"), ("stats", "{}/absent"),
                                  ("verify", "{}"), ("dump", "--verify", "--key-file", "{}/nokey", "{}")])
def test_a_missing_path_or_a_folder_that_is_no_store_gets_one_line(tmp_path: Path, argv: tuple[str, ...]) -> None:
    done = _console(*(a.format(tmp_path) for a in argv))
    assert done.returncode == 2  # a usage problem (docs/format.md), not a refused file (1)
    assert len(done.stderr.splitlines()) == 1 and str(tmp_path) in done.stderr
    assert "Traceback" not in done.stderr
