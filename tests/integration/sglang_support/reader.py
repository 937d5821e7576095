"""The "after a restart" half of the restart test: a new process, new pools, a new backend.

Usage: python -m sglang_support.reader CASES.json  (GALAHAD_* in the environment)

For each case (pool kind, layout, page keys, a file of the expected flat pages) it builds a
fresh SGLang host pool and a backend through SGLang's factory, asks `batch_exists` for the
whole chain and for the chain with a foreign key in the middle, reads the pages through
`HiCacheController._page_get_zero_copy` (or `_generic_page_get`), and compares every byte.
Prints one JSON object per case.
"""

from __future__ import annotations

import json
import sys

from sglang_support import harness, load_sglang


def main(path: str) -> int:
    load_sglang()
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    with open(path) as handle:
        cases = json.load(handle)
    for case in cases:
        pool = harness.make_pool(case["kind"], case["layout"])
        config = harness.storage_config(mla=case["kind"] == "mla", extra=case.get("extra"))
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)
        keys = case["keys"]
        foreign = keys[:2] + ["f" * 64] + keys[3:]
        exists = [backend.batch_exists(keys), backend.batch_exists(foreign), backend.batch_exists(keys[1:])]
        indices = pool.alloc(len(keys) * pool.page_size)
        ctl = harness.controller(backend, pool)
        getter = (HiCacheController._page_get_zero_copy if case["interface"] == "v1"
                  else HiCacheController._generic_page_get)
        got = getter(ctl, harness.operation(), keys, indices)
        expected = torch.load(case["expected"])
        identical = [
            torch.equal(pool.get_data_page(int(indices[i * pool.page_size]), flat=True).view(torch.uint8),
                        expected[i])
            for i in range(len(keys))
        ]
        print(json.dumps({"case": case["name"], "exists": exists, "pages_read": got,
                          "identical": identical, "counters": backend.counters()}, default=str))
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
