"""Saves queued when the serving process exits: a clean, quick end, and nothing damaged.

A vLLM worker hands its saves to the service's save threads. When the process ends with saves
still queued (a server stopped under load), `concurrent.futures` stops every pool's idle threads
while the save threads still work, and those pools refuse new tasks ("cannot schedule new
futures after shutdown"): a queued save would fail in its frame pool and log a traceback, a
hundred and more after `bench/gpu.py`'s multi-turn runs on an H200. Its entry could not be
committed anyway: only the scheduler's next steps commit, and there are none. So a save not
started is dropped (counted, said once), one already started finishes, and every part left in
the store verifies. A real worker, service and filesystem store on the CPU, in a process that
really exits; no engine (vLLM's own shutdown is not involved: this is the interpreter's exit).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

_SCRIPT = r"""
import logging, sys, threading
from pathlib import Path
from types import SimpleNamespace

import torch

from galahad.adapters.fs.store import FilesystemBlockStore
from galahad.adapters.vllm.metadata import EntryRef, GalahadMetadata, SaveJob
from galahad.adapters.vllm.worker import GalahadWorker
from galahad.format.codec import cipher_lookup
from galahad.domain.chunking import Chunking
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from galahad.format.checksum import Xxh3FrameCheck
from galahad.app.service import KVCacheService

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
BLOCK, LAYERS, CHUNKS = 16, 2, 12
root = Path(sys.argv[1])
ns = Namespace(model="exit", model_fingerprint="exit", dtype="float32", kv_cache_dtype="auto",
               block_size=BLOCK, groups=(KVGroup(GroupKind.FULL, BLOCK, 1),), payload_order=PayloadOrder.CHUNK)
check = Xxh3FrameCheck()
svc = KVCacheService(namespace=ns, store=FilesystemBlockStore(root, ns, rescan_s=None),
                     chunking=Chunking(PayloadOrder.CHUNK, BLOCK), layout=RankLayout(), cipher=check,
                     ciphers=cipher_lookup(check), io_threads=1)
names = [f"layer.{i}" for i in range(LAYERS)]
config = SimpleNamespace(num_blocks=CHUNKS * 4, kv_cache_groups=[SimpleNamespace(layer_names=names)])
# 1 MiB a block and layer: a part (4 blocks, 2 layers) is 8 MiB, two 4 MiB frames sealed on the frame pool
caches = {n: torch.randn(CHUNKS * 4, 2, BLOCK, 8192) for n in names}
tokens = [(i * 7919) % 30000 for i in range(CHUNKS * 64 + 1)]
keys = svc.keys(tokens, svc.seed())
entries = [EntryRef(keys[svc.chunking.key_index(s.end)].raw, s.start, s.end,
                    (tuple(range(s.start // BLOCK, s.end // BLOCK)),)) for s in svc.chunking.save_spans(CHUNKS * 64)]
worker = GalahadWorker(svc, 0, RankLayout(), config, BLOCK)
worker.register(caches)
worker.save_delay = (0.3, None)  # each save waits this long before writing (a slow disk): the first
# is still waiting when the exit stops the pools, then seals its frames in its own thread
meta = GalahadMetadata()
meta.saves.append(SaveJob("r", tuple(entries)))
# the one save thread holds off until every save is queued: copying twelve entries out takes long
# enough on a loaded machine for the first saves to be written before the main thread ends
queued = threading.Event()
svc.submit_save(queued.wait)
worker.save(meta)
print("queued", len(entries), flush=True)
queued.set()
# the main thread ends here, the service never closed: the interpreter's exit, saves queued
"""


def test_saves_queued_at_exit_end_cleanly_and_leave_only_whole_parts(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(root)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "queued 12" in out.stdout
    assert "Traceback" not in out.stderr and "failed" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("stopping; saves not yet written are dropped") == 1, out.stderr[-3000:]
    # every part the exit left is whole: the format's own check passes on the store
    parts = [p for p in root.rglob("*") if p.is_file() and p.name.endswith(".blk")]
    assert len(parts) < 12  # some were dropped, not written during the exit
    verify = subprocess.run([sys.executable, "-m", "galahad.cli.format", "verify", str(root)],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]


def test_a_worker_shutting_down_drops_the_saves_it_has_not_started(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """vLLM's shutdown (`GalahadConnector.shutdown` calls `stop_saving`, then closes the service,
    which waits for its save threads): queued saves are dropped, counted, said once; the stop
    does not wait for them to be written."""
    import logging
    import time

    from galahad.adapters.vllm.metadata import GalahadMetadata, SaveJob
    from test_vllm_save_backlog import saving_worker

    root = tmp_path / "store"
    svc, worker, entries = saving_worker(root, io_threads=1)
    chunks = len(entries)
    worker.saver.delay = (0.5, None)  # each save waits before writing: the queue is still full at the stop
    meta = GalahadMetadata()
    meta.saves.append(SaveJob("r", tuple(entries)))
    with caplog.at_level(logging.INFO, logger="galahad"):
        worker.save(meta)
        time.sleep(0.1)
        t0 = time.monotonic()
        worker.stop_saving()
        svc.close()
        took = time.monotonic() - t0
    assert took < 2.0  # the first save's wait, not twelve of them
    acks = worker.saver.take_acks()
    assert sorted(key for key, _ok in acks) == sorted(e.key for e in entries)  # each acknowledged
    written = [key for key, ok in acks if ok]
    assert len(written) <= 1  # at most the one already waiting to write when the stop came, whole
    assert svc.counters.saves_skipped == chunks - len(written) and svc.counters.saves == len(written)
    assert svc.counters.skipped == {"exit": chunks - len(written)}
    assert len(list(root.rglob("*.blk"))) == len(written)
    assert sum("stopping; saves not yet written are dropped" in r.getMessage() for r in caplog.records) == 1
