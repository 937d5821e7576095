"""The public API (`galahad.api`) as a custom serving stack uses it: a real store on disk, real
keys and licences, real damaged bytes; and the docs example (examples/embed_transformers.py), a
`transformers` generation loop in separate processes, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from galahad import KVLayout, KVStore, LoadResult  # noqa: E402
from vllm_support.licence import make_licence  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "embed_transformers.py"
LAYOUT = KVLayout(model="api-test", fingerprint="weights-1", num_layers=3, kv_heads=2, head_dim=8, dtype="bfloat16")
TOKENS = list(range(1000, 1300))  # 300 tokens: four 64-token pieces stored (256), one token left


def _kv(n: int, seed: int = 0, layout: KVLayout = LAYOUT) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.kv_heads, n, layout.head_dim)
    return [(torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype)),
             torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype))) for _ in range(layout.num_layers)]


@pytest.fixture
def licence(tmp_path: Path) -> tuple[str, str]:
    return make_licence(tmp_path / "lic")


def _open(tmp_path: Path, licence: tuple[str, str], layout: KVLayout = LAYOUT, **options: Any) -> KVStore:
    options.setdefault("key_file", str(tmp_path / "store.key"))
    return KVStore.open(tmp_path / "store", layout, licence_file=licence[0], issuer_key=licence[1], **options)


def _parts(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "store").rglob("*.blk") if p.is_file())


def test_saved_kv_loads_back_exactly_in_another_store_object(tmp_path: Path, licence: tuple[str, str]) -> None:
    kv = _kv(len(TOKENS))
    with _open(tmp_path, licence) as store:
        assert store.enabled and store.reason == ""
        assert store.lookup(TOKENS) == 0
        assert store.save(TOKENS, kv) == 256
        assert store.save(TOKENS, kv) == 256  # already stored: nothing written again
        assert store.stats()["saves"] == 4
    with _open(tmp_path, licence) as again:
        assert again.lookup(TOKENS) == 256 and again.lookup(TOKENS[:200]) == 192
        assert again.lookup(TOKENS[1:]) == 0  # another beginning: another prompt
        out = again.empty_kv(len(TOKENS))
        assert again.load(TOKENS, out) == LoadResult(256, "")
        for (k, v), (k0, v0) in zip(out, kv):
            assert torch.equal(k[:, :256], k0[:, :256]) and torch.equal(v[:, :256], v0[:, :256])
            assert not k[:, 256:].any()  # nothing past the stored prefix is written
        stats = again.stats()
        assert stats["hits_disk"] == 1 and stats["tokens_loaded"] == 256 and stats["load_failures"] == 0


def test_a_salt_keeps_tenants_apart(tmp_path: Path, licence: tuple[str, str]) -> None:
    with _open(tmp_path, licence) as store:
        assert store.save(TOKENS, _kv(len(TOKENS)), salt="tenant-a") == 256
        assert store.lookup(TOKENS, salt="tenant-a") == 256
        assert store.lookup(TOKENS, salt="tenant-b") == 0 and store.lookup(TOKENS) == 0


@pytest.mark.parametrize("mistake", ["layers", "dtype", "heads", "uneven", "too_small", "not_a_tensor"])
def test_a_callers_mistake_raises_value_error_and_the_entry_stays_loadable(
        tmp_path: Path, licence: tuple[str, str], mistake: str) -> None:
    with _open(tmp_path, licence) as store:
        store.save(TOKENS, _kv(len(TOKENS)))
        out = store.empty_kv(len(TOKENS))
        bad: list[Any] = {
            "layers": out[:2],
            "dtype": [(k.float(), v.float()) for k, v in out],
            "heads": [(k[:1], v[:1]) for k, v in out],
            "uneven": [(k, v[:, :10]) for k, v in out],
            "too_small": store.empty_kv(100),  # a buffer too small never costs the entry
            "not_a_tensor": [(k.float().numpy(), v) for k, v in out],
        }[mistake]
        with pytest.raises(ValueError):
            store.load(TOKENS, bad)
        with pytest.raises(ValueError):
            store.save(TOKENS, bad if mistake != "too_small" else _kv(len(TOKENS) + 5))
        assert store.stats()["quarantined"] == 0
        assert store.load(TOKENS, out) == LoadResult(256, "")


def test_another_layout_or_fingerprint_is_a_miss_never_a_refusal(tmp_path: Path, licence: tuple[str, str]) -> None:
    with _open(tmp_path, licence) as store:
        store.save(TOKENS, _kv(len(TOKENS)))
    for other in (KVLayout(model="api-test", fingerprint="weights-2", num_layers=3, kv_heads=2, head_dim=8,
                           dtype="bfloat16"),
                  KVLayout(model="api-test", fingerprint="weights-1", num_layers=3, kv_heads=2, head_dim=8,
                           dtype="float16")):
        with _open(tmp_path, licence, other) as store:
            assert store.load(TOKENS, store.empty_kv(len(TOKENS))) == LoadResult(0, "miss")
            assert store.stats()["quarantined"] == 0


def test_a_damaged_piece_ends_the_load_there_and_is_set_aside(tmp_path: Path, licence: tuple[str, str]) -> None:
    kv = _kv(len(TOKENS))
    with _open(tmp_path, licence) as store:
        store.save(TOKENS, kv)
    parts = _parts(tmp_path)
    assert len(parts) == 4
    third = sorted(parts, key=lambda p: p.stat().st_mtime_ns)[2]  # the pieces are written in order
    data = bytearray(third.read_bytes())
    data[len(data) // 2] ^= 0x40
    third.write_bytes(data)
    with _open(tmp_path, licence) as store:
        out = store.empty_kv(len(TOKENS))
        assert store.load(TOKENS, out) == LoadResult(128, "damaged")
        assert torch.equal(out[0][0][:, :128], kv[0][0][:, :128]) and not out[0][0][:, 128:].any()
        assert store.stats()["quarantined"] == 1 and store.lookup(TOKENS) == 128
        assert store.save(TOKENS, kv) == 256  # saved again, whole
        assert store.load(TOKENS, store.empty_kv(len(TOKENS))) == LoadResult(256, "")


def test_another_key_is_a_miss_with_its_reason_and_the_entry_is_kept(tmp_path: Path, licence: tuple[str, str]) -> None:
    with _open(tmp_path, licence) as store:
        store.save(TOKENS, _kv(len(TOKENS)))
    with _open(tmp_path, licence, key_file=str(tmp_path / "other.key")) as store:
        assert store.load(TOKENS, store.empty_kv(len(TOKENS))).tokens == 0
        assert store.stats()["quarantined"] == 0
    with _open(tmp_path, licence) as store:  # the right key finds it again
        assert store.lookup(TOKENS) == 256


def test_without_a_licence_every_call_is_a_miss_and_says_why(tmp_path: Path) -> None:
    with KVStore.open(tmp_path / "store", LAYOUT) as store:
        assert not store.enabled and "licence" in store.reason
        assert store.lookup(TOKENS) == 0 and store.save(TOKENS, _kv(len(TOKENS))) == 0
        assert store.load(TOKENS, store.empty_kv(len(TOKENS))) == LoadResult(0, "disabled")
    assert not _parts(tmp_path)


def test_bad_layouts_and_options_raise_value_error(tmp_path: Path) -> None:
    for bad in (dict(dtype="int8"), dict(num_layers=0), dict(align=48), dict(tp_rank=2, tp_size=2), dict(fingerprint="")):
        with pytest.raises(ValueError):
            KVLayout(**{**dict(model="m", fingerprint="f", num_layers=1, kv_heads=1, head_dim=1, dtype="float32"), **bad})
    with pytest.raises(ValueError):
        KVStore.open(tmp_path, LAYOUT, key_file="a", key_command="b")


def test_several_threads_save_and_load_at_once(tmp_path: Path, licence: tuple[str, str]) -> None:
    prompts = [[t + 5000 * i for t in TOKENS] for i in range(4)]
    kvs = [_kv(len(TOKENS), seed=i) for i in range(4)]
    failures: list[BaseException] = []
    with _open(tmp_path, licence) as store:
        def work(i: int) -> None:
            try:
                assert store.save(prompts[i], kvs[i]) == 256
                out = store.empty_kv(len(TOKENS))
                assert store.load(prompts[i], out) == LoadResult(256, "")
                assert torch.equal(out[1][1][:, :256], kvs[i][1][1][:, :256])
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, failures


def test_two_ranks_commit_an_entry_only_once_both_parts_are_stored(tmp_path: Path) -> None:
    licence = make_licence(tmp_path / "lic2", points=2)  # a point per rank
    ranks = [KVLayout(model="tp", fingerprint="w", num_layers=2, kv_heads=1, head_dim=8, dtype="float32",
                      tp_rank=r, tp_size=2) for r in (0, 1)]
    kv = [_kv(len(TOKENS), seed=r, layout=ranks[r]) for r in (0, 1)]
    first, second = (_open(tmp_path, licence, layout) for layout in ranks)
    try:
        assert first.save(TOKENS, kv[0]) == 0  # its part alone commits nothing
        assert second.lookup(TOKENS) == 0
        assert second.save(TOKENS, kv[1]) == 256
        for r, store in enumerate((first, second)):
            out = store.empty_kv(len(TOKENS))
            assert store.load(TOKENS, out) == LoadResult(256, "")
            assert torch.equal(out[0][0][:, :256], kv[r][0][0][:, :256])
    finally:
        first.close()
        second.close()


# ---------------------------------------------------------------- the docs example, as a user runs it


def _example(tmp_path: Path, licence: tuple[str, str], *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path / "store"), "--licence", licence[0], "--issuer-key", licence[1],
         "--key-file", str(tmp_path / "store.key"), "--model", str(tmp_path / "model"), *extra],
        capture_output=True, text=True, timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("GALAHAD_")})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_embedding_example_restarts_warm_with_identical_tokens(tmp_path: Path, licence: tuple[str, str]) -> None:
    reference = _example(tmp_path, licence, "--no-cache")
    first = _example(tmp_path, licence)  # computes the prompt, saves it
    second = _example(tmp_path, licence)  # another process: loads the stored prefix
    assert (first["loaded"], first["reason"]) == (0, "miss")
    assert (second["loaded"], second["reason"]) == (256, "")
    assert first["tokens"] == second["tokens"] == reference["tokens"]
    # negative control: the same load with the KV negated gives other tokens
    assert _example(tmp_path, licence, "--perturb")["tokens"] != reference["tokens"]
    # a damaged piece: the load stops before it, the rest is computed, the tokens are the same
    first_piece = min(_parts(tmp_path), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(first_piece.read_bytes())
    data[-100] ^= 0x01
    first_piece.write_bytes(data)
    damaged = _example(tmp_path, licence)
    assert (damaged["loaded"], damaged["reason"]) == (0, "damaged")
    assert damaged["tokens"] == reference["tokens"]
    assert _example(tmp_path, licence)["loaded"] == 256  # saved again by the run before
