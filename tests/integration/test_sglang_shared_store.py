"""SGLang's Galahad backend on a store shared through a real distributed filesystem (GlusterFS):
pages one node wrote through its mount are read back, identical, by a new process on another
node's mount (SGLang 0.5.23's real classes; gluster_support.py makes the volume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gluster_support import GlusterVolume, volume  # noqa: F401 - the fixture
from sglang_support import harness
from sglang_support.fixtures import backends, galahad_settings, sgl  # noqa: F401 - fixtures

pytestmark = [pytest.mark.sglang, pytest.mark.gluster]


def test_pages_one_node_wrote_are_read_back_identical_by_a_new_process_on_another_nodes_mount(
        sgl: Any, backends: Any, volume: GlusterVolume, galahad_settings: dict[str, str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    a_store, b_store = (mount / f"sglang-{tmp_path.name}" for mount in volume.mounts[:2])
    monkeypatch.setenv("GALAHAD_CACHE_DIR", str(a_store))  # this process is node A
    cases = []
    tokens = list(range(2000, 2000 + 6 * 16))
    for n, kind in enumerate(("mha", "mla")):
        pool = harness.make_pool(kind, "page_first")
        harness.fill_random(pool, seed=40 + n)
        backend = backends(pool, mla=kind == "mla")
        keys = harness.page_keys([t + n for t in tokens], pool.page_size)
        indices = pool.alloc(len(keys) * pool.page_size)
        assert harness.backup(harness.controller(backend, pool), keys, indices, zero_copy=n == 0) == len(tokens)
        expected = tmp_path / f"{kind}.pt"
        torch.save(harness.flat_pages(pool, indices, len(keys)), expected)
        cases.append({"name": kind, "kind": kind, "layout": "page_first", "keys": keys, "expected": str(expected),
                      "interface": "legacy" if n == 0 else "v1"})
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "GALAHAD_CACHE_DIR": str(b_store),  # node B: the same store through its own mount
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "sglang_support.reader", str(spec)], env=env,
                         capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "fuse.glusterfs, a shared network filesystem" in run.stderr
    results = {r["case"]: r for r in map(json.loads, run.stdout.strip().splitlines())}
    assert sorted(results) == ["mha", "mla"]
    for name, r in results.items():
        assert r["pages_read"] == 6 and all(r["identical"]), name
        assert r["counters"]["errors"] == 0 and r["counters"]["store_load_failures"] == 0, name
