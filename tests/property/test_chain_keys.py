"""Chain keys: different whenever anything that changes the KV differs; equal across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from galahad.domain.chain import ChainKey, ChainSeed, chain_keys
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder

text = st.text(max_size=12)
tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80)
steps = st.integers(1, 16)
mm_hash = st.text(max_size=8)

groups = st.builds(
    KVGroup,
    kind=st.sampled_from([GroupKind.FULL, GroupKind.STATE]),
    block_size=st.integers(1, 512),
    num_layers=st.integers(0, 64),
    spec=text,
) | st.builds(KVGroup, kind=st.just(GroupKind.SLIDING), block_size=st.integers(1, 512),
              num_layers=st.integers(0, 64), window_tokens=st.integers(1, 8192), spec=text)

namespaces = st.builds(
    Namespace,
    model=text, model_fingerprint=text, dtype=text, kv_cache_dtype=text, block_size=st.integers(1, 1024),
    groups=st.lists(groups, max_size=3).map(tuple), tp_size=st.integers(1, 8), pp_size=st.integers(1, 4),
    kv_layout=text, payload_order=st.sampled_from(PayloadOrder), engine=text, format_major=st.integers(1, 3),
    extra=st.lists(st.tuples(text, text), max_size=2, unique_by=lambda kv: kv[0]).map(tuple),
)
FIELDS = [f.name for f in attrs.fields(Namespace)]


@st.composite
def namespace_pairs(draw: st.DrawFn) -> tuple[Namespace, Namespace]:
    """Two namespaces that differ in exactly one field."""
    first = draw(namespaces)
    name = draw(st.sampled_from(FIELDS))
    other = getattr(draw(namespaces), name)
    assume(other != getattr(first, name))
    return first, attrs.evolve(first, **{name: other})


@given(namespace_pairs(), tokens_st, steps)
def test_keys_differ_when_any_namespace_field_differs(pair: tuple[Namespace, Namespace], tokens: list[int],
                                                       step: int) -> None:
    a, b = pair
    assert a.digest() != b.digest()
    keys_a = chain_keys(ChainSeed(a.digest()), tokens, step)
    keys_b = chain_keys(ChainSeed(b.digest()), tokens, step)
    assert all(x != y for x, y in zip(keys_a, keys_b))


seeds = st.builds(ChainSeed, namespace_digest=st.binary(min_size=32, max_size=32),
                  cache_salt=st.none() | text, lora=st.none() | text,
                  mm_hashes=st.lists(mm_hash, max_size=3).map(tuple))


@given(seeds, st.sampled_from(["cache_salt", "lora", "mm_hashes", "namespace_digest"]), seeds, tokens_st, steps)
def test_keys_differ_when_salt_lora_media_or_namespace_differ(seed: ChainSeed, name: str, donor: ChainSeed,
                                                              tokens: list[int], step: int) -> None:
    other = attrs.evolve(seed, **{name: getattr(donor, name)})
    assume(other != seed)
    assume(len(tokens) >= step)
    assert all(x != y for x, y in zip(chain_keys(seed, tokens, step), chain_keys(other, tokens, step)))


@given(seeds, tokens_st, steps, st.data())
def test_a_changed_token_changes_exactly_the_keys_that_cover_it(seed: ChainSeed, tokens: list[int], step: int,
                                                                 data: st.DataObject) -> None:
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != tokens[position]))
    before, after = chain_keys(seed, tokens, step), chain_keys(seed, changed, step)
    for index, (x, y) in enumerate(zip(before, after)):
        covers = (index + 1) * step > position
        assert (x != y) == covers


@given(seeds, tokens_st, steps)
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(seed: ChainSeed, tokens: list[int], step: int) -> None:
    keys = chain_keys(seed, tokens, step)
    assert len(keys) == len(tokens) // step
    for n in range(len(keys) + 1):
        assert chain_keys(seed, tokens[: n * step], step) == keys[:n]


_CHILD = """
import json, sys
from galahad.domain.chain import ChainSeed, chain_keys
from galahad.domain.namespace import KVGroup, GroupKind, Namespace
case = json.loads(sys.stdin.read())
ns = Namespace(model=case["model"], model_fingerprint="fp", dtype="bfloat16", kv_cache_dtype="auto",
               block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 4),), tp_size=2)
seed = ChainSeed(ns.digest(), cache_salt=case["salt"], lora=case["lora"], mm_hashes=tuple(case["mm"]))
print(json.dumps([k.hex for k in chain_keys(seed, case["tokens"], 16)]))
"""


def test_keys_are_equal_across_processes() -> None:
    case = {"model": "llama", "salt": "tenant-a", "lora": "adapter-1", "mm": ["ab12", "cd34"],
            "tokens": list(range(1000, 1100))}
    ns = Namespace(model="llama", model_fingerprint="fp", dtype="bfloat16", kv_cache_dtype="auto", block_size=16,
                   groups=(KVGroup(GroupKind.FULL, 16, 4),), tp_size=2)
    seed = ChainSeed(ns.digest(), cache_salt="tenant-a", lora="adapter-1", mm_hashes=("ab12", "cd34"))
    here = [k.hex for k in chain_keys(seed, case["tokens"], 16)]
    for hash_seed in ("0", "12345"):  # str hashing differs between these processes
        done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(case), capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == here
    assert len(here) == 6 and len(set(here)) == 6
    assert ChainKey.from_hex(here[0]).hex == here[0]


def test_media_hashes_holding_nul_do_not_collide() -> None:
    joined = ChainSeed(bytes(32), mm_hashes=("a\x00b",))
    split = ChainSeed(bytes(32), mm_hashes=("a", "b"))
    assert joined.digest() != split.digest()


def test_a_salt_holding_a_lone_surrogate_still_gives_a_key() -> None:
    assert len(ChainSeed(bytes(32), cache_salt="\ud800").digest()) == 32
