"""Who this backend instance is: its options, its namespace, its rank.

SGLang tells a storage backend little (research/sglang_hicache_api.md §1.1): the served model
name, TP/PP/CP ranks and sizes, whether the KV is replicated across TP ranks (MLA), and the
extra config. The rest (dtype, page size, layout, head and layer geometry) comes from the host
pool it registers later. All of it goes into the namespace, so entries written under another
model, dtype, page size, layout or parallel plan are never found.

Ranks: an entry has one part per (pipeline stage, context-parallel rank, TP rank), or per
(stage, CP rank) when the KV is replicated (MLA: TP rank 0 writes, every TP rank reads). We fold
CP into the pipeline axis of `RankLayout` (both split the data; TP alone may replicate it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from galahad.domain.error import ConfigError
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout

__all__ = ["BackendOptions", "Identity", "model_fingerprint"]

DEFAULT_TIMEOUT_S = 5.0
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_CONFIG_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
                 "quantization_config.json", "hf_quant_config.json")


@attrs.frozen
class BackendOptions:
    """Our keys of `--hicache-storage-backend-extra-config` (SGLang's own keys are left alone).

    - `model_fingerprint`: any string naming the exact weights (e.g. a revision hash). Without
      it, the fingerprint is computed from the model folder (config and weight files), or, when
      the model is not a local folder, from its name only (a warning says so).
    - `model_path`: the model folder to fingerprint when the served name is not a path.
    - `galahad_timeout_s`: the longest one SGLang call may wait on the store (default 5 s).
    - `galahad_io_lanes`: pages of one call read or written in parallel (default: half the CPUs,
      1 to 8).
    """

    model_fingerprint: str | None = None
    model_path: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    io_lanes: int = attrs.field(factory=lambda: max(1, min(8, (os.cpu_count() or 2) // 2)))

    KEYS = ("model_fingerprint", "model_path", "galahad_timeout_s", "galahad_io_lanes")

    @classmethod
    def misspelt(cls, extra: Mapping[str, Any] | None) -> list[str]:
        """Keys that look like ours (`galahad_...`) but are not: left alone like SGLang's own
        keys, but worth a word, since the setting meant is then at its default."""
        return sorted(k for k in (extra or {}) if isinstance(k, str) and k.lower().startswith("galahad")
                      and k not in cls.KEYS)

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> BackendOptions:
        extra = extra or {}
        fp = extra.get("model_fingerprint")
        path = extra.get("model_path")
        raw = extra.get("galahad_timeout_s", DEFAULT_TIMEOUT_S)
        for name, value in (("model_fingerprint", fp), ("model_path", path)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"extra config {name}={value!r} is not accepted; use a non-empty string")
        try:
            timeout = -1.0 if isinstance(raw, bool) else float(raw)  # true is not a second
        except (TypeError, ValueError):
            timeout = -1.0
        if not 0.0 < timeout <= 600.0:
            raise ConfigError(
                f"extra config galahad_timeout_s={raw!r} is not accepted; use seconds in (0, 600]"
            )
        lanes_raw = extra.get("galahad_io_lanes")
        if lanes_raw is None:
            return cls(fp.strip() if fp else None, path.strip() if path else None, timeout)
        if isinstance(lanes_raw, bool) or not isinstance(lanes_raw, (int, str)) or not str(lanes_raw).isdigit() \
                or not 1 <= int(lanes_raw) <= 64:
            raise ConfigError(f"extra config galahad_io_lanes={lanes_raw!r} is not accepted; use a whole number 1..64")
        return cls(fp.strip() if fp else None, path.strip() if path else None, timeout, int(lanes_raw))


def model_fingerprint(name: str | None, options: BackendOptions) -> tuple[str, bool]:
    """(fingerprint, from_files): the option, else a hash of the model folder, else the name."""
    if options.model_fingerprint:
        return "given:" + options.model_fingerprint, True
    if options.model_path and not os.path.isdir(options.model_path):
        # asked for by name: falling back to the served name would share entries between
        # checkpoints served under it, the very thing `model_path` is set to prevent
        raise ConfigError(
            f"extra config model_path={options.model_path!r} is not a folder; give the local folder "
            "of the model's weights (the one holding config.json), or set model_fingerprint"
        )
    for candidate in (options.model_path, name):
        if candidate and os.path.isdir(candidate):
            try:
                return "files:" + _folder_digest(Path(candidate)), True
            except OSError as exc:
                raise ConfigError(
                    f"cannot read the model folder {candidate} to fingerprint it: {exc.strerror or exc}; "
                    "let this server read it, or set model_fingerprint in the extra config"
                ) from exc
    return "name:" + (name or ""), False


def _folder_digest(folder: Path) -> str:
    """SHA-256 over the config files' bytes and the weight files' names and sizes."""
    h = hashlib.sha256(b"galahad-model-folder-v1\x00")
    for fname in _CONFIG_FILES:
        path = folder / fname
        if path.is_file():
            h.update(fname.encode() + b"\x00" + path.read_bytes() + b"\x00")
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
            h.update(f"{path.name}\x00{path.stat().st_size}\x00".encode())
    return h.hexdigest()


@attrs.frozen
class Identity:
    """This instance's namespace, rank layout and rank, built from SGLang's config and KV pool."""

    namespace: Namespace
    digest: bytes  # the namespace digest, computed once (every page key hashes it)
    layout: RankLayout
    rank: int
    tp_rank: int
    replicated: bool
    fingerprint_from_files: bool

    @classmethod
    def build(cls, config: Any, pool: Any, kv_spec: str, options: BackendOptions) -> Identity:
        tp_rank, tp_size = int(config.tp_rank), int(config.tp_size)
        pp_rank, pp_size = int(config.pp_rank), int(config.pp_size)
        cp_rank = int(getattr(config, "attn_cp_rank", 0) or 0)
        cp_size = int(getattr(config, "attn_cp_size", 1) or 1)
        replicated = bool(config.is_mla_model)
        layout = RankLayout(tp_size=tp_size, pp_size=pp_size * cp_size, replicated=replicated)
        rank = layout.rank_of(tp_rank, pp_rank * cp_size + cp_rank)
        fingerprint, from_files = model_fingerprint(config.model_name, options)
        dtype = str(pool.dtype).removeprefix("torch.")
        page_size = int(pool.page_size)
        extra = (
            ("sglang_replicated_kv", "1" if replicated else "0"),
            ("sglang_cp_size", str(cp_size)),
            ("sglang_pp_size", str(pp_size)),
            ("sglang_host_layout", str(getattr(pool, "layout", ""))),
        )
        namespace = Namespace(
            model=str(config.model_name or ""),
            model_fingerprint=fingerprint,
            dtype=dtype,
            kv_cache_dtype=dtype,
            block_size=page_size,
            # the layer count differs per pipeline stage: each part's header carries its own
            groups=(KVGroup(GroupKind.FULL, page_size, 0, spec=kv_spec),),
            tp_size=tp_size,
            pp_size=pp_size * cp_size,
            kv_layout=f"sglang/{type(pool).__name__}/{getattr(pool, 'layout', '')}",
            payload_order=PayloadOrder.LAYER,
            engine="sglang",
            extra=extra,
        )
        return cls(namespace, namespace.digest(), layout, rank, tp_rank, replicated, from_files)

    @property
    def writes_kv(self) -> bool:
        """Whether this rank writes KV pages (every rank, or TP rank 0 when the KV is replicated)."""
        return self.layout.writes(self.rank)

    @property
    def stage_rank(self) -> int:
        """The rank whose part this rank reads and writes (itself, or its stage's TP rank 0)."""
        return self.layout.part_of(self.rank)

    def describe(self) -> str:
        return json.dumps({"rank": self.rank, "world": self.layout.world_size,
                           "replicated_kv": self.replicated}, sort_keys=True)
