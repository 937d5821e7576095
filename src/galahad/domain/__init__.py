"""The domain: pure values and rules (stdlib and attrs only, no I/O)."""
