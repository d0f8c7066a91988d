"""Per-account gates: at most N lookups of one account, and at most M in all, run at once; the rest wait.

Lookups run apart from saves and loads (they are on the scheduler's critical path). Without a gate, one account's
huge lookups (2 x 2^20 hashes) hold every lookup thread and another account's lookups queue behind them; with one,
an account holds at most its share. The same slots serve both ways in: a gRPC call waits for one on the event loop
(`hold_async`, which costs nothing) before it takes a pool thread, a data-socket call on the connection's own thread
(`hold`, with the call's deadline), so neither way lets an account past its share.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from kvsidecar.errors import TooLate

__all__ = ["AccountGates"]


class AccountGates:
    """Slots held per account (at most `per_account` each, `total` in all; 0: no bound in all)."""

    def __init__(self, per_account: int, total: int = 0) -> None:
        self.per_account = per_account
        self.total = total
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # only accounts holding a slot: nothing is kept for an idle account
        self._in_all = 0
        self._wakers: list[Callable[[], None]] = []  # everyone waiting; each retries when a slot is given back

    @contextlib.asynccontextmanager
    async def hold(self, account: str) -> AsyncIterator[None]:
        """Wait (on the event loop) for one of account's slots, and hold it for the block."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._take(account):
                    break
                woken = loop.create_future()
                self._wakers.append(functools.partial(_wake_on, loop, woken))
            await woken
        try:
            yield
        finally:
            self._give_back(account)

    @contextlib.contextmanager
    def hold_blocking(self, account: str, timeout: float | None) -> Iterator[None]:
        """Wait (on this thread, at most timeout seconds) for one of account's slots, and hold it for the block.

        Raises TooLate (DEADLINE_EXCEEDED, as a gRPC call waiting past its deadline) naming the shares when the
        wait outlasts the timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            woken = threading.Event()
            with self._lock:
                if self._take(account):
                    break
                self._wakers.append(woken.set)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not woken.wait(left)):
                raise TooLate(
                    f"no lookup slot within the call's deadline: at most {self.per_account} lookups per account "
                    f"and {self.total or 'no bound'} in all run at once (--lookups-per-account, --lookup-workers)"
                )
            if left is None:
                woken.wait()
        try:
            yield
        finally:
            self._give_back(account)

    def held(self) -> dict[str, int]:
        """Slots held now, by account."""
        with self._lock:
            return dict(self._held)

    def _take(self, account: str) -> bool:
        held = self._held.get(account, 0)
        if held >= self.per_account or (self.total and self._in_all >= self.total):
            return False
        self._held[account] = held + 1
        self._in_all += 1
        return True

    def _give_back(self, account: str) -> None:
        with self._lock:
            held = self._held[account] - 1
            if held:
                self._held[account] = held
            else:
                del self._held[account]
            self._in_all -= 1
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()


def _wake_on(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed (the daemon is stopping): nobody to wake
        loop.call_soon_threadsafe(_wake, future)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # a waiter cancelled meanwhile (its client gave up) needs no waking
        future.set_result(None)
