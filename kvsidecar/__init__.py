"""kvsidecar: the node-local KV-cache store daemon."""

__version__ = "0.1.0"
