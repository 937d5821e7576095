"""Chain keys: a chained SHA-256 over token ids, seeded by the namespace and what changes the KV.

The key of the prefix `tokens[:n * step]` is

    k_0 = SHA-256("galahad-chain-v1" || namespace digest || H(salt) || H(lora) || H(mm hashes))
    (each of salt, LoRA and the length-prefixed list of media hashes marked present or absent)
    k_i = SHA-256(k_{i-1} || tokens[(i-1)*step : i*step] as little-endian uint32)

so it is stable across processes and machines (no environment, no per-process seed), and two
requests share a key only if they share the namespace, the salt, the adapter, the multimodal
content and every token of the prefix.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

import attrs

__all__ = ["ChainKey", "ChainSeed", "chain_keys"]

_KEY_BYTES = 32


@attrs.frozen(order=True)
class ChainKey:
    """A 32-byte key naming one prefix (or chunk of a prefix) of one namespace."""

    raw: bytes = attrs.field()

    @raw.validator
    def _check(self, _attr: object, value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != _KEY_BYTES:
            raise ValueError("a chain key is exactly 32 bytes")

    @property
    def hex(self) -> str:
        return self.raw.hex()

    @classmethod
    def from_hex(cls, text: str) -> ChainKey:
        return cls(bytes.fromhex(text))

    def __str__(self) -> str:
        return self.raw.hex()


def _text(value: str) -> bytes:
    # surrogatepass: a lone surrogate (JSON allows "\ud800") is encoded, never an error
    return value.encode("utf-8", "surrogatepass")


def _field(tag: bytes, value: bytes | None) -> bytes:
    if value is None:
        return tag + b"\x00"
    return tag + b"\x01" + hashlib.sha256(value).digest()


def _list(values: tuple[str, ...]) -> bytes | None:
    if not values:
        return None
    return b"".join(len(v).to_bytes(8, "little") + v for v in map(_text, values))


@attrs.frozen
class ChainSeed:
    """Everything besides the tokens that changes a request's KV: namespace, salt, LoRA, media."""

    namespace_digest: bytes
    cache_salt: str | None = None
    lora: str | None = None
    mm_hashes: tuple[str, ...] = ()

    def digest(self) -> bytes:
        h = hashlib.sha256(b"galahad-chain-v1\x00")
        h.update(self.namespace_digest)
        h.update(_field(b"salt", None if self.cache_salt is None else _text(self.cache_salt)))
        h.update(_field(b"lora", None if self.lora is None else _text(self.lora)))
        h.update(_field(b"mm", _list(self.mm_hashes)))
        return h.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array.array("I", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def chain_keys(seed: ChainSeed, tokens: Sequence[int], step: int) -> list[ChainKey]:
    """Keys of every full `step`-token prefix of `tokens`: key i covers `tokens[: (i + 1) * step]`."""
    if step <= 0:
        raise ValueError("step must be positive")
    data = _token_bytes(tokens)
    width = step * 4
    prev = seed.digest()
    keys: list[ChainKey] = []
    for i in range(len(tokens) // step):
        prev = hashlib.sha256(prev + data[i * width : (i + 1) * width]).digest()
        keys.append(ChainKey(prev))
    return keys
