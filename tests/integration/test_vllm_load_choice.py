"""Load or recompute on the scheduler side: a real service over the in-memory store, vLLM's
connector classes imported, no engine started (the advisor's figures are given, not measured;
the GPU benchmark measures them: docs/benchmarks.md, GPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from galahad.adapters.memory.store import InMemoryBlockStore  # noqa: E402
from galahad.adapters.vllm.advisor import LoadAdvisor  # noqa: E402
from galahad.adapters.vllm.scheduler import GalahadScheduler  # noqa: E402
from galahad.format.codec import cipher_lookup  # noqa: E402
from galahad.domain.chunking import Chunking  # noqa: E402
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder  # noqa: E402
from galahad.domain.rank import RankLayout  # noqa: E402
from galahad.format.checksum import Xxh3FrameCheck  # noqa: E402
from galahad.app.service import KVCacheService, SegmentSpec  # noqa: E402

pytestmark = pytest.mark.vllm

TOKENS = 1024
SHAPE = (2, TOKENS, 64, 128)  # bf16: 33.5 MB, above the size under which loads are always made


def _request(req_id: str) -> SimpleNamespace:
    tokens = [(i * 7919) % 30000 for i in range(TOKENS + 1)]
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           num_computed_tokens=0, cache_salt=None, lora_request=None,
                           mm_features=None, prompt_embeds=None, pooling_params=None)


@pytest.fixture(scope="module")
def service() -> KVCacheService:
    ns = Namespace(model="choice", model_fingerprint="choice", dtype="bfloat16", kv_cache_dtype="auto",
                   block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 1),))
    check = Xxh3FrameCheck()
    svc = KVCacheService(namespace=ns, store=InMemoryBlockStore(), chunking=Chunking(PayloadOrder.LAYER, 16),
                         layout=RankLayout(), cipher=check, ciphers=cipher_lookup(check))
    req = _request("writer")
    seed = svc.seed()
    keys = svc.keys(req.prompt_token_ids, seed)
    payload = bytes(2 * TOKENS * 64 * 128 * 2)
    for span in svc.chunking.save_spans(req.num_prompt_tokens - 1):
        key = keys[svc.chunking.key_index(span.end)]
        assert svc.save_part(key, span, 0, [SegmentSpec(0, 0, 0, "bfloat16", SHAPE)], [payload])
        assert svc.commit(key)
    return svc


def test_without_figures_a_hit_is_offered(service: KVCacheService) -> None:
    sched = GalahadScheduler(service, async_load=True, single_group=True, advisor=LoadAdvisor())
    assert sched.matched(_request("a"), 0) == (TOKENS, True)


def test_a_hit_slower_to_load_than_to_recompute_is_not_offered_and_counted_bypassed_once(
        service: KVCacheService) -> None:
    advisor = LoadAdvisor()
    advisor.observe_step(TOKENS, 0.002)  # a fast engine
    advisor.observe_load(64 << 20, 1.0, share=1.0)  # a slow store: 67 MB/s
    sched = GalahadScheduler(service, async_load=True, single_group=True, advisor=advisor)
    service.take_counters()
    req = _request("b")
    assert sched.matched(req, 0) == (0, False)
    assert sched.matched(req, 0) == (0, False)  # vLLM asks again while the request waits
    counters = service.take_counters()
    assert counters.bypassed == 1 and counters.lookups == 1


def test_with_the_always_policy_the_same_hit_is_offered(service: KVCacheService) -> None:
    sched = GalahadScheduler(service, async_load=True, single_group=True, advisor=None)
    assert sched.matched(_request("c"), 0) == (TOKENS, True)


def test_a_load_priced_below_its_prefill_runs_inside_the_step(service: KVCacheService) -> None:
    advisor = LoadAdvisor()
    advisor.observe_step(TOKENS, 5.0)  # a slow engine: loading wins by far
    sched = GalahadScheduler(service, async_load=True, single_group=True, advisor=advisor)
    assert sched.matched(_request("d"), 0) == (TOKENS, False)
    several = GalahadScheduler(service, async_load=True, single_group=False, advisor=advisor)
    assert several.matched(_request("e"), 0) == (TOKENS, True)  # several groups: always async


@pytest.mark.parametrize("text", [
    '{"version": 1, "prefill": [[Infinity, 1.0]]}',  # json reads Infinity: int() of it overflowed
    '{"version": 1, "prefill": [[1e999, 1.0]]}',
    '{"version": 1, "prefill": [[1' + "0" * 400 + ', 1.0]]}',  # too large for a float
    '{"version": 1, "prefill": [[1024, NaN]]}',  # a NaN prefill time priced every hit "recompute"
    '{"version": 1, "prefill": [[1024, 5.0]], "warm_bps": NaN, "cold_bps": Infinity}',  # a slow engine
    "[" * 100_000,  # json's parser recurses: RecursionError
])
def test_a_damaged_figures_file_starts_without_figures_never_stops_the_server_nor_prices_a_load(
        service: KVCacheService, tmp_path: Path, text: str) -> None:
    path = tmp_path / "figures.json"  # the connector reads figures-<digest>.json beside the store
    path.write_text(text)
    advisor = LoadAdvisor(path=str(path))  # raised here, in GalahadConnector.__init__: vLLM did not start
    if advisor.model() is not None:  # only the finite figures of the last case are taken
        assert "nan" not in advisor.describe() and "inf" not in advisor.describe()
    sched = GalahadScheduler(service, async_load=True, single_group=True, advisor=advisor)
    assert sched.matched(_request(f"damaged-{len(text)}"), 0)[0] == TOKENS
