"""The documented SGLang module path: `galahad_vllm.sglang_backend.GalahadHiCacheStorage`.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"galahad","module_path":"galahad_vllm.sglang_backend","class_name":"GalahadHiCacheStorage"}'

A thin re-export of `galahad.adapters.sglang` (docs/sglang.md). Importing it imports SGLang.
"""

from galahad.adapters.sglang.backend import GalahadHiCacheStorage
from galahad.adapters.sglang.registration import register_sglang_backend

__all__ = ["GalahadHiCacheStorage", "register_sglang_backend"]
