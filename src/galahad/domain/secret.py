"""Encryption keys as values: 32 bytes of material and the 8-byte id written in block headers."""

from __future__ import annotations

import hashlib

import attrs

__all__ = ["KEY_BYTES", "SecretKey"]

KEY_BYTES = 32


@attrs.frozen(repr=False)
class SecretKey:
    """An AES-256 key. Its id is derived from the material, so it identifies the key but reveals nothing."""

    material: bytes = attrs.field()

    @material.validator
    def _check(self, _attr: object, value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != KEY_BYTES:
            raise ValueError(f"an encryption key is exactly {KEY_BYTES} bytes")

    # derived once: every header a reader looks at is matched against it
    key_id: bytes = attrs.field(init=False, eq=False)

    @key_id.default
    def _derive_id(self) -> bytes:
        return hashlib.sha256(b"galahad-key-id-v1\x00" + self.material).digest()[:8]

    def __repr__(self) -> str:
        return f"SecretKey(id={self.key_id.hex()})"
