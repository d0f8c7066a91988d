"""Mooncake's return codes as typed values: the one place that knows the numbers."""

from __future__ import annotations

import enum


class StoreCode(enum.Enum):
    """Outcome of one key in a store call; the value is the label used in metrics."""

    OK = "ok"
    NOT_FOUND = "not_found"  # -704
    NO_SPACE = "no_space"  # -200
    EXISTS = "exists"  # -705
    LEASED = "leased"  # -706
    LEASE_EXPIRED = "lease_expired"  # -707
    TRANSFER_FAILED = "transfer_failed"  # -800
    RPC_FAILED = "rpc_failed"  # -900
    RPC_TIMEOUT = "rpc_timeout"  # -901
    SEGMENT_NOT_FOUND = "segment_not_found"  # -101
    INVALID_PARAMS = "invalid_params"  # -600
    SIZE_MISMATCH = "size_mismatch"  # a get returned another number of bytes than the value's size
    UNAVAILABLE = "unavailable"  # the store is closed or the master unreachable
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the client gave up before the value was safely written
    INTERNAL = "internal"  # -1 and any code not listed here


_BY_NUMBER: dict[int, StoreCode] = {
    -1: StoreCode.INTERNAL,
    -101: StoreCode.SEGMENT_NOT_FOUND,
    -200: StoreCode.NO_SPACE,
    -600: StoreCode.INVALID_PARAMS,
    -704: StoreCode.NOT_FOUND,
    -705: StoreCode.EXISTS,
    -706: StoreCode.LEASED,
    -707: StoreCode.LEASE_EXPIRED,
    -800: StoreCode.TRANSFER_FAILED,
    -900: StoreCode.RPC_FAILED,
    -901: StoreCode.RPC_TIMEOUT,
}


def from_mooncake(code: int) -> StoreCode:
    """Map a Mooncake return value (0 or bytes on success, negative on failure) to a StoreCode."""
    if code >= 0:
        return StoreCode.OK
    return _BY_NUMBER.get(code, StoreCode.INTERNAL)


class StoreError(Exception):
    """A store call failed as a whole (not per key)."""

    def __init__(self, code: StoreCode, reason: str) -> None:
        super().__init__(f"{code.value}: {reason}")
        self.code = code
        self.reason = reason


class StoreUnavailable(StoreError):
    """The store cannot be reached (closed, master down, setup failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(StoreCode.UNAVAILABLE, reason)
