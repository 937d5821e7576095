"""What besides the tokens changes a request's KV: cache salt, LoRA adapter, multimodal inputs."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any

from galahad.domain.chain import ChainSeed
from galahad.app.service import KVCacheService

__all__ = ["bypass_reason", "seed_of"]


_HASH_CHUNK = 8 << 20
_KEPT = 64  # adapters whose fingerprint is kept (by folder), newest last
_fingerprints: OrderedDict[str, tuple[tuple[Any, ...], str]] = OrderedDict()
_lock = threading.Lock()


def _local(path: str) -> str | None:
    """Where the adapter's files are on this machine: `path` itself, or for a model hub name the
    snapshot vLLM downloaded (read from the hub's local cache, never fetched); None if neither."""
    if os.path.exists(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id=path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub name, or not downloaded here: not identifiable
        return None


def _adapter_files(path: str) -> list[tuple[str, str]] | None:
    """(name relative to the adapter's folder, full path) of every regular file of an adapter,
    sorted: every file under its folder, subfolders too (links to folders not followed), or the file itself;
    None when it is not on this machine."""
    local = _local(path)
    if local is None:
        return None
    path = local
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    if not os.path.isdir(path):
        return None
    found = []
    for folder, subfolders, names in os.walk(path):
        subfolders.sort()
        for name in names:
            full = os.path.join(folder, name)
            if os.path.isfile(full):  # a link to a file counts by its content (the hub's snapshots)
                found.append((os.path.relpath(full, path), full))
    return sorted(found)


def _adapter_fingerprint(path: str) -> str | None:
    """A hash of every file of the adapter at `path`: names, sizes and whole contents, so an adapter
    retrained in place is another adapter. Taken again when any file's size, times or inode
    changed; None for an adapter not on this machine (it cannot be told apart from another of the
    same name). Hashing reads the files once per change (about 1 GB/s on one core)."""
    files = _adapter_files(path)
    if files is None:
        return None
    stats = []
    for name, full in files:
        st = os.stat(full)
        stats.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    signature = tuple(stats)
    with _lock:
        kept = _fingerprints.get(path)
        if kept is not None and kept[0] == signature:
            _fingerprints.move_to_end(path)
            return kept[1]
    h = hashlib.sha256(b"galahad-lora-v2\x00")
    for (name, full), (_n, size, *_rest) in zip(files, stats):
        h.update(f"{name}\x00{size}\x00".encode())
        content = hashlib.sha256()
        with open(full, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                content.update(chunk)
        h.update(content.digest())
    fingerprint = h.hexdigest()
    with _lock:
        _fingerprints[path] = (signature, fingerprint)
        _fingerprints.move_to_end(path)
        while len(_fingerprints) > _KEPT:
            _fingerprints.popitem(last=False)
    return fingerprint


def _lora_identity(lora: Any) -> str | None:
    """The adapter's name and the fingerprint of its files; None for no adapter, or one whose files
    are not in a folder on this machine (such a request is neither looked up nor saved)."""
    if lora is None:
        return None
    path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", "") or "")
    fingerprint = _adapter_fingerprint(path) if path else None
    return None if fingerprint is None else f"{lora.lora_name}\x00{fingerprint}"


def seed_of(service: KVCacheService, request: Any) -> ChainSeed:
    """The chain seed of a request that `bypass_reason` let through (a LoRA request's adapter is
    identified by its files: one it could not identify was bypassed)."""
    lora_request = getattr(request, "lora_request", None)
    lora = _lora_identity(lora_request)
    if lora_request is not None and lora is None:
        raise ValueError("a LoRA adapter whose files are not on this machine has no identity")
    mm = tuple(
        f"{f.identifier}@{getattr(f.mm_position, 'offset', '')}"
        for f in (getattr(request, "mm_features", None) or ())
    )
    return service.seed(
        cache_salt=getattr(request, "cache_salt", None),
        lora=lora,
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
    lora = getattr(request, "lora_request", None)
    if lora is not None and _lora_identity(lora) is None:
        return "a LoRA adapter whose files are not on this machine"
    return ""
