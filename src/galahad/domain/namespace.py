"""The namespace: everything that must match for stored KV to be valid, and its stable digest."""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any

import attrs

from galahad.domain.error import ConfigError

__all__ = ["FORMAT_MAJOR", "GroupKind", "KVGroup", "Namespace", "PayloadOrder"]

FORMAT_MAJOR = 1


class PayloadOrder(enum.Enum):
    """How a prompt is cut into entries. `layer`: one entry per saved prefix; `chunk`: every 64 tokens."""

    LAYER = "layer"
    CHUNK = "chunk"

    @classmethod
    def parse(cls, value: str, *, setting: str = "GALAHAD_PAYLOAD_ORDER") -> PayloadOrder:
        try:
            return cls(value.strip().lower())
        except ValueError:
            accepted = ", ".join(m.value for m in cls)
            raise ConfigError(f"{setting}={value!r} is not accepted; use one of: {accepted}") from None


class GroupKind(enum.Enum):
    """What a KV cache group keeps per token: full attention, a sliding window, or a running state."""

    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


@attrs.frozen
class KVGroup:
    """One KV cache group of the engine: its kind, block size, layer count and (sliding) window."""

    kind: GroupKind
    block_size: int
    num_layers: int
    window_tokens: int = 0
    spec: str = ""  # the engine's own description (shapes, dtypes, head counts); part of the digest

    def __attrs_post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"KV group block size must be positive, got {self.block_size}")
        if self.kind is GroupKind.SLIDING and self.window_tokens <= 0:
            raise ConfigError("a sliding-window group needs a positive window")

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "window_tokens": self.window_tokens,
            "spec": self.spec,
        }


def _tuple_of_groups(value: Any) -> tuple[KVGroup, ...]:
    return tuple(value)


@attrs.frozen
class Namespace:
    """Identity of a store's contents. Two processes share entries only if their namespaces are equal.

    Covers the model (name and a fingerprint of its config and weights index), dtype and KV cache
    dtype, block size, the KV cache group plan, the tensor/pipeline layout, the engine's KV layout,
    the payload order and the format major version.
    """

    model: str
    model_fingerprint: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    groups: tuple[KVGroup, ...] = attrs.field(converter=_tuple_of_groups)
    tp_size: int = 1
    pp_size: int = 1
    kv_layout: str = ""
    payload_order: PayloadOrder = PayloadOrder.LAYER
    engine: str = "vllm"
    format_major: int = FORMAT_MAJOR
    extra: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "block_size": self.block_size,
            "groups": [g.as_dict() for g in self.groups],
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "kv_layout": self.kv_layout,
            "payload_order": self.payload_order.value,
            "engine": self.engine,
            "format_major": self.format_major,
            "extra": [list(pair) for pair in sorted(self.extra)],
        }

    def canonical_json(self) -> bytes:
        """The namespace as canonical JSON (sorted keys, no spaces): what the digest covers."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """A stable 32-byte SHA-256 digest; equal namespaces give equal digests on every machine."""
        return hashlib.sha256(b"galahad-namespace-v1\x00" + self.canonical_json()).digest()

    @property
    def hex(self) -> str:
        return self.digest().hex()

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size
