"""Ports: the capabilities the use cases need, as typing.Protocols with written contracts."""
