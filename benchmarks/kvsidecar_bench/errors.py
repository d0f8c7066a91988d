"""The bench's one error."""

__all__ = ["BenchError"]


class BenchError(RuntimeError):
    """The bench cannot go on (a process did not start, a path moved the wrong bytes)."""
