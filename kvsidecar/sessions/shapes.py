"""The shape of the values each key namespace holds, as this daemon's live rank sessions registered them.

A value's bytes are a group's regions in registration order, and the key says what they mean (docs/values.md).
Ranks that share a namespace (a replication set, or two engines with one value identity) must therefore register
the same piece sizes in the same order; a rank that registers another shape under a namespace a live session
already fills would store or be served bytes laid out otherwise. This is the part of a value's meaning the
daemon can see for itself (the scheduler, which shares the keys, has no regions): checked across the sessions of
this daemon, so a client whose identity misses a difference is refused here instead of served wrong bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvsidecar.errors import BadRequest

__all__ = ["ValueShapes"]


class ValueShapes:
    """Namespace prefix -> (piece sizes of its values, the live sessions that registered them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shapes: dict[str, tuple[tuple[int, ...], set[str]]] = {}

    def claim(self, session_id: str, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Record (namespace, piece sizes) for each group of a session, or raise BadRequest on a different shape."""
        with self._lock:
            for prefix, shape in shapes:
                known = self._shapes.get(prefix)
                if known is not None and known[0] != shape:
                    group = prefix.rsplit(".g", 1)[-1]
                    raise BadRequest(
                        f"group {group}: another live session stores values under this namespace as pieces of "
                        f"{_sizes(known[0])} bytes, this registration's are {_sizes(shape)}: their bytes would mean "
                        "different things under one key; engines laid out differently need different value "
                        "identities (docs/values.md)"
                    )
            for prefix, shape in shapes:
                self._shapes.setdefault(prefix, (shape, set()))[1].add(session_id)

    def release(self, session_id: str) -> None:
        """Forget a session's claims; a namespace no live session fills takes any shape again."""
        with self._lock:
            for prefix in [p for p, (_, owners) in self._shapes.items() if session_id in owners]:
                owners = self._shapes[prefix][1]
                owners.discard(session_id)
                if not owners:
                    del self._shapes[prefix]


def _sizes(shape: tuple[int, ...]) -> str:
    text = str(list(shape[:8]))
    return text if len(shape) <= 8 else f"{text[:-1]}, ... ({len(shape)} pieces)]"
