"""Deadlines of the client's calls, in seconds; each call may override its own with `timeout=`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvsidecar_client.errors import InvalidRequest

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_CONTROL_TIMEOUT",
    "DEFAULT_LOAD_TIMEOUT",
    "DEFAULT_LOOKUP_TIMEOUT",
    "DEFAULT_REGISTER_TIMEOUT",
    "DEFAULT_SAVE_TIMEOUT",
    "Deadlines",
]

# connect() waits this long for a daemon that is still starting (a sidecar container may start after the engine).
DEFAULT_CONNECT_TIMEOUT = 30.0
# Mapping and registering tens of GiB with the store takes a while on the first session of a rank.
DEFAULT_REGISTER_TIMEOUT = 120.0
# A save's bytes must leave engine memory before the blocks are reused; give slow stores room rather than fail.
DEFAULT_SAVE_TIMEOUT = 120.0
# The scheduler waits on a lookup in its scheduling loop: past this a miss (recompute) is the better answer.
DEFAULT_LOOKUP_TIMEOUT = 5.0
DEFAULT_LOAD_TIMEOUT = 60.0
# KeepAlive, CloseSession, Stats, Reset.
DEFAULT_CONTROL_TIMEOUT = 10.0


@dataclass(frozen=True)
class Deadlines:
    """Per-kind default deadlines of one client."""

    connect: float = DEFAULT_CONNECT_TIMEOUT
    register: float = DEFAULT_REGISTER_TIMEOUT
    save: float = DEFAULT_SAVE_TIMEOUT
    lookup: float = DEFAULT_LOOKUP_TIMEOUT
    load: float = DEFAULT_LOAD_TIMEOUT
    control: float = DEFAULT_CONTROL_TIMEOUT

    def __post_init__(self) -> None:
        for name in ("connect", "register", "save", "lookup", "load", "control"):
            value = getattr(self, name)
            # NaN and inf fail here too: a deadline that never fires hangs the engine on a dead daemon.
            if not 0 < value < float("inf"):
                raise InvalidRequest(f"deadline {name} must be > 0 seconds, got {value!r}")

    @classmethod
    def from_config(cls, timeouts: Any, where: str) -> Deadlines:
        """The deadlines an engine's extra config sets (`timeouts`: seconds by kind, or None), refused with the
        reason; `where` names the config in the message."""
        timeouts = timeouts or {}
        if not isinstance(timeouts, Mapping):
            raise InvalidRequest(f"{where}: timeouts must be an object, got {timeouts!r}")
        kinds = sorted(f.name for f in fields(cls))
        bad = sorted(set(timeouts) - set(kinds))
        if bad:
            raise InvalidRequest(f"unknown timeouts {bad}; expected some of {kinds}")
        try:
            return cls(**{name: float(value) for name, value in timeouts.items()})
        except (TypeError, ValueError) as error:
            raise InvalidRequest(f"{where}: bad timeouts {dict(timeouts)!r}: {error}") from None
