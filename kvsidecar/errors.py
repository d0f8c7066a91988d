"""The daemon's request errors, and the one place that turns any of them into a gRPC status."""

from __future__ import annotations

import grpc

from kvsidecar.store.codes import StoreCode, StoreError
from kvsidecar_contract.placement import PlacementError


class RequestError(Exception):
    """A request the daemon refuses; the message is the reason the client sees."""

    code = grpc.StatusCode.INTERNAL


class BadRequest(RequestError):
    """Malformed or inconsistent input."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownSession(RequestError):
    """No such session: never opened, closed, or expired with its lease."""

    code = grpc.StatusCode.NOT_FOUND


class OutOfOrder(RequestError):
    """A call that needs an earlier one first (e.g. Save before RegisterMemory)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Forbidden(RequestError):
    """A request outside the session's rights (e.g. a scheduler session saving)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ShuttingDown(RequestError):
    """The daemon is stopping and takes no new work."""

    code = grpc.StatusCode.UNAVAILABLE


MAX_REASON_CHARS = 2048  # reasons may quote client input; gRPC clients refuse trailers past 16 KiB


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and reason a failed request answers with."""
    if isinstance(exc, RequestError):
        code, reason = exc.code, str(exc)
    elif isinstance(exc, PlacementError):
        code, reason = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    elif isinstance(exc, StoreError):
        # The store refusing the request's own values is the request's fault; anything else is the store's.
        bad = exc.code is StoreCode.INVALID_PARAMS
        code = grpc.StatusCode.INVALID_ARGUMENT if bad else grpc.StatusCode.UNAVAILABLE
        reason = f"store: {exc}"
    else:
        code, reason = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 20] + " ... (reason cut)"
    return code, reason
