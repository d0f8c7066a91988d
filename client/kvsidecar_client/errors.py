"""The client's exception hierarchy, and the one place that maps gRPC status codes back into it.

    SidecarError
    ├── InvalidRequest      (also a ValueError) INVALID_ARGUMENT, OUT_OF_RANGE, and bad input caught locally
    ├── SessionLost         NOT_FOUND: the daemon forgot the session (lease expired, daemon restarted)
    ├── DaemonUnavailable   UNAVAILABLE, CANCELLED, connection failures
    │   └── DeadlineExceeded  DEADLINE_EXCEEDED: the call ran past its deadline
    ├── PreconditionFailed  FAILED_PRECONDITION, ALREADY_EXISTS, ABORTED: a call out of order
    ├── PermissionDenied    PERMISSION_DENIED, UNAUTHENTICATED
    ├── ResourceExhausted   RESOURCE_EXHAUSTED: e.g. a message over the size limit
    │   └── SharedMemoryFull  /dev/shm cannot hold a shared tensor (raised locally, before any daemon call)
    ├── Unsupported         UNIMPLEMENTED: the daemon does not speak this call (version skew)
    ├── DaemonError         INTERNAL, UNKNOWN, DATA_LOSS: a fault inside the daemon
    └── ClientClosed        the client was closed before or during the call

Every exception keeps the daemon's reason text (`reason`), the status code (`code`, None for local errors) and the
RPC it came from (`method`).
"""

from __future__ import annotations

import grpc

__all__ = [
    "ClientClosed",
    "DaemonError",
    "DaemonUnavailable",
    "DeadlineExceeded",
    "InvalidRequest",
    "PermissionDenied",
    "PreconditionFailed",
    "ResourceExhausted",
    "SessionLost",
    "SharedMemoryFull",
    "SidecarError",
    "Unsupported",
    "from_rpc_error",
]


class SidecarError(Exception):
    """Base of every error the client raises."""

    def __init__(self, reason: str, *, code: grpc.StatusCode | None = None, method: str = "") -> None:
        self.reason = reason
        self.code = code
        self.method = method
        super().__init__(reason)

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        code = f" [{self.code.name}]" if self.code is not None else ""
        return f"{where}{self.reason}{code}"


class InvalidRequest(SidecarError, ValueError):
    """Malformed or inconsistent input, refused by the client or by the daemon."""


class SessionLost(SidecarError):
    """The daemon no longer knows the session; the client re-opens it on its own."""


class DaemonUnavailable(SidecarError):
    """The daemon cannot be reached (down, restarting, shutting down)."""


class DeadlineExceeded(DaemonUnavailable):
    """The call did not finish within its deadline."""


class PreconditionFailed(SidecarError):
    """A call out of order, e.g. a save before register or a second register."""


class PermissionDenied(SidecarError):
    """A request outside the session's rights."""


class ResourceExhausted(SidecarError):
    """The daemon refused a request for its size or for lack of resources."""


class SharedMemoryFull(ResourceExhausted):
    """/dev/shm has less room than a shared tensor (e.g. vLLM CPU's KV cache) needs."""


class Unsupported(SidecarError):
    """The daemon does not implement this call."""


class DaemonError(SidecarError):
    """A fault inside the daemon; the reason says what."""


class ClientClosed(SidecarError):
    """The client was closed."""


# The table is total over grpc.StatusCode (minus OK): a test pins that, so a new code cannot slip through as a bare
# RpcError that the engine does not know how to handle.
STATUS_ERRORS: dict[grpc.StatusCode, type[SidecarError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: SessionLost,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.CANCELLED: DaemonUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: PreconditionFailed,
    grpc.StatusCode.ALREADY_EXISTS: PreconditionFailed,
    grpc.StatusCode.ABORTED: PreconditionFailed,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNIMPLEMENTED: Unsupported,
    grpc.StatusCode.INTERNAL: DaemonError,
    grpc.StatusCode.UNKNOWN: DaemonError,
    grpc.StatusCode.DATA_LOSS: DaemonError,
}


def error_for_status(code: grpc.StatusCode, reason: str, method: str = "") -> SidecarError:
    """The client exception for one gRPC status code, keeping the daemon's reason."""
    cls = STATUS_ERRORS.get(code, DaemonError)
    return cls(reason or code.name.lower().replace("_", " "), code=code, method=method)


def from_rpc_error(error: grpc.RpcError, method: str = "") -> SidecarError:
    """Map a failed call (a grpc.RpcError that is also a grpc.Call) into the client hierarchy."""
    code_of = getattr(error, "code", None)
    details_of = getattr(error, "details", None)
    code = code_of() if callable(code_of) else None
    reason = details_of() if callable(details_of) else None
    if not isinstance(code, grpc.StatusCode):
        # An RpcError without a status: the channel itself failed before any call could be made.
        return DaemonUnavailable(str(error) or "the connection to the daemon failed", method=method)
    return error_for_status(code, reason or "", method)
