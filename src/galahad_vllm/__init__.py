"""`galahad_vllm`: the documented alias package (vLLM plugin entry point, SGLang backend path).

Importing it does no work: vLLM loads the `register` entry point in every process (the API
frontend included), so everything heavy is imported inside the functions.
"""

__all__ = ["register"]


def register() -> None:
    """vLLM `general_plugins` entry point: register `GalahadConnector` once per process."""
    from galahad.adapters.vllm.registration import register_connector

    register_connector()
