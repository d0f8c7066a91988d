"""The sections of `kvsidecar serve --help`, and `setting`: a Config field that is also a flag in one of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any, NamedTuple

__all__ = [
    "DISK_TIER",
    "EVENTS",
    "FLAG_GROUPS",
    "GPU",
    "LIMITS",
    "LOGGING",
    "SOCKETS",
    "STORE",
    "TENANCY",
    "FlagGroup",
    "setting",
]


class FlagGroup(NamedTuple):
    """A section of `kvsidecar serve --help`."""

    title: str
    description: str


SOCKETS = FlagGroup("sockets", "where engines and tools reach the daemon: its Unix socket and an optional TCP listener")
STORE = FlagGroup("store", "the Mooncake master (embedded, or a cluster's) and this node's Mooncake client")
DISK_TIER = FlagGroup("disk tier", "a disk behind the segment, the daemon's own (docs/ssd-tier.md)")
TENANCY = FlagGroup("tenancy", "who may use which cache prefixes, and what local accounts are trusted with")
LIMITS = FlagGroup("limits", "what one account and all of them together may hold, and the daemon's threads")
EVENTS = FlagGroup("events", "KV events for prefix-aware routers (docs/kv-events.md)")
GPU = FlagGroup("gpu", "the GPU data path on a node with an NVIDIA driver (a CPU node never starts CUDA)")
LOGGING = FlagGroup("logging and metrics", "the daemon's log and its Prometheus endpoint")
# The order of `serve --help`.
FLAG_GROUPS = (SOCKETS, STORE, GPU, DISK_TIER, TENANCY, LIMITS, EVENTS, LOGGING)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: FlagGroup,
    parse: Callable[[str], Any] = str,
    repeatable: bool = False,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A Config field that is also a flag: its help text, its section of `serve --help`, how a flag's text becomes
    its value, and whether the flag may be given several times (then the value is a tuple, and a config file gives a
    list)."""
    metadata = {"help": help, "group": group, "parse": parse, "repeatable": repeatable}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)
