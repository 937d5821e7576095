"""AesGcmCipher: the normative frame rule, checked against an independent oracle, and its edges.

The oracle is `cryptography` (HKDF + AESGCM) driven by the rule as written in the spec; the code
under test seals with pycryptodome. The known-answer vector below was computed with that oracle
alone, never by the code under test.
"""

from __future__ import annotations

import array
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from galahad.adapters.crypto import aesgcm
from galahad.adapters.crypto.aesgcm import TAG_BYTES, AesGcmCipher, AesGcmCiphers
from galahad.adapters.crypto.key import Keyring
from galahad.domain.error import FormatError, IntegrityError, KeyRefused
from galahad.domain.secret import SecretKey

MASTER = SecretKey(bytes(range(32)))
SALT = bytes(range(0x40, 0x50))
AAD = b"galahad header bytes"
DATA = b"KV cache frame payload, 37 bytes.."
# HKDF-SHA256(MASTER, SALT, b"galahad-v1-frame-key") and AESGCM(file key).encrypt(nonce(3), DATA, AAD || u64le(3))
KAT_FILE_KEY = "26ded229015d69ac32144fedf6ff89276d21da85afb86f69356bd4be69424ea4"
KAT_SEALED_3 = (
    "dece50e6d3969d731eb9b2aafbce85ffff9f9e7d0bff418262ca8f67829a168366af5d71a7a7ccbd02e619c10961ece3030c"
)


def _oracle_seal(key: SecretKey, salt: bytes, aad: bytes, index: int, data: bytes) -> bytes:
    file_key = HKDF(hashes.SHA256(), 32, salt, b"galahad-v1-frame-key").derive(key.material)
    nonce = bytes(4) + index.to_bytes(8, "little")
    return AESGCM(file_key).encrypt(nonce, data, aad + index.to_bytes(8, "little"))


def test_sealing_matches_the_known_answer_vector() -> None:
    sealed = AesGcmCipher(MASTER).seal_frame(SALT, AAD, 3, DATA)
    assert sealed.hex() == KAT_SEALED_3
    assert AesGcmCipher(MASTER).open_frame(SALT, AAD, 3, bytes.fromhex(KAT_SEALED_3)) == DATA


def test_the_oracle_reproduces_the_known_answer_vector() -> None:
    file_key = HKDF(hashes.SHA256(), 32, SALT, b"galahad-v1-frame-key").derive(MASTER.material)
    assert file_key.hex() == KAT_FILE_KEY
    assert _oracle_seal(MASTER, SALT, AAD, 3, DATA).hex() == KAT_SEALED_3


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4096, 65_536 + 5, 1 << 20])
@pytest.mark.parametrize("index", [0, 1, 2**32, 2**64 - 1])
def test_sealing_follows_the_rule_for_every_size_and_index(size: int, index: int) -> None:
    key, salt, aad, data = SecretKey(os.urandom(32)), os.urandom(16), os.urandom(300), os.urandom(size)
    cipher = AesGcmCipher(key)
    sealed = cipher.seal_frame(salt, aad, index, data)
    assert sealed == _oracle_seal(key, salt, aad, index, data)
    assert len(sealed) == size + TAG_BYTES
    assert cipher.open_frame(salt, aad, index, sealed) == data


def test_the_into_variants_give_the_same_bytes_without_allocating_the_result() -> None:
    cipher, salt, data = AesGcmCipher(MASTER), os.urandom(16), os.urandom(100_000)
    out = bytearray(len(data) + TAG_BYTES + 7)
    assert cipher.seal_frame_into(salt, AAD, 9, data, memoryview(out)) == len(data) + TAG_BYTES
    sealed = bytes(out[: len(data) + TAG_BYTES])
    assert sealed == cipher.seal_frame(salt, AAD, 9, data)
    plain = bytearray(len(data))
    assert cipher.open_frame_into(salt, AAD, 9, sealed, memoryview(plain)) == len(data)
    assert plain == data


@pytest.mark.parametrize("openssl", [True, False], ids=["openssl", "pycryptodome"])
@pytest.mark.parametrize("cuts", [[], [0], [1], [15, 16, 17], [4096, 50_000], [99_999]])
def test_a_frame_sealed_from_pieces_is_the_frame_sealed_whole(openssl: bool, cuts: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from galahad.adapters.crypto import aesgcm

    monkeypatch.setattr(aesgcm, "_OPENSSL_INTO", openssl and aesgcm._OPENSSL_INTO)
    key, salt, data = SecretKey(os.urandom(32)), os.urandom(16), os.urandom(100_000)
    bounds = [0, *cuts, len(data)]
    pieces = [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]
    out = bytearray(len(data) + TAG_BYTES)
    assert AesGcmCipher(key).seal_pieces_into(salt, AAD, 7, pieces, memoryview(out)) == len(out)
    assert out == _oracle_seal(key, salt, AAD, 7, data)
    with pytest.raises(ValueError, match="holds"):
        AesGcmCipher(key).seal_pieces_into(salt, AAD, 7, pieces, memoryview(out)[:-1])


@pytest.mark.parametrize("openssl", [True, False], ids=["openssl", "pycryptodome"])
@pytest.mark.parametrize("cuts", [[], [0], [1], [14, 15, 16, 17], [4096, 50_000], [99_999]])
def test_a_frame_sealed_with_its_tag_apart_is_the_oracles_ciphertext_and_tag(
        openssl: bool, cuts: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The aligned layout's way: ciphertext and tag written apart, and nothing written past the
    ciphertext (the next frame's bytes, in the sealing buffer, stay as they were)."""
    from galahad.adapters.crypto import aesgcm

    monkeypatch.setattr(aesgcm, "_OPENSSL_INTO", openssl and aesgcm._OPENSSL_INTO)
    key, salt, data = SecretKey(os.urandom(32)), os.urandom(16), os.urandom(100_000)
    bounds = [0, *cuts, len(data)]
    pieces = [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]
    out, tag = bytearray(b"\xee" * (len(data) + 64)), bytearray(TAG_BYTES)
    cipher = AesGcmCipher(key)
    assert cipher.seal_detached_into(salt, AAD, 7, pieces, memoryview(out), memoryview(tag)) == len(data)
    assert bytes(out[: len(data)]) + bytes(tag) == _oracle_seal(key, salt, AAD, 7, data)
    assert out[len(data) :] == b"\xee" * 64
    plain = bytearray(b"\xee" * (len(data) + 64))
    assert cipher.open_detached_into(salt, AAD, 7, bytes(out[: len(data)]), bytes(tag), memoryview(plain)) == len(data)
    assert plain[: len(data)] == data and plain[len(data) :] == b"\xee" * 64
    tag[0] ^= 1
    with pytest.raises(IntegrityError):
        cipher.open_detached_into(salt, AAD, 7, bytes(out[: len(data)]), bytes(tag), memoryview(plain))
    assert plain[: len(data)] == bytes(len(data))  # nothing unverified stays behind


def test_open_frame_into_zeroes_its_output_when_the_tag_fails() -> None:
    cipher, salt = AesGcmCipher(MASTER), os.urandom(16)
    sealed = bytearray(cipher.seal_frame(salt, AAD, 0, b"secret plaintext" * 100))
    sealed[5] ^= 1
    out = bytearray(b"\xff" * 1600)
    with pytest.raises(IntegrityError):
        cipher.open_frame_into(salt, AAD, 0, bytes(sealed), memoryview(out))
    assert out == bytes(1600)


def test_parallel_opening_reads_what_openssl_sealed_and_refuses_what_it_refuses() -> None:
    sealer, opener = AesGcmCipher(MASTER), AesGcmCipher(MASTER, parallel_open=True)
    salt, data = os.urandom(16), os.urandom(300_001)
    sealed = bytearray(sealer.seal_frame(salt, AAD, 3, data))
    plain = bytearray(len(data))
    assert opener.open_frame_into(salt, AAD, 3, bytes(sealed), memoryview(plain)) == len(data)
    assert plain == data
    sealed[-1] ^= 1
    with pytest.raises(IntegrityError):
        opener.open_frame_into(salt, AAD, 3, bytes(sealed), memoryview(plain))
    assert plain == bytes(len(data))
    assert AesGcmCiphers(Keyring(MASTER), parallel_open=True).for_sealing().parallel_open


def test_buffers_of_wider_items_are_counted_in_bytes() -> None:
    floats = array.array("f", [1.5] * 1000)  # a memoryview of 1000 items, 4000 bytes
    cipher, salt = AesGcmCipher(MASTER), os.urandom(16)
    sealed = cipher.seal_frame(salt, AAD, 1, memoryview(floats))
    assert len(sealed) == 4000 + TAG_BYTES
    assert cipher.open_frame(salt, AAD, 1, sealed) == floats.tobytes()


def test_a_frame_sealed_under_another_key_is_refused_as_an_integrity_error() -> None:
    salt = os.urandom(16)
    sealed = AesGcmCipher(SecretKey(os.urandom(32))).seal_frame(salt, AAD, 0, b"x" * 64)
    with pytest.raises(IntegrityError) as caught:
        AesGcmCipher(MASTER).open_frame(salt, AAD, 0, sealed)
    assert isinstance(caught.value, FormatError)
    assert MASTER.key_id.hex() in str(caught.value)


@pytest.mark.parametrize("sealed", [b"", b"short", bytes(15)])
def test_a_frame_shorter_than_its_tag_is_refused(sealed: bytes) -> None:
    with pytest.raises(IntegrityError):
        AesGcmCipher(MASTER).open_frame(SALT, AAD, 0, sealed)


@pytest.mark.parametrize(("salt", "index"), [(bytes(15), 0), (bytes(17), 0), (SALT, -1), (SALT, 2**64)])
def test_a_malformed_salt_or_index_is_refused_on_both_sides(salt: bytes, index: int) -> None:
    cipher = AesGcmCipher(MASTER)
    with pytest.raises(ValueError):
        cipher.seal_frame(salt, AAD, index, b"data")
    with pytest.raises(IntegrityError):
        cipher.open_frame(salt, AAD, index, bytes(40))


def test_an_open_only_cipher_opens_old_frames_and_refuses_to_seal() -> None:
    sealed = AesGcmCipher(MASTER).seal_frame(SALT, AAD, 2, DATA)
    retired = AesGcmCipher(MASTER, sealing=False)
    assert retired.open_frame(SALT, AAD, 2, sealed) == DATA
    with pytest.raises(KeyRefused, match="retired"):
        retired.seal_frame(SALT, AAD, 3, DATA)
    with pytest.raises(KeyRefused, match="retired"):
        retired.seal_frame_into(SALT, AAD, 3, DATA, memoryview(bytearray(100)))


def test_the_file_key_cache_keeps_only_a_handful_and_stays_correct_after_eviction() -> None:
    cipher = AesGcmCipher(MASTER)
    salts = [os.urandom(16) for _ in range(40)]
    sealed = [cipher.seal_frame(s, AAD, 0, s) for s in salts]
    assert len(cipher._file_keys) <= 8
    assert [cipher.open_frame(s, AAD, 0, f) for s, f in zip(salts, sealed)] == salts


def test_one_cipher_serves_many_threads_and_files_at_once() -> None:
    cipher = AesGcmCipher(MASTER)
    jobs = [(os.urandom(16), i % 5, os.urandom(30_000)) for i in range(64)]

    def round_trip(job: tuple[bytes, int, bytes]) -> bool:
        salt, index, data = job
        sealed = cipher.seal_frame(salt, AAD, index, data)
        return sealed == _oracle_seal(MASTER, salt, AAD, index, data) and cipher.open_frame(
            salt, AAD, index, sealed
        ) == data

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(round_trip, jobs))


def test_the_repr_names_the_key_id_and_never_the_material() -> None:
    text = repr(AesGcmCipher(MASTER)) + repr(AesGcmCipher(MASTER, sealing=False))
    assert MASTER.key_id.hex() in text
    assert MASTER.material.hex() not in text


def test_the_cipher_set_seals_with_the_current_key_and_opens_with_retired_ones() -> None:
    current, retired = SecretKey(os.urandom(32)), SecretKey(os.urandom(32))
    ciphers = AesGcmCiphers(Keyring(current, (retired,)))
    assert ciphers.for_sealing().key_id == current.key_id
    assert ciphers.for_sealing() is ciphers.for_key_id(current.key_id)  # built once, kept
    old = ciphers.for_key_id(retired.key_id)
    assert old is not None and old.key_id == retired.key_id
    sealed = AesGcmCipher(retired).seal_frame(SALT, AAD, 0, DATA)
    assert old.open_frame(SALT, AAD, 0, sealed) == DATA
    with pytest.raises(KeyRefused):
        old.seal_frame(SALT, AAD, 0, DATA)
    assert ciphers.for_key_id(bytes(8)) is None


@pytest.mark.parametrize(("version", "outside"), [("47.0.0", False), ("48.0.0", False), ("49.0.0", False),
                                                  ("50.0.0", True), ("50.0.2", True), ("51.0.0", True),
                                                  ("unknown", False)])
def test_openssl_runs_outside_the_interpreter_lock_from_cryptography_50(version: str, outside: bool) -> None:
    assert aesgcm._openssl_outside_lock(version) is outside


def test_pycryptodome_opens_frames_only_where_openssl_holds_the_lock_and_cores_are_many() -> None:
    from galahad.bootstrap import parallel_open

    assert parallel_open(cores=16, openssl_outside_lock=False)  # cryptography 48 on the H200 machine
    assert not parallel_open(cores=4, openssl_outside_lock=False)  # one OpenSSL at a time still wins
    assert not parallel_open(cores=64, openssl_outside_lock=True)  # OpenSSL side by side: faster per core
    assert parallel_open(cores=16) is not aesgcm.OPENSSL_OUTSIDE_LOCK  # the installed cryptography decides
