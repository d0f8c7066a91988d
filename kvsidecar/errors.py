"""The daemon's request errors: plain exceptions whose message is the reason (statuses.py maps them to gRPC)."""

from __future__ import annotations

__all__ = ["BadRequest", "Forbidden", "OutOfOrder", "RequestError", "ShuttingDown", "UnknownSession"]


class RequestError(Exception):
    """A request the daemon refuses; the message is the reason the client sees."""


class BadRequest(RequestError):
    """Malformed or inconsistent input."""


class UnknownSession(RequestError):
    """No such session: never opened, closed, or expired with its lease."""


class OutOfOrder(RequestError):
    """A call that needs an earlier one first (e.g. Save before RegisterMemory)."""


class Forbidden(RequestError):
    """A request outside the session's rights (e.g. a scheduler session saving)."""


class ShuttingDown(RequestError):
    """The daemon is stopping and takes no new work."""
