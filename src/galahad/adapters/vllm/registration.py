"""Registering `GalahadConnector` with vLLM's connector factory (the plugin entry point's work)."""

from __future__ import annotations

__all__ = ["CONNECTOR_NAME", "register_connector"]

CONNECTOR_NAME = "GalahadConnector"


def register_connector() -> None:
    """Register `GalahadConnector` once per process; a second call is a no-op.

    Imports only vLLM's factory (light); the connector module is loaded lazily by vLLM when a
    `--kv-transfer-config` names it.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "galahad.adapters.vllm.connector", "GalahadConnector"
        )
    except ValueError:  # registered concurrently: register_connector refuses duplicates
        pass
