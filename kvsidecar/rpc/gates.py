"""Per-account gates on the event loop: at most N calls of one account run in a pool at once, the rest wait.

Lookups run in a small pool of their own (they are on the scheduler's critical path). Without a gate, one account's
huge lookups (2 x 2^20 hashes) hold every thread of it and another account's lookups queue behind them; with one,
an account holds at most its share of the threads, and waits for them on the event loop, which costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["AccountGates"]


class AccountGates:
    """One asyncio semaphore of `per_account` slots per account, dropped when no call of the account holds it."""

    def __init__(self, per_account: int) -> None:
        self.per_account = per_account
        self._gates: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, account: str) -> AsyncIterator[None]:
        """Wait (on the event loop) for one of account's slots, and hold it for the block."""
        gate, users = self._gates.get(account, (None, 0))
        if gate is None:
            gate = asyncio.Semaphore(self.per_account)
        self._gates[account] = (gate, users + 1)
        try:
            async with gate:
                yield
        finally:
            gate, users = self._gates[account]
            if users <= 1:
                del self._gates[account]
            else:
                self._gates[account] = (gate, users - 1)
