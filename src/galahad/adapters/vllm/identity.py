"""What besides the tokens changes a request's KV: cache salt, LoRA adapter, multimodal inputs."""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from typing import Any

from galahad.domain.chain import ChainSeed
from galahad.service import KVCacheService

__all__ = ["bypass_reason", "seed_of"]


@lru_cache(maxsize=256)
def _adapter_fingerprint(path: str) -> str:
    """Hash of an adapter folder's config and weight files (name, size, and content of configs)."""
    h = hashlib.sha256(b"galahad-lora-v1\x00")
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                continue
            h.update(f"{name}\x00{os.path.getsize(full)}\x00".encode())
            if name.endswith((".json", ".safetensors", ".bin")) and os.path.getsize(full) < 1 << 30:
                with open(full, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    else:
        h.update(path.encode())
    return h.hexdigest()


def _lora_identity(lora: Any) -> str | None:
    if lora is None:
        return None
    path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
    return f"{lora.lora_name}\x00{_adapter_fingerprint(path) if path else lora.lora_int_id}"


def seed_of(service: KVCacheService, request: Any) -> ChainSeed:
    mm = tuple(
        f"{f.identifier}@{getattr(f.mm_position, 'offset', '')}"
        for f in (getattr(request, "mm_features", None) or ())
    )
    return service.seed(
        cache_salt=getattr(request, "cache_salt", None),
        lora=_lora_identity(getattr(request, "lora_request", None)),
        mm_hashes=mm,
    )


def bypass_reason(request: Any) -> str:
    """Why a request is neither looked up nor saved ("" when it may be)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if not getattr(request, "prompt_token_ids", None):
        return "no prompt token ids"
    if getattr(request, "pooling_params", None) is not None:
        return "a pooling request"
    return ""
