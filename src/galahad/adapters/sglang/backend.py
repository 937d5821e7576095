"""`GalahadHiCacheStorage`: Galahad's store under SGLang's hierarchical cache (its L3 tier).

SGLang 0.5.23 builds it through its `dynamic` storage backend as `cls(storage_config, {})`,
then hands it the KV host pool (`register_mem_pool_host`) and, for hybrid models, every pool of
the host pool group (`register_mem_host_pool_v2`). We open the cache (licence, key, store,
namespace) when the KV pool arrives: the namespace needs its dtype, page size and layout.

Three generations of calls are served (research/sglang_hicache_api.md §1.2): the copy interface
(`get`/`set`/`batch_get`/`batch_set`, flat page tensors), the zero-copy interface
(`batch_get_v1`/`batch_set_v1`, pages read and written in place in the host pool; chosen by
`"interface_v1": 1` in the extra config) and the multi-pool interface for hybrid models
(`batch_exists_v2`/`batch_get_v2`/`batch_set_v2`). All of them read and write the same entries.

Fail open: no method raises. A disabled backend (no licence, or one refused while serving; no
store; a bad setting), a store error or a call past its time bound answers "not found" (or "not
written"), counts it, logs the first of each kind, and SGLang keeps serving. Nothing is ever
reported found that was not read completely and verified.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from galahad import bootstrap, config
from galahad.domain.chain import ChainKey
from galahad.domain.error import GalahadError
from galahad.domain.namespace import PayloadOrder
from galahad.adapters.sglang.identity import BackendOptions, Identity
from galahad.adapters.sglang.key import page_key
from galahad.adapters.sglang.page import PageGeometry
from galahad.adapters.sglang.stats import BackendCounters, TransferLog
from galahad.adapters.sglang.transfer import PageTransfer

if TYPE_CHECKING:
    from galahad.adapters.licence import LicenceWatch

__all__ = ["GalahadHiCacheStorage"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_KV = PoolName.KV.value
_TP_SHARDED_SIDECARS = {PoolName.MAMBA.value}  # sharded per TP rank even when the KV is replicated
_CLOSE_TIMEOUT_S = 30.0


def _fail_open(fallback: Callable[..., Any]) -> Callable[[_F], _F]:
    """Catch everything at SGLang's boundary: count, log the first, answer `fallback(*args)`."""

    def decorate(method: _F) -> _F:
        @functools.wraps(method)
        def guarded(self: GalahadHiCacheStorage, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._counters.calls += 1
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the host boundary: SGLang never sees ours
                self._caught(method.__name__, exc)
                try:
                    return fallback(*args, **kwargs)
                except Exception:  # noqa: BLE001 - malformed arguments: the emptiest answer
                    return None

        return guarded  # type: ignore[return-value]

    return decorate


def _pool_name(name: Any) -> str:
    return str(getattr(name, "value", name))


def _none_list(keys: Sequence[str], *_: Any, **__: Any) -> list[None]:
    return [None] * len(keys)


def _false_list(keys: Sequence[str], *_: Any, **__: Any) -> list[bool]:
    return [False] * len(keys)


def _per_pool_false(transfers: Sequence[PoolTransfer], *_: Any, **__: Any) -> dict[str, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers}


class GalahadHiCacheStorage(HiCacheStorage):
    """A `HiCacheStorage` on Galahad's encrypted, verified, crash-consistent store."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.mem_pool_host = None
        self.registered_pools: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._counters = BackendCounters()
        self._transfers = TransferLog()
        self._warned: set[str] = set()
        self._geometry: dict[str, PageGeometry] = {}
        self._service: Any = None
        self._io: PageTransfer | None = None
        self._identity: Identity | None = None
        self._settings: config.Settings | None = None
        self._options = BackendOptions()
        self._reason = "SGLang has not registered its host memory pool yet"
        self._licence: LicenceWatch | None = None  # the licence checked again while serving
        self._stopped = False  # that check refused: every call answers as a disabled backend's
        try:
            extra = getattr(storage_config, "extra_config", None)
            self._options = BackendOptions.parse(extra)
            for name in BackendOptions.misspelt(extra):
                log.warning("[galahad] extra config key %r is not one of Galahad's (%s): ignored, so its "
                            "setting stays at the default; check its spelling (docs/sglang.md)",
                            name, ", ".join(BackendOptions.KEYS))
            # SGLang decides the granularity (one entry per page) and when to look up
            # (prefetch_threshold): the vLLM-side payload order does not apply here.
            self._settings = attrs.evolve(config.read_settings(), payload_order=PayloadOrder.LAYER)
        except GalahadError as exc:  # a bad setting or option: its message names it and the fix
            self._disable(str(exc))
        except Exception as exc:  # noqa: BLE001 - SGLang would kill the scheduler: degrade instead
            self._disable(f"{type(exc).__name__}: {exc}")
        cfg = storage_config
        log.info("[galahad] SGLang storage backend created (tp %s/%s, pp %s/%s, %s KV)",
                 getattr(cfg, "tp_rank", "?"), getattr(cfg, "tp_size", "?"), getattr(cfg, "pp_rank", "?"),
                 getattr(cfg, "pp_size", "?"), "replicated" if getattr(cfg, "is_mla_model", False) else "sharded")

    # -- registration and opening -----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        try:
            self._open(mem_pool_host)
        except GalahadError as exc:  # an unsupported pool or a bad option: its message names the fix
            self._disable(str(exc))
        except Exception as exc:  # noqa: BLE001
            self._disable(f"cannot use SGLang's host pool: {type(exc).__name__}: {exc}")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.registered_pools[host_pool_name] = host_pool
        name = _pool_name(host_pool_name)
        try:
            if name == _KV and _KV in self._geometry and host_pool is self.mem_pool_host:
                return
            group = [p.value for p in PoolName].index(name) if name in {p.value for p in PoolName} else 0xFFFF
            geometry = PageGeometry.of(host_pool, name, group)
            with self._lock:
                self._geometry[name] = geometry
            log.debug("[galahad] SGLang pool %s registered: %s (%d bytes a page)", name, geometry.spec,
                      geometry.nbytes)
        except Exception as exc:  # noqa: BLE001 - that pool's pages will be misses
            self._caught("register_mem_host_pool_v2", exc)

    def on_host_pools_registered(self) -> None:
        pools = sorted(self._geometry)
        log.info("[galahad] SGLang pools served: %s", ", ".join(pools) if pools else "none")

    def _open(self, pool: Any) -> None:
        if self._settings is None or self._service is not None:
            return
        geometry = PageGeometry.of(pool, _KV, 0)
        identity = Identity.build(self.storage_config, pool, geometry.spec, self._options)
        if not identity.fingerprint_from_files:
            log.warning("[galahad] the model fingerprint comes from the served name %r only: two "
                        "checkpoints served under that name would share entries. Set "
                        "\"model_fingerprint\" (or \"model_path\") in the extra config.",
                        self.storage_config.model_name)
        handle = bootstrap.open_cache(self._settings, identity.namespace, identity.layout,
                                      role=f"sglang rank {identity.rank}",
                                      detail=f"page size {geometry.page_size} tokens, whole pages, fail open")
        if handle.service is None:
            self._reason = handle.reason  # bootstrap logged `NOT CACHING: <reason>`
            return
        io = PageTransfer(handle.service, identity.rank, self._options.timeout_s, self._counters,
                          self._transfers, self._lock, self._options.io_lanes)
        with self._lock:
            self._geometry[_KV] = geometry
            self._identity, self._service, self._io = identity, handle.service, io
            self._reason = ""
        self._licence = handle.licence
        if handle.licence is not None:
            handle.licence.start(self._licence_refused)
        log.info("[galahad] SGLang backend ready: rank %d of %d, %s KV, page %d tokens x %d bytes, "
                 "%s layout, call limit %.1f s", identity.rank, identity.layout.world_size,
                 "replicated" if identity.replicated else "sharded", geometry.page_size,
                 geometry.nbytes, getattr(pool, "layout", "?"), self._options.timeout_s)

    def _licence_refused(self, reason: str) -> None:
        """The licence, checked again while serving, is refused (its watch logged the `NOT
        CACHING` line): from now on nothing is read or written; the stored pages are kept."""
        self._reason = reason
        self._stopped = True

    def _disable(self, reason: str) -> None:
        self._reason = reason
        self._settings = None
        log.warning("[galahad] NOT CACHING: %s", reason)  # as bootstrap says it

    # -- keys -------------------------------------------------------------------------------

    def _key(self, key: str, pool: str = _KV) -> ChainKey:
        identity = self._identity
        if identity is None:
            raise RuntimeError("the backend is not open")
        if pool == _KV:
            return page_key(identity.digest, key)
        scope = f"{pool}|{self._geometry[pool].spec}"
        if identity.replicated and pool in _TP_SHARDED_SIDECARS:
            scope += f"|tp{identity.tp_rank}"
        return page_key(identity.digest, key, scope)

    def _ready(self) -> PageTransfer | None:
        io = None if self._stopped else self._io
        if io is None:
            with self._lock:
                self._counters.disabled_calls += 1
        return io

    # -- lookups ----------------------------------------------------------------------------

    # The single-page calls share the batch calls' bodies, not the guarded methods: one SGLang
    # call is one `calls` and at most one `errors`.

    @_fail_open(lambda key, *a, **k: False)
    def exists(self, key: str) -> bool:
        return self._leading_pages([key]) == 1

    @_fail_open(lambda keys, *a, **k: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._leading_pages(keys)

    def _leading_pages(self, keys: list[str]) -> int:
        io = self._ready()
        if io is None or not keys:
            return 0
        found = io.leading_committed([self._key(k) for k in keys])
        with self._lock:
            self._counters.pages_found += found
        self._service.count(lookups=1, hits_disk=1 if found else 0)
        return found

    def batch_exists_v1(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The zero-copy generation's name for `batch_exists` (SGLang 0.5.23 calls `batch_exists`)."""
        return self.batch_exists(keys, extra_info)

    # -- the zero-copy interface ------------------------------------------------------------

    @_fail_open(_false_list)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._read_into_pool(_KV, self.mem_pool_host, keys, host_indices)

    @_fail_open(_false_list)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._write_from_pool(_KV, self.mem_pool_host, keys, host_indices)

    def _read_into_pool(self, name: str, pool: Any, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        io = self._ready()
        geometry = self._geometry.get(name)
        if io is None or geometry is None or pool is None:
            return [False] * len(keys)
        offsets = self._offsets(name, host_indices, len(keys), geometry.page_size)
        if offsets is None:
            return [False] * len(keys)
        ckeys = [self._key(k, name) for k in keys]
        return io.read(ckeys, geometry, lambda i, payload: geometry.fill(pool, offsets[i], payload))

    def _write_from_pool(self, name: str, pool: Any, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        io = self._ready()
        geometry = self._geometry.get(name)
        if io is None or geometry is None or pool is None:
            return [False] * len(keys)
        offsets = self._offsets(name, host_indices, len(keys), geometry.page_size)
        if offsets is None:
            return [False] * len(keys)
        ckeys = [self._key(k, name) for k in keys]
        if name == _KV and self._identity is not None and not self._identity.writes_kv:
            # MLA: TP rank 0 of the stage writes; the others only learn whether it has.
            present = io.committed(ckeys)
            return [k in present for k in ckeys]
        payloads = [geometry.split(geometry.snapshot(pool, off)) for off in offsets]
        return io.write(ckeys, payloads, geometry)

    def _offsets(self, name: str, host_indices: torch.Tensor, pages: int, page_size: int) -> list[int] | None:
        if host_indices is None or int(host_indices.numel()) != pages * page_size:
            got = None if host_indices is None else int(host_indices.numel())
            self._warn_once(f"indices-{name}", "[galahad] SGLang passed %s host indices for %d pages "
                            "of %d tokens (pool %s): answered not found", got, pages, page_size, name)
            return None
        return [int(i) for i in host_indices[::page_size].tolist()]

    # -- the copy interface -----------------------------------------------------------------

    @_fail_open(lambda key, *a, **k: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        targets = None if target_location is None else [target_location]
        return self._read_flat([key], targets)[0]

    @_fail_open(_none_list)
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        return self._read_flat(keys, target_locations)

    def _read_flat(self, keys: list[str], target_locations: Any) -> list[torch.Tensor | None]:
        io = self._ready()
        geometry = self._geometry.get(_KV)
        pool = self.mem_pool_host
        if io is None or geometry is None or pool is None or not keys:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [
            pool.get_dummy_flat_data_page() for _ in keys]
        if len(targets) != len(keys):  # answered for every key, as SGLang indexes the answer by key
            self._warn_once("targets", "[galahad] SGLang passed %d target pages for %d keys: answered "
                            "not found", len(targets), len(keys))
            return [None] * len(keys)
        ok = io.read([self._key(k) for k in keys], geometry,
                     lambda i, payload: geometry.fill_flat(targets[i], payload))
        return [t if good else None for t, good in zip(targets, ok)]

    @_fail_open(lambda key, *a, **k: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._write_flat([key], None if value is None else [value])

    @_fail_open(lambda keys, *a, **k: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return self._write_flat(keys, values)

    def _write_flat(self, keys: list[str], values: Any) -> bool:
        if not keys and values is not None and len(values) == 0:
            return True  # nothing to write is all written (`batch_set_v1` answers [], SGLang's file backend True)
        io = self._ready()
        geometry = self._geometry.get(_KV)
        if io is None or geometry is None or values is None or len(values) != len(keys):
            return False
        ckeys = [self._key(k) for k in keys]
        if self._identity is not None and not self._identity.writes_kv:
            present = io.committed(ckeys)  # one bounded lookup for the batch, not one per page
            return all(k in present for k in ckeys)
        payloads = [geometry.split(geometry.snapshot_flat(v)) for v in values]
        return all(io.write(ckeys, payloads, geometry))

    # -- the multi-pool interface (hybrid models) -------------------------------------------

    @_fail_open(lambda keys, *a, **k: PoolTransferResult(0, {}))
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        io = self._ready()
        if io is None or not keys:
            return PoolTransferResult(0, {})
        transfers = list(pool_transfers or [])
        names = [_pool_name(t.name) for t in transfers]
        for t, name in zip(transfers, names):
            if name not in self._geometry or t.hit_policy not in (PoolHitPolicy.ALL_PAGES,
                                                                  PoolHitPolicy.TRAILING_PAGES):
                self._warn_once(f"v2-{name}", "[galahad] SGLang pool %s (hit policy %s) is not served: "
                                "its requests miss", name, getattr(t.hit_policy, "value", t.hit_policy))
                return PoolTransferResult(0, {})
        wanted = {(name, i): self._key(k, name) for name in [_KV, *names] for i, k in enumerate(keys)}
        present = io.committed(list(wanted.values()))
        result = _fold_hits(len(keys), transfers, names, lambda name, i: wanted[(name, i)] in present)
        with self._lock:
            self._counters.pages_found += result.kv_hit_pages
        self._service.count(lookups=1, hits_disk=1 if result.kv_hit_pages else 0)
        return result

    @_fail_open(_per_pool_false)
    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name = _pool_name(t.name)
            out[t.name] = self._read_into_pool(name, self._pool(name), t.keys or [], t.host_indices)
        return out

    @_fail_open(_per_pool_false)
    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name = _pool_name(t.name)
            out[t.name] = self._write_from_pool(name, self._pool(name), t.keys or [], t.host_indices)
        return out

    def _pool(self, name: str) -> Any:
        for key, pool in self.registered_pools.items():
            if _pool_name(key) == name:
                return pool
        return self.mem_pool_host if name == _KV else None

    # -- housekeeping -----------------------------------------------------------------------

    @_fail_open(lambda *a, **k: False)
    def clear(self) -> bool:
        """SGLang's `POST /hicache/storage-backend/clear`: set aside every entry of this namespace."""
        svc = self._service
        if svc is None:
            return False
        future = svc.submit(svc.clear)
        removed = future.result(timeout=self._options.timeout_s * 12)
        if removed is None:  # the store could not list its entries (the service said why)
            return False
        log.info("[galahad] SGLang asked to clear the storage backend: %d entries set aside", removed)
        return True

    @_fail_open(lambda *a, **k: None)
    def get_stats(self) -> Any:
        return self._transfers.drain()

    def close(self) -> None:
        """Finish writes still in flight (bounded), close the store, log the totals. Never raises."""
        try:
            if self._licence is not None:
                self._licence.close()
            io, svc = self._io, self._service
            enabled = self.enabled
            self._io = None
            if io is not None:
                if not io.flush(_CLOSE_TIMEOUT_S):
                    log.warning("[galahad] SGLang backend closing with writes still in flight")
                io.close()
            if svc is not None:
                closer = threading.Thread(target=svc.close, name="galahad-close", daemon=True)
                closer.start()
                closer.join(_CLOSE_TIMEOUT_S)
                log.info("[galahad] SGLang backend closed: %s", {**self.counters(), "enabled": enabled})
            self._service = None
        except Exception as exc:  # noqa: BLE001
            self._caught("close", exc)

    def counters(self) -> dict[str, Any]:
        """This backend's counts, and the service's (loads, saves, refusals, quarantined...)."""
        with self._lock:
            out: dict[str, Any] = self._counters.as_dict()
        svc = self._service
        if svc is not None:
            out.update({f"store_{k}": v for k, v in svc.snapshot_counters().as_dict().items()})
        out["enabled"] = self.enabled
        out["reason"] = self._reason
        return out

    @property
    def enabled(self) -> bool:
        return self._io is not None and not self._stopped

    @property
    def reason(self) -> str:
        """Why the backend is not caching ('' when it is)."""
        return self._reason

    def _caught(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self._counters.errors += 1
        self._warn_once(f"caught-{where}", "[galahad] SGLang backend %s failed (%s: %s): answered not "
                        "found; later failures are counted", where, type(exc).__name__, exc)

    def _warn_once(self, topic: str, msg: str, *args: object) -> None:
        with self._lock:
            first = topic not in self._warned
            self._warned.add(topic)
        (log.warning if first else log.debug)(msg, *args)


def _fold_hits(pages: int, transfers: Sequence[PoolTransfer], names: Sequence[str],
               has: Callable[[str, int], bool]) -> PoolTransferResult:
    """SGLang's own fold (HiCacheFile.batch_exists_v2): a prefix counts only with every pool's pages."""
    kv_pages = next((i for i in range(pages) if not has(_KV, i)), pages)
    hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for t, name in zip(transfers, names):
        if not restorable:
            break
        if t.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not has(name, i)), kv_pages)
            ok = set(range(1, boundary + 1))
        else:  # TRAILING_PAGES: the last len(t.keys) pages of the prefix
            trailing = max(1, len(t.keys) if t.keys else 1)
            ok = {n for n in range(1, kv_pages + 1)
                  if all(has(name, i) for i in range(max(0, n - trailing), n))}
            boundary = max(ok, default=0)
        if boundary:
            hit_count[t.name] = boundary
        restorable = [n for n in restorable if n in ok]
    return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)
