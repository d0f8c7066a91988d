"""Per-tenant write budgets: a token bucket of bytes, refilled at a rate up to a burst."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["WriteBudget"]


class WriteBudget:
    """Bytes a tenant may still write now; a save takes what fits and skips the rest (Reason.TENANT_BUDGET)."""

    def __init__(self, bytes_per_second: int, burst_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.rate = bytes_per_second
        self.burst = burst_bytes
        self._level = float(burst_bytes)
        self._at = clock()

    def set_limits(self, bytes_per_second: int, burst_bytes: int) -> None:
        """New limits (a reloaded tenants file); what is saved up stays, capped by the new burst."""
        with self._lock:
            self._refill()
            self.rate, self.burst = bytes_per_second, burst_bytes
            self._level = min(self._level, float(burst_bytes))

    def admit(self, sizes: Sequence[int]) -> int:
        """How many of the values, in order, fit the budget now; their bytes are taken from it."""
        with self._lock:
            self._refill()
            n = 0
            for size in sizes:
                if size > self._level:
                    break
                self._level -= size
                n += 1
            return n

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(float(self.burst), self._level + (now - self._at) * self.rate)
        self._at = now
