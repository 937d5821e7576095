"""vLLM's CPU build runs the model on the same cores with Galahad attached as without it.

vLLM's CPU build binds each worker's OpenMP threads to cores it chooses at startup, and keeps
one core per worker aside for every process that is not the model: the scheduler always, and one
more when any KV connector is configured (meant for NIXL's transfers between prefill and decode
servers). With Galahad attached, the model would so run on one core fewer (on a machine of two
cores, on one core more: with nothing left to run on, vLLM reserves none). Matrix products split
over another number of threads add in another order, and in bfloat16 that rounding flips greedy
tokens of real prompts: the answers would differ with Galahad attached, before it loaded
anything. Galahad needs no core of its own (the threads it starts in a worker run on the cores
vLLM bound that worker to, beside the model's, and mostly wait on the disk or run the cipher
outside the interpreter lock), so when Galahad is the only connector configured, vLLM lays out
its cores as it does without one.

A layout the operator chose is left alone: `VLLM_CPU_NUM_OF_RESERVED_CPU` set, or
`VLLM_CPU_OMP_THREADS_BIND` naming the cores (vLLM then reserves nothing itself).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from galahad.adapters.vllm.registration import route_logs

__all__ = ["keep_cpu_cores"]

log = logging.getLogger(__name__)

_CONNECTORS = ("GalahadConnector",)


def keep_cpu_cores() -> bool:
    """Make vLLM's CPU core layout ignore a Galahad-only KV connector; True if it was installed
    now (a no-op on a vLLM without that layout, and on a second call). Runs in every vLLM
    process through the plugin entry point, before the engine starts its workers."""
    try:
        from vllm.utils import ompmultiprocessing
    except ImportError:  # a vLLM without the CPU core layout (0.26)
        return False
    manager = getattr(ompmultiprocessing, "OMPProcessManager", None)
    original = getattr(manager, "__init__", None)
    if manager is None or original is None or getattr(original, "_galahad_cores", False):
        return False

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if _galahad_only(getattr(config, "kv_transfer_config", None)) and _layout_not_chosen():
            config = _WithoutConnector(config)
            route_logs()
            log.info("[galahad] vLLM CPU: the model's OpenMP threads get the cores they get without a "
                     "KV connector (vLLM keeps one more aside per worker for any connector; Galahad "
                     "needs none, and another thread count would change the model's rounding)")
        original(self, config, *args, **kwargs)

    __init__._galahad_cores = True  # type: ignore[attr-defined]
    manager.__init__ = __init__
    return True


def _galahad_only(kv_transfer_config: Any) -> bool:
    """Whether the configured KV connector is Galahad's alone (not one child of several)."""
    return kv_transfer_config is not None and getattr(kv_transfer_config, "kv_connector", None) in _CONNECTORS


def _layout_not_chosen() -> bool:
    """True unless the operator set the reserved cores or named the cores to bind."""
    if os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "").strip():
        return False
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip() in ("", "auto")


class _WithoutConnector:
    """The engine's config as the core layout reads it: every field, no KV connector."""

    kv_transfer_config = None

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
