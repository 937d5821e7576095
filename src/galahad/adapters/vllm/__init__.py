"""The vLLM engine adapter: `GalahadConnector` (scheduler side and worker side) and its registration.

Importing this package does no work; `registration.register_connector()` is what vLLM's plugin
entry point calls, and `connector.GalahadConnector` is loaded lazily by vLLM.
"""
