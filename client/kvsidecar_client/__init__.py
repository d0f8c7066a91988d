"""Thin in-engine client for the kvsidecar daemon."""

__version__ = "0.1.0"
