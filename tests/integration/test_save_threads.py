"""GALAHAD_SAVE_THREADS: how many threads write saves at once, read through `open_cache` as an
engine adapter opens the cache (a real licence, a real store folder).

Each save thread holds the interpreter lock now and then; the engine's own thread waits for it
at every call into torch (bench/convoy.py, docs/performance.md "Twelfth session"). The setting
trades how fast saves drain for how often they take the lock from the engine. Here: that many
saves run at once, no more, and the default stays what it was (the I/O thread count).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from galahad.bootstrap import open_cache, read_settings
from galahad.domain.namespace import GroupKind, KVGroup, Namespace, PayloadOrder
from galahad.domain.rank import RankLayout
from vllm_support.licence import make_licence

NS = Namespace(model="save-threads", model_fingerprint="save-threads", dtype="float32",
               kv_cache_dtype="auto", block_size=16, groups=(KVGroup(GroupKind.FULL, 16, 1),),
               payload_order=PayloadOrder.CHUNK)


def _most_at_once(tmp_path: Path, extra: dict[str, str]) -> int:
    lic, pub = make_licence(tmp_path / "lic")
    env = {"GALAHAD_CACHE_DIR": str(tmp_path / "store"), "GALAHAD_LICENCE_FILE": lic,
           "GALAHAD_LICENCE_ISSUER_KEY": pub, "GALAHAD_IO_THREADS": "6", **extra}
    handle = open_cache(read_settings(env), NS, RankLayout())
    svc = handle.service
    assert svc is not None, handle.reason
    running, most, lock = [0], [0], threading.Lock()

    def save() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1

    try:
        for future in [svc.submit_save(save) for _ in range(12)]:
            future.result(timeout=30)
    finally:
        svc.close()
    return most[0]


def test_saves_run_at_most_save_threads_at_once(tmp_path: Path) -> None:
    assert _most_at_once(tmp_path, {"GALAHAD_SAVE_THREADS": "2"}) == 2


def test_without_the_setting_saves_get_as_many_threads_as_io(tmp_path: Path) -> None:
    assert _most_at_once(tmp_path, {}) == 6
