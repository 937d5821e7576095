"""`kv_connector_module_path: "galahad_vllm.connector"` resolves `GalahadConnector` here."""

from galahad.adapters.vllm.connector import GalahadConnector

__all__ = ["GalahadConnector"]
