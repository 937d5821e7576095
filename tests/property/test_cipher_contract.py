"""The `Cipher` port's contract, checked against every cipher (ports/cipher.py states it).

- `open_frame(salt, aad, i, seal_frame(salt, aad, i, data)) == data`;
- a sealed frame is `len(data) + 16` bytes;
- any change to the sealed bytes, the aad, the index or the salt makes `open_frame` raise an
  `IntegrityError` (a `FormatError`), never return other bytes;
- arbitrary bytes given to `open_frame` end in an `IntegrityError` or the data, nothing else.

`FACTORIES` lists the ciphers under test; a cipher joins by adding its factory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from galahad.adapters.crypto.aesgcm import AesGcmCipher
from galahad.domain.error import FormatError, IntegrityError
from galahad.domain.secret import SecretKey
from galahad.ports.cipher import Cipher

TAG_BYTES = 16


def _factories() -> dict[str, Callable[[], Cipher]]:
    factories: dict[str, Callable[[], Cipher]] = {
        "aes-gcm": lambda: AesGcmCipher(SecretKey(bytes(range(32)))),
    }
    try:
        from galahad.format.checksum import Xxh3FrameCheck
    except ImportError:  # the checksum cipher lives in `format`; absent in a partial tree
        pass
    else:
        factories["xxh3"] = Xxh3FrameCheck
    return factories


FACTORIES = _factories()
ciphers = pytest.mark.parametrize("make", list(FACTORIES.values()), ids=list(FACTORIES))

salts = st.binary(min_size=16, max_size=16)
aads = st.binary(max_size=512)
indexes = st.integers(min_value=0, max_value=2**64 - 1)
payloads = st.binary(max_size=4096)


@ciphers
@given(salt=salts, aad=aads, index=indexes, data=payloads)
@example(salt=bytes(16), aad=b"", index=0, data=b"")
def test_open_returns_what_seal_was_given(make: Callable[[], Cipher], salt: bytes, aad: bytes, index: int,
                                          data: bytes) -> None:
    cipher = make()
    sealed = cipher.seal_frame(salt, aad, index, data)
    assert len(sealed) == len(data) + TAG_BYTES
    assert cipher.open_frame(salt, aad, index, sealed) == data
    assert cipher.open_frame(salt, aad, index, memoryview(sealed)) == data
    assert isinstance(cipher.cipher_id, int) and len(cipher.key_id) == 8


@ciphers
@given(salt=salts, aad=aads, index=indexes, data=payloads, where=st.integers(min_value=0), bit=st.integers(0, 7))
def test_every_single_bit_flip_of_a_sealed_frame_is_refused(make: Callable[[], Cipher], salt: bytes, aad: bytes,
                                                            index: int, data: bytes, where: int, bit: int) -> None:
    cipher = make()
    sealed = bytearray(cipher.seal_frame(salt, aad, index, data))
    sealed[where % len(sealed)] ^= 1 << bit
    with pytest.raises(IntegrityError):
        cipher.open_frame(salt, aad, index, bytes(sealed))


@ciphers
@given(salt=salts, aad=aads, index=indexes, data=payloads, cut=st.integers(min_value=1), extra=st.binary(max_size=32))
def test_a_truncated_or_extended_frame_is_refused(make: Callable[[], Cipher], salt: bytes, aad: bytes, index: int,
                                                  data: bytes, cut: int, extra: bytes) -> None:
    cipher = make()
    sealed = cipher.seal_frame(salt, aad, index, data)
    with pytest.raises(IntegrityError):
        cipher.open_frame(salt, aad, index, sealed[: len(sealed) - 1 - (cut - 1) % len(sealed)])
    if extra:
        with pytest.raises(IntegrityError):
            cipher.open_frame(salt, aad, index, sealed + extra)


@ciphers
@given(salt=salts, other_salt=salts, aad=aads, other_aad=aads, index=indexes, other_index=indexes, data=payloads)
@example(salt=bytes(16), other_salt=bytes(16), aad=b"header", other_aad=b"header\x00", index=0, other_index=0,
         data=b"x")
def test_another_salt_aad_or_index_is_refused(make: Callable[[], Cipher], salt: bytes, other_salt: bytes, aad: bytes,
                                              other_aad: bytes, index: int, other_index: int, data: bytes) -> None:
    cipher = make()
    sealed = cipher.seal_frame(salt, aad, index, data)
    if other_salt != salt:
        with pytest.raises(IntegrityError):
            cipher.open_frame(other_salt, aad, index, sealed)
    if other_aad != aad:
        with pytest.raises(IntegrityError):
            cipher.open_frame(salt, other_aad, index, sealed)
    if other_index != index:
        with pytest.raises(IntegrityError):
            cipher.open_frame(salt, aad, other_index, sealed)


@ciphers
@given(salt=st.binary(max_size=40), aad=aads, index=indexes,
       sealed=st.binary(max_size=600))
def test_arbitrary_bytes_are_refused_only_with_an_integrity_error(make: Callable[[], Cipher], salt: bytes, aad: bytes,
                                                                  index: int, sealed: bytes) -> None:
    try:
        make().open_frame(salt, aad, index, sealed)
    except FormatError as exc:
        assert isinstance(exc, IntegrityError)


@given(salt=salts, aad=aads, index=indexes, data=payloads, other=st.binary(min_size=32, max_size=32))
def test_a_frame_sealed_under_another_key_is_refused(salt: bytes, aad: bytes, index: int, data: bytes,
                                                     other: bytes) -> None:
    key = SecretKey(bytes(range(32)))
    if other == key.material:
        return
    sealed = AesGcmCipher(SecretKey(other)).seal_frame(salt, aad, index, data)
    with pytest.raises(IntegrityError):
        AesGcmCipher(key).open_frame(salt, aad, index, sealed)
