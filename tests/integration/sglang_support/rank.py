"""One SGLang TP rank in its own process, as SGLang runs them: its own host pool, its own backend.

Usage: python -m sglang_support.rank TP_RANK TP_SIZE PAGES WRITTEN GO  (GALAHAD_* in the environment)

Builds the rank's backend through SGLang's factory, prints `ready`, waits for the file GO (so the
ranks write at the same moment), writes the first WRITTEN of PAGES pages of one chain in batches
of 8, waits (at most 30 s) until its lookups stop changing, then reads what `batch_exists` offers
and prints one JSON object: what it wrote, found and read, and whether every page read is its own
shard, byte for byte.
"""

from __future__ import annotations

import json
import os
import sys
import time

from sglang_support import harness, load_sglang


def main(tp_rank: int, tp_size: int, pages: int, written: int, go: str) -> int:
    load_sglang()
    import torch
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = harness.make_pool("mha", "page_first", capacity=2 * pages * 16)
    harness.fill_random(pool, seed=1000 + tp_rank)
    config = harness.storage_config(tp_rank=tp_rank, tp_size=tp_size, extra={"galahad_io_lanes": 2})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    keys = harness.page_keys(list(range(pages * 16)), 16)
    src = pool.alloc(pages * 16)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    ok: list[bool] = []
    for i in range(0, written, 8):
        ok += backend.batch_set_v1(keys[i : min(i + 8, written)], src[i * 16 : min(i + 8, written) * 16])
    found, deadline = -1, time.monotonic() + 30
    while time.monotonic() < deadline:  # the other rank may still be writing
        now = backend.batch_exists(keys)
        if now == found and now >= 0:
            break
        found = now
        time.sleep(0.5)
    dst = pool.alloc(pages * 16)
    got = backend.batch_get_v1(keys[:found], dst[: found * 16]) if found else []
    identical = [torch.equal(pool.get_data_page(int(src[i * 16]), flat=True).view(torch.uint8),
                             pool.get_data_page(int(dst[i * 16]), flat=True).view(torch.uint8))
                 for i in range(found)]
    counts = backend.counters()
    print(json.dumps({"rank": tp_rank, "written": ok, "found": found, "read": got, "identical": identical,
                      "errors": counts["errors"], "timeouts": counts["timeouts"]}), flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:5]), sys.argv[5]))
