"""Every error family of the daemon, in one place; an error's message is always the reason a person reads.

- `RequestError`: a request the daemon refuses, answered to that client alone (rpc/statuses.py maps each class to
  one gRPC status): `BadRequest`, `Unauthenticated`, `UnknownSession`, `OutOfOrder`, `Forbidden`, `ShuttingDown`,
  `DeviceUnavailable` (the GPU path failed: a sticky CUDA error).
  The placement core's
  `PlacementError` (kvsidecar_contract) is answered like `BadRequest`.
- `StoreError`: a store call failed as a whole; its `code` is a store.codes.StoreCode (`StoreUnavailable`, the store
  cannot be reached at all, is the store's own: store/base.py). Failures of single keys are not errors but per-key
  codes, and a block's failure reaches the client as a reasons.Reason.
- `ConfigError`: a flag, config file, tenants file or token file that cannot be used; the daemon does not start.
- `DaemonError`: the daemon cannot start or must stop: `MasterError` (the embedded mooncake_master),
  `FenceError` (a Mooncake listener that cannot be fenced), `DiskDirBusy` (another daemon owns the disk tier),
  `NativeLibraryError` (Mooncake's native libraries).

The test machinery and the demo (kvsidecar-testing, testing/) have their own: ProcessError, RankError, WaitTimeout,
DemoError.

Imports: (nothing of the daemon's: a StoreError's code is named here for types only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsidecar.store.codes import StoreCode

__all__ = [
    "BadRequest",
    "ConfigError",
    "DaemonError",
    "DeviceUnavailable",
    "DiskDirBusy",
    "FenceError",
    "Forbidden",
    "MasterError",
    "NativeLibraryError",
    "OutOfOrder",
    "RequestError",
    "ShuttingDown",
    "Exhausted",
    "StoreError",
    "TooLate",
    "Unauthenticated",
    "UnknownSession",
]


class RequestError(Exception):
    """A request the daemon refuses; the message is the reason the client sees."""


class BadRequest(RequestError):
    """Malformed or inconsistent input."""


class Unauthenticated(RequestError):
    """Credentials that cannot be read one way only (a header sent twice) or that prove nothing."""


class UnknownSession(RequestError):
    """No such session: never opened, closed, or expired with its lease."""


class OutOfOrder(RequestError):
    """A call that needs an earlier one first (e.g. Save before RegisterMemory)."""


class Forbidden(RequestError):
    """A request outside the session's rights (e.g. a scheduler session saving)."""


class Exhausted(RequestError):
    """A bounded resource (registered bytes, sessions, memfds, tickets, side-socket slots) is used up for the
    caller's account or the daemon; the reason names the bound and its setting."""


class ShuttingDown(RequestError):
    """The daemon is stopping and takes no new work."""


class DeviceUnavailable(RequestError):
    """The daemon's GPU path cannot move this memory any more (its device hit a sticky CUDA error); the reason says
    which error, and host memory is still served."""


class TooLate(RequestError):
    """The call's deadline passed while it waited its turn (a lookup slot); it did nothing."""


class StoreError(Exception):
    """A store call failed as a whole (not per key)."""

    def __init__(self, code: StoreCode, reason: str) -> None:
        super().__init__(f"{code.value}: {reason}")
        self.code = code
        self.reason = reason


class ConfigError(ValueError):
    """A flag or config-file value that cannot be used."""


class DaemonError(RuntimeError):
    """The daemon cannot start (socket taken, master or store unavailable) or must stop."""


class MasterError(DaemonError):
    """The embedded mooncake_master cannot be found, started or reached; carries its last output lines."""

    def __init__(self, reason: str, output_tail: list[str] | None = None) -> None:
        tail = output_tail or []
        message = reason if not tail else reason + "\nlast output of mooncake_master:\n" + "\n".join(tail)
        super().__init__(message)
        self.reason = reason
        self.output_tail = tail


class FenceError(DaemonError):
    """A listener could not be fenced, or someone outside the allow-list connected before the fence was up."""


class DiskDirBusy(DaemonError):
    """The disk-tier directory is locked by another live daemon."""


class NativeLibraryError(DaemonError):
    """libibverbs, which Mooncake needs even for TCP, cannot be loaded."""
