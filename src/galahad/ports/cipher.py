"""Frame sealing (encryption or checksum) and where keys come from."""

from __future__ import annotations

from typing import Protocol

from galahad.domain.secret import SecretKey

__all__ = ["Cipher", "KeyProvider"]


class Cipher(Protocol):
    """Seals and opens the frames of one block file.

    Contract (tests/property/test_cipher_contract.py):
    - `open_frame(salt, aad, i, seal_frame(salt, aad, i, data))` returns `data`;
    - any change to the sealed bytes, the aad, the index or the salt makes `open_frame` raise
      `FormatError` (an `IntegrityError`); it never returns other bytes;
    - a sealed frame is `len(data) + TAG_BYTES` long (16);
    - `cipher_id` and `key_id` are written in the header; a reader picks the cipher by them.
    """

    cipher_id: int
    key_id: bytes

    def seal_frame(self, salt: bytes, aad: bytes, index: int, data: bytes | memoryview) -> bytes: ...

    def open_frame(self, salt: bytes, aad: bytes, index: int, sealed: bytes | memoryview) -> bytes: ...


class KeyProvider(Protocol):
    """The current key (used to write) and retired keys (used to read only).

    `current()` raises `KeyRefused` with a message naming the source and the fix when the key
    cannot be had; `by_id` returns None for a key it does not hold (a miss, never an error).
    """

    def current(self) -> SecretKey: ...

    def by_id(self, key_id: bytes) -> SecretKey | None: ...
