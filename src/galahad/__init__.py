"""Galahad: a durable, encrypted, verified disk tier for LLM prompt memory (the KV cache)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
