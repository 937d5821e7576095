"""Registering `GalahadConnector` with vLLM's connector factory (the plugin entry point's work)."""

from __future__ import annotations

import logging

__all__ = ["CONNECTOR_NAME", "register_connector", "route_logs"]

CONNECTOR_NAME = "GalahadConnector"


def register_connector() -> None:
    """Register `GalahadConnector` once per process; a second call is a no-op.

    Imports only vLLM's factory (light); the connector module is loaded lazily by vLLM when a
    `--kv-transfer-config` names it. Also keeps vLLM's CPU build on the cores it uses without a
    connector (`cores.py`).
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from galahad.adapters.vllm.cores import keep_cpu_cores

    keep_cpu_cores()

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "galahad.adapters.vllm.connector", "GalahadConnector"
        )
    except ValueError:  # registered concurrently: register_connector refuses duplicates
        pass


def route_logs() -> None:
    """Send `galahad.*` log records through vLLM's handlers (vLLM configures only its own logger)."""
    ours, theirs = logging.getLogger("galahad"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO if ours.level == logging.NOTSET else ours.level)
    ours.propagate = False
