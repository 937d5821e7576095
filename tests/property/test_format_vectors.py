"""Every test vector of spec/format-v1.md decodes to its listed fields or raises its listed error.

The vectors come from spec/vectors/make_vectors.py, an independent oracle (struct, hashlib,
xxhash, cryptography; no galahad). These tests read them; they never regenerate them.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from galahad.format.codec import Expect, cipher_lookup, open_part, seal_part, verify_part
from galahad.domain import error
from galahad.domain.secret import SecretKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import CipherId, decode_header, encode_header
from galahad.ports.cipher import Cipher

aesgcm = pytest.importorskip("galahad.adapters.crypto.aesgcm")

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"
LISTING = json.loads((VECTORS / "vectors.json").read_text())
BY_NAME = {v["name"]: v for v in LISTING["vectors"]}
ERRORS = {name: getattr(error, name) for name in ("FormatError", "NewerFormat", "IntegrityError", "ForeignBlock", "UnknownKey")}


def _reader(vector: dict[str, Any]) -> tuple[Expect, list[Cipher]]:
    reader = {**LISTING["default_reader"], **vector["reader"]}
    ciphers: list[Cipher] = [aesgcm.AesGcmCipher(SecretKey(bytes.fromhex(k))) for k in reader["keys"]]
    if reader["accept_checksum"]:
        ciphers.append(Xxh3FrameCheck())
    expect = {k: bytes.fromhex(v) if isinstance(v, str) else v for k, v in reader["expect"].items()}
    return Expect(**expect), ciphers


def _open(vector: dict[str, Any]) -> tuple[bytes, Any, list[Cipher]]:
    blob = (VECTORS / vector["file"]).read_bytes()
    expect, ciphers = _reader(vector)
    return blob, open_part(blob, expect=expect, ciphers=cipher_lookup(*ciphers)), ciphers


def _decoded(h: Any) -> dict[str, Any]:
    fields = ("major", "minor", "incompat_flags", "compat_flags", "header_len", "token_start", "token_end", "rank",
              "world", "block_size", "cipher_id", "frame_size", "payload_len")
    out: dict[str, Any] = {name: int(getattr(h, name)) for name in fields}
    out.update(namespace=h.namespace.hex(), chain_key=h.chain_key.hex(), key_id=h.key_id.hex(), salt=h.salt.hex(),
               segment_count=len(h.segments))
    return out


def _segments(h: Any) -> list[dict[str, Any]]:
    return [{"group": s.group, "kind": int(s.kind), "dtype": int(s.dtype), "dtype_name": s.dtype.label,
             "layer": s.layer, "shape": list(s.shape), "nbytes": s.nbytes} for s in h.segments]


def test_the_listing_covers_every_required_case() -> None:
    required = {"plain-one-segment", "plain-multi-segment", "sealed-aes-gcm", "bad-magic", "future-major",
                "unknown-incompat-flag", "compat-flags-unknown", "truncated-header", "truncated-payload",
                "trailing-bytes", "header-checksum-bad", "frame-tag-bad", "payload-len-not-sum",
                "header-len-absurd", "payload-len-absurd"}
    assert required <= set(BY_NAME)
    assert all((VECTORS / v["file"]).is_file() for v in LISTING["vectors"])


@pytest.mark.parametrize("name", [v["name"] for v in LISTING["vectors"] if v["valid"]])
def test_valid_vector_decodes_to_its_listed_fields(name: str) -> None:
    vector = BY_NAME[name]
    listed = BY_NAME[vector.get("same_as", name)]
    blob, opened, _ = _open(vector)
    assert _decoded(opened.header) == listed["header"]
    assert _segments(opened.header) == listed["segments"]
    assert opened.header.frame_count == listed["frame_count"]
    assert len(blob) == listed["file_size"]
    assert hashlib.sha256(opened.payload).hexdigest() == listed["payload_sha256"]


@pytest.mark.parametrize("name", [v["name"] for v in LISTING["vectors"] if v["valid"] and "same_as" not in v])
def test_valid_vector_is_what_our_writer_writes(name: str) -> None:
    blob, opened, ciphers = _open(BY_NAME[name])
    h = opened.header
    assert encode_header(decode_header(blob)) == blob[: h.header_len]
    cipher = next(c for c in ciphers if c.cipher_id == h.cipher_id and c.key_id == h.key_id)
    assert cipher.cipher_id in (CipherId.XXH3, CipherId.AES_256_GCM)
    assert b"".join(seal_part(h, opened.segment_views(), cipher, salt=h.salt)) == blob


@pytest.mark.parametrize("name", [v["name"] for v in LISTING["vectors"] if not v["valid"]])
def test_invalid_vector_raises_its_listed_error(name: str) -> None:
    vector = BY_NAME[name]
    with pytest.raises(error.FormatError) as caught:
        _open(vector)
    assert type(caught.value) is ERRORS[vector["error"]], caught.value


@pytest.mark.parametrize("name", [v["name"] for v in LISTING["vectors"]])
def test_verify_part_gives_every_vector_the_verdict_it_lists(name: str) -> None:
    """`verify_part` (the frame-at-a-time check `galahad-format` uses) conforms as `open_part` does:
    a valid vector's listed header, an invalid one's listed error class."""
    vector = BY_NAME[name]
    blob = (VECTORS / vector["file"]).read_bytes()
    expect, ciphers = _reader(vector)
    if vector["valid"]:
        h = verify_part(blob, expect=expect, ciphers=cipher_lookup(*ciphers))
        assert _decoded(h) == BY_NAME[vector.get("same_as", name)]["header"]
        return
    with pytest.raises(error.FormatError) as caught:
        verify_part(blob, expect=expect, ciphers=cipher_lookup(*ciphers))
    assert type(caught.value) is ERRORS[vector["error"]], caught.value


def test_the_committed_vectors_are_what_the_oracle_writes() -> None:
    done = subprocess.run([sys.executable, str(VECTORS / "make_vectors.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_oracle_does_not_import_galahad() -> None:
    tree = ast.parse((VECTORS / "make_vectors.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "hashlib", "json", "math", "struct", "sys", "pathlib", "xxhash", "cryptography"}
