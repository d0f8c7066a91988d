"""The one table from the daemon's errors to gRPC status codes, applied at the service boundary."""

from __future__ import annotations

import logging

import grpc

from kvsidecar.errors import (
    BadRequest,
    DeviceUnavailable,
    Exhausted,
    Forbidden,
    OutOfOrder,
    RequestError,
    ShuttingDown,
    StoreError,
    TooLate,
    Unauthenticated,
    UnknownSession,
)
from kvsidecar.metrics import Metrics
from kvsidecar.store.codes import StoreCode
from kvsidecar_contract.placement import PlacementError

__all__ = ["MAX_REASON_CHARS", "SESSION_ERRORS", "STATUS_OF", "refused", "status_of"]

log = logging.getLogger("kvsidecar.rpc")

# The first class in an error's MRO that is listed decides; the client maps these codes back
# (client/kvsidecar_client/errors.py).
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PlacementError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    OutOfOrder: grpc.StatusCode.FAILED_PRECONDITION,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    DeviceUnavailable: grpc.StatusCode.UNAVAILABLE,
    Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooLate: grpc.StatusCode.DEADLINE_EXCEEDED,  # as gRPC itself answers a call whose deadline passed waiting
    RequestError: grpc.StatusCode.INTERNAL,
}

# Errors about the session or the daemon, the same for every item of a batch: they fail a SaveBatch or LoadBatch as
# a whole (with the status above); any other error of an item is that item's own, answered in its result.
SESSION_ERRORS: tuple[type[Exception], ...] = (
    Unauthenticated,
    UnknownSession,
    OutOfOrder,
    Forbidden,
    ShuttingDown,
    DeviceUnavailable,
)

MAX_REASON_CHARS = 2048  # reasons may quote client input; gRPC clients refuse trailers past 16 KiB


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and reason a failed request answers with."""
    listed = next((STATUS_OF[cls] for cls in type(exc).__mro__ if cls in STATUS_OF), None)
    if listed is not None:
        code, reason = listed, str(exc)
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


def refused(metrics: Metrics, method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """A refused call's (or batch item's) status and reason, counted per method and logged (INTERNAL with its
    traceback)."""
    code, reason = status_of(exc)
    metrics.requests_rejected.labels(method, code.name).inc()
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    else:
        log.debug("%s refused: %s: %s", method, code.name, reason)
    return code, reason
