"""Saves back off a full store: it is evicting in the background, and hammering it only slows that down."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["NoSpaceBackoff"]


class NoSpaceBackoff:
    """After the store says it is full, saves skip it for a while (doubling, reset by a put that fits)."""

    def __init__(self, first: float = 0.25, longest: float = 4.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._first, self._longest, self._clock = first, longest, clock
        self._delay = 0.0
        self._until = 0.0
        self._lock = threading.Lock()

    def active(self) -> bool:
        """Whether saves should not try the store now."""
        with self._lock:
            return self._clock() < self._until

    def record(self, full: bool) -> None:
        """Note the outcome of a put batch: full or not."""
        with self._lock:
            if full:
                self._delay = min(self._longest, self._delay * 2 if self._delay else self._first)
                self._until = self._clock() + self._delay
            else:
                self._delay = 0.0
