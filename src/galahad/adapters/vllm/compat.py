"""What differs between the vLLM releases the connector runs on: 0.32 (CI, CPU) and 0.26 (the H200).

The connector is written against 0.32's API. vLLM 0.26.0 (the release pinned to the GPU machine's
torch 2.11) lacks three things it uses; this module supplies each, and nothing else in the package
needs to know which release is loaded:

- `TransferResults`: 0.32's `KVConnectorTransferResults`; 0.26 reports loads through
  `get_finished()` only (failed loads surface as invalid block ids), so a plain dataclass of the
  same shape stands in.
- `BlockTable`: 0.32 hands the scheduler side `scheduler_output.kv_connector_block_state`
  (`get_block_ids(req_id)`); 0.26 does not, so the table is rebuilt from the scheduler output's
  `scheduled_new_reqs` / `scheduled_cached_reqs`, exactly as vLLM's workers rebuild it.
- `kv_layout_of`: 0.32's `CacheConfig.kv_cache_layout`; 0.26 resolves the layout through
  `get_kv_cache_layout()` of its attention backends instead.

The connector module applies them itself when it is imported (`install_names()` before its vLLM
imports, `route_block_state()` after its class), so every process that loads it (vLLM's plugin,
`kv_connector_module_path`, a tensor-parallel worker started by spawn) gets them. `install()` does
both at once, for a process that wants them before it starts the engine; each is a no-op on 0.32.
Importing this module does no work and imports no vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BlockTable", "TransferResults", "block_state_of", "install", "install_names", "kv_layout_of",
           "num_heads", "route_block_state", "vllm_version"]

log = logging.getLogger(__name__)


def vllm_version() -> tuple[int, int]:
    """(major, minor) of the loaded vLLM; (0, 0) when it cannot be read."""
    try:
        import vllm

        major, minor = str(vllm.__version__).split(".")[:2]
        return int(major), int(minor)
    except Exception:  # noqa: BLE001 - an unreadable version: assume the oldest behaviour
        return 0, 0


@dataclass
class _TransferResults:
    """Shape of vLLM 0.32's `KVConnectorTransferResults` (0.26 has none)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def _transfer_results_class() -> type:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        return KVConnectorTransferResults  # type: ignore[no-any-return]
    except ImportError:
        return _TransferResults


def __getattr__(name: str) -> Any:  # `TransferResults` resolves lazily: importing does no work
    if name == "TransferResults":
        return _transfer_results_class()
    raise AttributeError(name)


@dataclass
class _BlockState:
    """The part of 0.32's `KVConnectorBlockState` the connector reads."""

    req_ids: set[str]
    resolve_block_ids: Callable[[str], tuple[list[int], ...]]

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        if req_id not in self.req_ids:
            return None
        return self.resolve_block_ids(req_id)


class BlockTable:
    """Each running request's block ids per KV cache group, kept from the scheduler outputs (0.26).

    Follows the same rules as vLLM's workers: a new request brings its whole table; a cached one
    appends `new_block_ids`, or replaces its table when it was resumed after a preemption; a
    finished or preempted request is forgotten.
    """

    def __init__(self) -> None:
        self._ids: dict[str, tuple[list[int], ...]] = {}

    def update(self, scheduler_output: Any) -> _BlockState:
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            self._ids.pop(req_id, None)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._ids.pop(req_id, None)
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            self._ids[new.req_id] = tuple(list(ids) for ids in new.block_ids)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", None) or set()
            for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
                if new_ids is None:
                    continue
                old = self._ids.get(req_id)
                if req_id in resumed or old is None:
                    self._ids[req_id] = tuple(list(ids) for ids in new_ids)
                else:
                    for group, ids in zip(old, new_ids):
                        group.extend(ids)
        scheduled = set(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        return _BlockState(scheduled & set(self._ids), lambda req_id: self._ids[req_id])

    def __len__(self) -> int:
        return len(self._ids)


def block_state_of(scheduler_output: Any, table: BlockTable) -> Any:
    """The step's block state: vLLM's own (0.32, possibly None), else `table`'s (0.26, kept current)."""
    if hasattr(scheduler_output, "kv_connector_block_state"):  # 0.32, or set by `install()`
        return scheduler_output.kv_connector_block_state
    return table.update(scheduler_output)


def kv_layout_of(cache_config: Any, kv_cache_config: Any = None) -> str:
    """The KV cache memory layout name ("NHD", "HND", ...), however this vLLM records it."""
    for owner in (kv_cache_config, cache_config):
        layout = getattr(owner, "kv_cache_layout", None) if owner is not None else None
        if layout:
            return str(layout)
    try:  # vLLM 0.26: resolved by the attention backends
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return str(get_kv_cache_layout() or "")
    except Exception:  # noqa: BLE001 - unknown: the namespace is only stricter
        return ""


def num_heads(spec: Any) -> int:
    """KV heads of an attention spec (0.32 `num_heads`, 0.26 `num_kv_heads`)."""
    slots = getattr(spec, "num_head_slots", None)
    return int(slots if slots is not None else spec.num_kv_heads)


def install() -> bool:
    """Fill in, on a loaded vLLM 0.26, what the 0.32-based connector expects; True if it did.

    `install_names()`, then (importing the connector) `route_block_state()`. Idempotent; a no-op
    on a vLLM that has them.
    """
    changed = install_names()
    from galahad.adapters.vllm.connector import GalahadConnector

    changed |= route_block_state(GalahadConnector)
    return changed


def install_names() -> bool:
    """Add `KVConnectorTransferResults` to vLLM's connector base module, a `kv_cache_layout`
    default to `CacheConfig` and `num_heads` to attention specs, where they are missing (0.26);
    True if it did. Imports vLLM, never the connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    changed = False
    if not hasattr(base, "KVConnectorTransferResults"):
        base.KVConnectorTransferResults = _TransferResults  # type: ignore[attr-defined]
        changed = True
    from vllm.config import CacheConfig

    if not hasattr(CacheConfig, "kv_cache_layout"):
        CacheConfig.kv_cache_layout = None  # type: ignore[attr-defined]
        changed = True
    from vllm.v1.kv_cache_interface import AttentionSpec

    if not hasattr(AttentionSpec, "num_heads"):  # 0.26: `num_kv_heads` only
        AttentionSpec.num_heads = property(num_heads)  # type: ignore[attr-defined]
        changed = True
    if changed:
        log.info("[galahad] vLLM %s: compatibility shims installed", ".".join(map(str, vllm_version())))
    return changed


def route_block_state(connector: Any) -> bool:
    """Give 0.26 scheduler outputs a `kv_connector_block_state` before `connector`'s
    `build_connector_meta` reads it (the class `GalahadConnector`); True if it did."""
    from vllm.v1.core.sched.output import SchedulerOutput

    if "kv_connector_block_state" in getattr(SchedulerOutput, "__dataclass_fields__", {}):
        return False
    original = connector.build_connector_meta
    if getattr(original, "_galahad_block_state", False):
        return False
    connector.build_connector_meta = with_block_state(original)
    return True


def with_block_state(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`build_connector_meta` that first gives the scheduler output the block table it lacks
    (0.26) and takes it off again afterwards."""

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        table = self.__dict__.setdefault("_galahad_block_table", BlockTable())
        try:
            scheduler_output.kv_connector_block_state = table.update(scheduler_output)
        except Exception:  # noqa: BLE001 - host boundary: no saves this step, serving goes on
            log.warning("[galahad] cannot follow the block table", exc_info=True)
        try:
            return original(self, scheduler_output)
        finally:
            # Taken off again: with tensor parallel workers in other processes vLLM pickles the
            # scheduler output, and the table's view does not pickle (seen on the H200, TP=2)
            getattr(scheduler_output, "__dict__", {}).pop("kv_connector_block_state", None)

    build_connector_meta._galahad_block_state = True  # type: ignore[attr-defined]
    return build_connector_meta
