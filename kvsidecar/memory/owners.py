"""Which session maps which memory: a session may only register memory no other live session has."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvsidecar.errors import Forbidden

if TYPE_CHECKING:
    from kvsidecar.memory.regions import SessionMemory

__all__ = ["MappingOwners"]


class MappingOwners:
    """Which session maps which memory: a session may only register memory no other live session has."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[tuple[object, ...], str] = {}

    def claim(self, session_id: str, memory: SessionMemory) -> None:
        """Record the session as owner of its mappings, or raise Forbidden if another session owns one."""
        with self._lock:
            for m in memory.mappings.values():
                owner = self._owner.get(m.identity)
                if owner is not None and owner != session_id:
                    raise Forbidden(
                        f"memory {getattr(m, 'name', m.identity[0])!r} is registered by another session: "
                        "a session registers only memory of its own"
                    )
            for m in memory.mappings.values():
                self._owner[m.identity] = session_id

    def release(self, session_id: str, memory: SessionMemory) -> None:
        """Forget the session's claims."""
        with self._lock:
            for m in memory.mappings.values():
                if self._owner.get(m.identity) == session_id:
                    del self._owner[m.identity]
