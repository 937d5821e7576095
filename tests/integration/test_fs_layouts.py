"""The filesystem store and other layouts of the same model (a server restarted with another TP/PP).

One store root, several namespaces: a namespace opened for the first time says it is fresh, and
lists the namespaces that hold the same model split differently (other sizes, other per-rank KV
shapes), never those of another model; `committed_in` answers for an entry of such a namespace
without reading it.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.domain.chain import ChainKey
from galahad.domain.namespace import GroupKind, KVGroup, Namespace


def _ns(tp: int, pp: int = 1, *, model: str = "m", heads: int = 0) -> Namespace:
    spec = f"FullAttentionSpec(heads={heads or 4 // tp})"
    return Namespace(model=model, model_fingerprint=model * 8, dtype="float32", kv_cache_dtype="float32",
                     block_size=32, groups=(KVGroup(GroupKind.FULL, 32, 4 // pp, spec=spec),),
                     tp_size=tp, pp_size=pp)


def _open(root: Path, ns: Namespace) -> FilesystemBlockStore:
    return FilesystemBlockStore(root, ns, max_bytes=1 << 30, rescan_s=None)


def test_a_new_namespace_is_fresh_and_lists_only_other_splits_of_the_same_model(tmp_path: Path) -> None:
    key = ChainKey(bytes(range(32)))
    with _open(tmp_path, _ns(2)) as tp2:
        assert tp2.fresh and tp2.other_layouts() == []
        tp2.put(key, 0, b"part zero")
        tp2.put(key, 1, b"part one")
        assert tp2.commit(key, (0, 1))
    with _open(tmp_path, _ns(2)) as again:
        assert not again.fresh  # it holds an entry now
    with _open(tmp_path, _ns(1, model="other")) as other_model:
        assert other_model.other_layouts() == []  # another model is never listed
    with _open(tmp_path, _ns(1)) as tp1, _open(tmp_path, _ns(2, 2)) as pp2:
        assert tp1.fresh
        found = {info["tp_size"] * 10 + info["pp_size"]: digest for digest, info in tp1.other_layouts()}
        assert found == {21: _ns(2).hex, 22: _ns(2, 2).hex}
        assert tp1.committed_in(_ns(2).hex, key)
        assert not tp1.committed_in(_ns(2, 2).hex, key)
        assert not tp1.is_committed(key)  # nothing of the other layout is ever offered here
        assert {d for d, _ in pp2.other_layouts()} == {_ns(1).hex, _ns(2).hex}
        tp2_leaf = next((tmp_path / f"ns-{_ns(2).hex}").glob("??/??"))
        (tp2_leaf / f"{key.hex}.p1.blk").unlink()
        assert not tp1.committed_in(_ns(2).hex, key)  # a part missing there: not committed there


def test_namespaces_of_the_same_model_that_differ_beyond_the_split_are_not_other_layouts(
        tmp_path: Path) -> None:
    with _open(tmp_path, _ns(2)):
        pass
    bf16 = attrs.evolve(_ns(1), dtype="bfloat16")
    with _open(tmp_path, bf16) as store:
        assert store.other_layouts() == []
