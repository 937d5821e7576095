"""`galahad_vllm`: the documented alias package (vLLM plugin entry point, SGLang backend path)."""

__all__: list[str] = []
