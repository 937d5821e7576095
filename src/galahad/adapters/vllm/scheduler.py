"""Scheduler side of the connector: lookups, load and save jobs, and the commit rule.

Runs in vLLM's EngineCore process. A request's chain keys are computed once; the longest
committed prefix beyond vLLM's own (block-aligned) hit is offered, leaving one prompt token to
compute. Prompts whose prefill completes in a step get a save job in that step's metadata. An
entry is committed only after every writing rank acknowledged its part durable. Until then, once
every rank reported the copy its save holds (pending loads), this server offers the
entry too: its loads come from that copy, not from the disk (after a restart, only committed
entries exist).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from galahad.adapters.vllm.advisor import MIN_STEP_TOKENS, LoadAdvisor
from galahad.adapters.vllm.identity import bypass_reason, seed_of
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, GalahadWorkerMetadata, LoadJob, SaveJob
from galahad.domain.chain import ChainKey, ChainSeed
from galahad.domain.chunking import Span
from galahad.domain.counter import SkipReason
from galahad.domain.namespace import PayloadOrder
from galahad.domain.plan import StatePlan
from galahad.app.service import Hit, KVCacheService

__all__ = ["GalahadScheduler"]

log = logging.getLogger(__name__)

_ACK_TIMEOUT_S = 300.0
# Parts not all acknowledged this long after their save was shipped: the store is asked, every
# `_PROBE_EVERY_S`, whether they are on disk (a part's file takes its name only once written and
# fsynced), so an acknowledgement lost or stuck on its way costs a late commit, not the entry.
_ACK_LATE_S = 30.0
_PROBE_EVERY_S = 10.0
_KNOWN_COMMITTED = 1 << 16  # keys this scheduler saw committed, kept to skip re-saving them
_NULL_BLOCK = 0  # vLLM's null block: what a block table holds where a group keeps nothing


@dataclass
class _Tracked:
    request: Any
    bypass: str = ""
    seed: ChainSeed | None = None
    keys: list[ChainKey] | None = None
    hit: Hit | None = None
    local: int = 0
    saved: bool = False
    # lookups by local hit (no re-stat), with the scheduler's commit count when made
    memo: dict[int, tuple[Hit | None, int]] = field(default_factory=dict)
    load_failed: bool = False  # a load of this request failed: never offer it a disk hit again
    worth: dict[int, tuple[bool, float | None, bool]] = field(default_factory=dict)  # by local hit:
    # (load?, resident share, whether measured figures priced the load below the prefill)
    bypassed: bool = False  # counted once as `bypassed` (recomputed although on disk)
    layout_checked: bool = False  # a miss here was checked against the store's other layouts


@dataclass
class _Inflight:
    since: float
    acks: list[tuple[int, bool]] = field(default_factory=list)
    probed: float = 0.0  # when the store was last asked whether every part is on disk
    probe: Future[bool] | None = None  # that commit attempt, on the commit threads


class GalahadScheduler:
    def __init__(self, service: KVCacheService, *, async_load: bool, single_group: bool,
                 advisor: LoadAdvisor | None = None, chain_fallback: bool = False,
                 pending_loads: bool = False) -> None:
        self.service = service
        self.chunking = service.chunking
        self.layout = service.layout
        self.block_size = service.chunking.block_size
        self.plan = StatePlan(service.namespace.groups)
        self.chain_fallback = chain_fallback  # chunk order asked, layer order used (hybrid plans)
        self.async_load = async_load or not single_group
        self.single_group = single_group
        self._tracked: dict[str, _Tracked] = {}
        self._allocated: dict[str, tuple[Hit, int, Any, int, bool]] = {}
        self._inflight: dict[bytes, _Inflight] = {}
        self._committing: dict[bytes, Future[bool]] = {}  # markers being written (commit threads)
        # keys whose marker write ended, appended by its future as it ends (on a commit thread):
        # a step reaps those, not every marker still being written
        self._ended: collections.deque[bytes] = collections.deque()
        # Keys committed by this scheduler or found committed by its lookups, newest last: a save
        # skips them without reading their markers again (one file read per 64 tokens, on the
        # engine thread). Stale only if another process evicted one: then it is not re-saved.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._loads: dict[str, tuple[int, list[bytes | None]]] = {}
        self.committed = 0  # entries committed since the last report (adapter-only counter)
        self._commits = 0  # entries this scheduler committed, ever: a lookup made before is stale
        self.advisor = advisor
        self._load_share: dict[str, float | None] = {}  # req_id -> resident share when chosen
        self._told_bypass = False
        self._told_late = False
        self.off = ""  # a worker reported it cannot cache: no hits offered, no saves shipped
        # Entries shipped for saving whose parts every rank still holds in memory (the worker's
        # `held` reports), offered to lookups until committed: a conversation's next turn loads
        # the turn before while the disk is still writing it. Only where every rank writes its
        # own part (a rank reading another's part could only read the disk).
        layout = service.layout
        self._writers = len(layout.parts())  # the ranks that acknowledge each entry's parts
        self.pending_loads = pending_loads and len(layout.parts()) == layout.world_size
        self._holding: dict[bytes, set[int]] = {}
        self._held: set[bytes] = set()
        self._is_held = lambda key: key.raw in self._held

    # -- lookups --------------------------------------------------------------------------------

    def _track(self, request: Any) -> _Tracked:
        t = self._tracked.get(request.request_id)
        if t is None:
            t = _Tracked(request, bypass_reason(request))
            if not t.bypass and not self.chunking.eligible(len(request.prompt_token_ids)):
                t.bypass = "short"
            self.service.count(**({"bypassed": 1} if t.bypass else {"lookups": 1}))
            self._tracked[request.request_id] = t
        return t

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """Tokens loadable beyond the local hit `num_computed`, and whether the load is async."""
        if self.off:
            return 0, False
        t = self._track(request)
        t.hit, t.local = None, num_computed
        if t.bypass or t.load_failed:  # after a failed load vLLM retries: recompute, never loop
            return 0, False
        tokens = request.prompt_token_ids
        if t.keys is None or t.seed is None:
            t.seed = seed_of(self.service, request)
            t.keys = self.service.keys(tokens, t.seed)
        hit = self._memo_lookup(t, tokens, t.seed, t.keys, num_computed)
        if hit is None or hit.end <= num_computed:
            self._check_other_layouts(t, num_computed)
            return 0, False
        if not self._worth_loading(t, hit, num_computed):
            return 0, False
        t.hit = hit
        return hit.end - num_computed, self._async_for(t, num_computed)

    def _memo_lookup(self, t: _Tracked, tokens: Any, seed: ChainSeed, keys: list[ChainKey],
                     num_computed: int) -> Hit | None:
        """The lookup for this local hit. vLLM asks again and again while a request waits (for
        room in the batch or the KV cache): the store is read again only when this scheduler
        committed entries since, and then only beyond the hit found before, so entries that
        became committed while the request waited (the saves of the turn before, still being
        written when it came) are loaded, not computed again."""
        memo = t.memo.get(num_computed)
        if memo is not None and (memo[1] == self._commits or not self._may_grow(memo[0], len(tokens))):
            return memo[0]
        before = memo[0] if memo is not None else None
        found = self.service.lookup(tokens, seed, already=num_computed, keys=keys, after=before,
                                    held=self._is_held if self._held else None)
        self._note_lookup(keys, found)
        if memo is not None and found != before:
            t.worth.pop(num_computed, None)  # a longer hit: the cost model is asked again
        t.memo[num_computed] = (found, self._commits)
        return found

    def _may_grow(self, hit: Hit | None, num_tokens: int) -> bool:
        """Whether a longer hit than `hit` is possible for a prompt of `num_tokens` tokens."""
        ends = self.chunking.probe_ends(num_tokens)
        return bool(ends) and (hit is None or hit.end < ends[0])

    def _async_for(self, t: _Tracked, num_computed: int) -> bool:
        """Asynchronous, unless measured figures price the load below the prefill it replaces:
        then it runs inside the step, as that prefill would have (sooner for the request, no
        longer for the others). Several KV cache groups always load asynchronously."""
        if not self.async_load or not self.single_group:
            return self.async_load
        _load, _share, priced = t.worth.get(num_computed, (True, None, False))
        return not priced

    def _worth_loading(self, t: _Tracked, hit: Hit, num_computed: int) -> bool:
        """The cost model's choice for this hit (asked once per local hit); a no is counted once."""
        if self.advisor is None:
            return True
        if num_computed not in t.worth:
            # entries held in memory read nothing: only the rest is priced (none left: a load
            # too small to price, made inside the step as a priced one, since it reads nothing)
            held = any(key.raw in self._held for _span, key in hit.entries)
            nbytes, share = self.service.residency(hit, self._is_held if held else None)
            choice = self.advisor.choose(hit.end - num_computed, nbytes, share)
            load = choice is None or choice.load
            t.worth[num_computed] = (load, share, choice.load if choice is not None else held)
            if not load and choice is not None:
                log.debug("[galahad] %s: recomputing %d tokens (%.1f ms) beats loading %d bytes "
                          "(%.1f ms, %.0f%% cached)", t.request.request_id, hit.end - num_computed,
                          choice.recompute_s * 1e3, nbytes, choice.load_s * 1e3, 100 * (share or 0))
                if not self._told_bypass:
                    self._told_bypass = True
                    log.info("[galahad] load or recompute: recomputing a hit that would load slower "
                             "(counted as bypassed and hits_recomputed); figures: %s", self.advisor.describe())
        load = t.worth[num_computed][0]
        if not load and not t.bypassed:
            t.bypassed = True
            self.service.count(bypassed=1, hits_recomputed=1)
        return load

    def _check_other_layouts(self, t: _Tracked, num_computed: int) -> None:
        """Count a miss that another TP x PP layout of the model would have served (once a request)."""
        if t.layout_checked or not self.service.other_layouts or t.seed is None:
            return
        t.layout_checked = True
        if self.service.in_other_layout(t.request.prompt_token_ids, t.seed, already=num_computed):
            self.service.count(namespace_misses=1)

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """Remember where to load (the job is built in `build_meta`, where failures are contained)."""
        t = self._tracked.get(request.request_id)
        if num_external <= 0 or t is None or t.hit is None:
            return
        self._allocated[request.request_id] = (t.hit, t.local, blocks, num_external,
                                               self._async_for(t, t.local))
        if self.advisor is not None:
            self._load_share[request.request_id] = t.worth.get(t.local, (True, None, False))[1]
        self.service.count(hits_disk=1, chain_hits=int(t.hit.shared))

    def _load_job(self, req_id: str, hit: Hit, local: int, block_ids: tuple[list[int], ...],
                  num_external: int, async_load: bool) -> LoadJob:
        start, end = local, local + num_external
        entries = []
        for span, key in hit.entries:
            if span.end <= start or span.start >= end:
                continue
            restore = self.plan.restore(span.start, span.end, start, end)
            blocks = tuple(tuple(block_ids[r.group][r.blocks.start : r.blocks.stop]) for r in restore)
            for r, ids in zip(restore, blocks):
                if len(ids) != len(r.blocks) or _NULL_BLOCK in ids:
                    raise ValueError(f"group {r.group}: blocks {r.blocks} of the request are "
                                     f"{ids}, not allocated for this load")
            entries.append(EntryRef(key.raw, span.start, span.end, blocks,
                                    tuple(r.first_row for r in restore)))
        return LoadJob(req_id, tuple(entries), async_load, num_external)

    # -- saves and metadata ---------------------------------------------------------------------

    def build_meta(self, scheduler_output: Any) -> GalahadMetadata:
        meta = GalahadMetadata()
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        allocated, self._allocated = self._allocated, {}
        for req_id, (hit, local, blocks, num_external, async_load) in allocated.items():
            try:
                ids = blocks.get_block_ids() if blocks is not None else state.get_block_ids(req_id)
                job = self._load_job(req_id, hit, local, ids, num_external, async_load)
            except Exception:  # noqa: BLE001 - a job must still be shipped: it reports the failure
                log.warning("[galahad] cannot plan the load of %s; it will be recomputed", req_id,
                            exc_info=True)
                job = LoadJob(req_id, (), async_load, num_external, broken=True)
            meta.loads.append(job)
            self._loads[req_id] = (job.tokens, [])
        if not meta.loads and self.advisor is not None:  # a step the cost model can learn from is timed
            tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
            meta.step_tokens = tokens if tokens >= MIN_STEP_TOKENS else 0
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(req_id)
            if t is None or t.bypass or t.saved or state is None or self.off:
                continue
            request = t.request
            if request.num_computed_tokens + n < request.num_prompt_tokens:
                continue
            t.saved = True
            block_ids = state.get_block_ids(req_id)
            if block_ids is not None:
                self._add_save(meta, req_id, t, block_ids)
        return meta

    def _save_spans(self, num_prompt: int) -> list[Span]:
        # layer order: the prefix an identical prompt will probe (it leaves one token to compute)
        if self.chunking.order is PayloadOrder.LAYER:
            return self.chunking.save_spans(num_prompt - 1)
        return self.chunking.save_spans(num_prompt)

    def _add_save(self, meta: GalahadMetadata, req_id: str, t: _Tracked,
                  block_ids: tuple[list[int], ...]) -> None:
        if t.keys is None:
            t.seed = seed_of(self.service, t.request)
            t.keys = self.service.keys(t.request.prompt_token_ids, t.seed)
        entries, now = [], time.monotonic()
        spans = [(span, t.keys[self.chunking.key_index(span.end)])
                 for span in self._save_spans(t.request.num_prompt_tokens)]
        spans = [(span, key) for span, key in spans
                 if key.raw not in self._inflight and key.raw not in self._committing and key.raw not in self._known]
        # the store is asked about all of them at once; only from the first it holds on is each
        # asked on its own (`holds`: a committed entry this server cannot open may be replaced)
        first = self.service.first_committed([key for _span, key in spans]) if spans else None
        for i, (span, key) in enumerate(spans):
            if first is not None and i >= first and self.service.holds(key):
                continue
            parts = self.plan.parts(span.start, span.end)
            blocks = tuple(tuple(block_ids[p.group][p.blocks.start : p.blocks.stop]) for p in parts)
            if any(len(b) != len(p.blocks) or _NULL_BLOCK in b for b, p in zip(blocks, parts)):
                # a block the plan needs is gone (a sliding window moved past it): not saved
                self.service.count_skipped(SkipReason.FREED)
                continue
            entries.append(EntryRef(key.raw, span.start, span.end, blocks))
            self._inflight[key.raw] = _Inflight(now)
        if not entries:
            return
        meta.saves.append(SaveJob(req_id, tuple(entries)))
        if self.chain_fallback:
            self.service.count(saver_chain_fallback=1)
        elif self.chunking.order is PayloadOrder.CHUNK:
            fallback = self.chunking.is_fallback
            self.service.count(saver_chain_saved=int(not fallback), saver_chain_fallback=int(fallback))

    # -- worker reports -------------------------------------------------------------------------

    def update(self, connector_output: Any) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, GalahadWorkerMetadata):
            if report.off and not self.off:
                self.stop(report.off)
            for key, ranks in report.held.items():
                self._hold(key, ranks)
            durable = []
            for key, acks in report.saved.items():
                if self._ack(key, acks):  # every part is durable: its marker is written on the
                    durable.append(key)  # commit threads, the engine's step does not wait for the disk
                elif key not in self._inflight:  # a part was not written: never committed
                    self._unhold(key)
            if durable:
                futures = self.service.commit_all_later([ChainKey(key) for key in durable])
                for key, future in zip(durable, futures):
                    self._committing_on(key, future)
            for req_id, results in report.loaded.items():
                self._loaded(req_id, results)
            self._observe(report)
        self._reap_commits()
        self._expire()

    def stop(self, off: dict[int, str]) -> None:
        """A worker cannot cache: every hit offered would fail on its rank (recomputed, or an
        error under `kv_load_failure_policy=fail`) and every save be dropped there. Stop both;
        entries already stored stay for the next start. Said at startup through vLLM's connector
        handshake (`connector.py`), before the first request, and again in the worker's first
        report (`update`)."""
        if self.off:
            return
        rank = min(off)
        self.off = f"worker rank {rank} cannot cache: {off[rank]}"
        log.warning("[galahad] (scheduler) NOT CACHING from now on: %s; no more hits are offered "
                    "and nothing more is saved (the stored entries are kept); fix that rank's "
                    "cause and restart", self.off)

    def halt(self, reason: str) -> None:
        """This process's licence, checked again while serving, is refused (its watch logged the
        `NOT CACHING` line): from now on, as after `stop`, no hit is offered and no save shipped.
        Called from the watch's thread; the engine thread reads `off`."""
        self.off = self.off or reason

    def _committing_on(self, key: bytes, future: Future[bool]) -> None:
        """`key`'s marker is being written by `future`; reaped by the step after it ends."""
        self._committing[key] = future
        future.add_done_callback(lambda _done, key=key: self._ended.append(key))

    def _reap_commits(self) -> None:
        """Count the markers written since the last step (`committed`)."""
        ended = self._ended
        while ended:
            key = ended.popleft()
            future = self._committing.get(key)
            if future is None or not future.done():  # reaped already, or a later commit of the key
                continue
            del self._committing[key]
            try:
                ok = future.result()
                self.committed += int(ok)
                if ok:
                    self._learn(key)
                    self._commits += 1
            except Exception:  # noqa: BLE001 - commit() contains store errors; belt and braces
                log.warning("[galahad] committing %s failed", key.hex()[:16], exc_info=True)
            self._unhold(key)  # committed (lookups find its marker) or never

    def _ack(self, key: bytes, acks: list[tuple[int, bool]]) -> bool:
        """Record a part's acknowledgements; True when every rank's part is in and durable (the
        entry is then committed)."""
        pending = self._inflight.get(key)
        if pending is None:
            return False
        writers = self._writers  # a step acknowledges dozens of entries: counted once, not per ack
        if writers == 1 and len(acks) == 1 and not pending.acks:  # one rank writes the one part
            del self._inflight[key]
            return acks[0][1]
        pending.acks.extend(acks)
        if len(pending.acks) < writers or len({rank for rank, _ in pending.acks}) < writers:
            return False
        del self._inflight[key]
        return self.layout.is_complete({self.layout.part_of(rank) for rank, ok in pending.acks if ok})

    def _hold(self, key: bytes, ranks: list[int]) -> None:
        """Ranks report the copy of this entry's part their save holds; offered once every rank
        holds it (lookups made before are asked again, as after a commit)."""
        if not self.pending_loads or key not in self._inflight:
            return  # not offered, or already committed or failed
        holding = self._holding.setdefault(key, set())
        holding.update(ranks)
        if len(holding) >= self.layout.world_size and key not in self._held:
            self._held.add(key)
            self._commits += 1

    def _unhold(self, key: bytes) -> None:
        self._holding.pop(key, None)
        self._held.discard(key)

    def _observe(self, report: GalahadWorkerMetadata) -> None:
        for req_id in report.loaded:
            share = self._load_share.pop(req_id, None)
            timing = report.timings.get(req_id)
            if timing is not None and self.advisor is not None:
                self.advisor.observe_load(timing[0], timing[1], share)
        if self.advisor is not None:
            for tokens, seconds in report.steps:
                self.advisor.observe_step(tokens, seconds)
            self.advisor.save()

    def _note_lookup(self, keys: list[ChainKey], found: Hit | None) -> None:
        """What a lookup (which reads the markers) says of this prompt's keys: those it found are
        committed; those beyond are not known to be, even if this scheduler committed them
        before (evicted since, by this process's size cap or another process): saved again."""
        end = 0
        if found is not None:
            end = found.end
            for _span, key in found.entries:
                if key.raw not in self._held:  # a held entry is not committed yet
                    self._learn(key.raw)
        for key in keys[self.chunking.key_index(end + self.chunking.step):]:
            self._known.pop(key.raw, None)

    def _learn(self, key: bytes) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > _KNOWN_COMMITTED:
            self._known.popitem(last=False)

    def _loaded(self, req_id: str, results: list[tuple[int, bytes | None]]) -> None:
        for _rank, failed in results:
            if failed is not None:  # quarantined by the worker: saved again when next computed
                self._known.pop(failed, None)
        t = self._tracked.get(req_id)
        if t is not None and any(failed is not None for _rank, failed in results):
            t.load_failed, t.memo = True, {}
        tokens, seen = self._loads.get(req_id, (0, []))
        seen.extend(failed for _rank, failed in results)
        if len(seen) < self.layout.world_size:
            self._loads[req_id] = (tokens, seen)
            return
        self._loads.pop(req_id, None)
        if all(failed is None for failed in seen):
            self.service.count(loads=1, tokens_loaded=tokens)

    def _expire(self) -> None:
        """Entries whose parts are not all acknowledged: past `_ACK_LATE_S`, committed if every
        part is on disk after all; past `_ACK_TIMEOUT_S`, given up (never committed).

        Runs every step: `_inflight` is in the order entries were shipped (a key is added only
        when absent, stamped with the time then), and only entries older than `_ACK_LATE_S` (or
        the timeout, if shorter) have anything to do, so the walk stops at the first younger one."""
        now = time.monotonic()
        due = min(_ACK_LATE_S, _ACK_TIMEOUT_S)
        late = list(itertools.takewhile(lambda kv: now - kv[1].since > due, self._inflight.items()))
        for key, pending in late:
            if pending.probe is not None and pending.probe.done():
                if _committed(pending.probe):
                    del self._inflight[key]
                    self._committing_on(key, pending.probe)  # counted by the next step's reap
                    if not self._told_late:
                        self._told_late = True
                        log.warning("[galahad] entry %s: not every rank acknowledged its part within "
                                    "%d s, but every part is on disk: committed (an acknowledgement "
                                    "was lost or late)", key.hex()[:16], _ACK_LATE_S)
                    continue
                pending.probe = None
            age = now - pending.since
            if age > _ACK_TIMEOUT_S and pending.probe is None:
                log.warning("[galahad] entry %s: not every rank acknowledged its part within %d s; "
                            "not committed", key.hex()[:16], _ACK_TIMEOUT_S)
                del self._inflight[key]
                self._unhold(key)
            elif age > _ACK_LATE_S and pending.probe is None and now - pending.probed > _PROBE_EVERY_S:
                pending.probed = now
                pending.probe = self.service.commit_later(ChainKey(key))  # writes no marker unless
                # every part's file is there

    # -- lifecycle ------------------------------------------------------------------------------

    def finished(self, request: Any) -> None:
        # A shipped or allocated load still runs and is reported: vLLM holds the blocks until then.
        self._tracked.pop(request.request_id, None)

    def close(self) -> None:
        for future in self._committing.values():  # markers being written are finished
            future.exception()
        self._reap_commits()
        if self.advisor is not None:
            self.advisor.save(force=True)

    def pending_commits(self, *, reap: bool = True) -> int:
        """Entries shipped for saving not committed yet (parts not all acknowledged, or the
        marker still being written). `reap=False` (vLLM asking whether to keep stepping) also
        counts markers written but not yet counted `committed`: the step that counts them is
        the one that reports them, so none is left out of the counters when the engine idles."""
        if self._inflight:
            self._expire()
        if self._committing and reap:
            self._reap_commits()
        return len(self._inflight) + len(self._committing)


def _committed(future: Future[bool]) -> bool:
    try:
        return bool(future.result())
    except Exception:  # noqa: BLE001 - commit() contains store errors; belt and braces
        return False
