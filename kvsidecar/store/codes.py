"""Mooncake's return codes as typed values: the one place that knows the numbers."""

from __future__ import annotations

import enum
from collections.abc import Sequence

# A call that returns no count (register_buffer, put, setup) returns exactly this when it succeeded.
SUCCESS = 0


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


# Codes a second try of the same call may not get: the master did not answer within the client's RPC timeout
# (MC_RPC_TIMEOUT_MS, 5 s as the daemon sets it; Mooncake's default is 30 s), as when it is busy or paused, and nothing
# was read or written. Not transient: RPC_FAILED (-900; the master is gone, and a master that comes back has none of
# the keys, so a retry costs the wait and finds nothing), and every answer about the key itself (not found, leased,
# no space, transfer failed: the bytes could not be moved).
TRANSIENT = frozenset({StoreCode.RPC_TIMEOUT})


def from_mooncake(code: int) -> StoreCode:
    """Map a Mooncake return value (0 or bytes on success, negative on failure) to a StoreCode."""
    if code >= 0:
        return StoreCode.OK
    return _BY_NUMBER.get(code, StoreCode.INTERNAL)


class Presence(enum.Enum):
    """Result of an existence check for one key."""

    PRESENT = 1
    ABSENT = 0
    UNKNOWN = -1  # the check itself failed: never count it as a hit


# batch_is_exist() return values; anything else (-1) means the check failed.
class _PresenceOf(dict[int, Presence]):
    def __missing__(self, code: int) -> Presence:
        return Presence.UNKNOWN


_PRESENCE = _PresenceOf({1: Presence.PRESENT, 0: Presence.ABSENT})


def presence_from_mooncake(found: Sequence[int]) -> list[Presence]:
    """Map batch_is_exist() results to Presences: only 1 is PRESENT, only 0 is ABSENT."""
    # A lookup converts 10^5 codes: map over the dict's C-level lookup, not a Python loop.
    return list(map(_PRESENCE.__getitem__, found))


def presence_of_failure(code: StoreCode) -> Presence:
    """The Presence an existence check reports for a key whose check failed with code (an injected fault)."""
    return Presence.ABSENT if code is StoreCode.NOT_FOUND else Presence.UNKNOWN


class Health(enum.IntEnum):
    """health_check() return values."""

    HEALTHY = 0
    NOT_INITIALIZED = 1
    MASTER_UNREACHABLE = 2
