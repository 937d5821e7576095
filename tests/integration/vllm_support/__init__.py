"""Helpers for the vLLM integration tests: a locally built test model and a server harness."""
