"""Loads try again what the store failed transiently (store/codes.py TRANSIENT: a master that did not answer within
its RPC timeout, busy or paused), within the request's deadline: a load that gives up on a busy master costs the
engine a recompute of blocks a lookup promised.

A retry starts only if it can end before the client's deadline (its wait plus the longest a store call can take,
Mooncake's RPC timeout): past the deadline the engine may reuse its blocks, and a read landing then would write
into memory that is no longer the request's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvsidecar.store import StoreCode
from kvsidecar.store.codes import TRANSIENT

__all__ = ["DEFAULT_CALL_S", "RETRY_WAITS_S", "RetryPolicy", "retry_transient"]

RETRY_WAITS_S = (0.05, 0.2, 0.5, 1.0)  # before each retry, growing: a busy master gets room
DEFAULT_CALL_S = 5.0  # the daemon's MC_RPC_TIMEOUT_MS

Code = TypeVar("Code")  # what a call answers per item: a store code, or a verdict of the daemon's beside them


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how late a transient failure is tried again."""

    waits: tuple[float, ...] = RETRY_WAITS_S
    call_s: float = DEFAULT_CALL_S  # the longest one store call takes (the store client's RPC timeout)

    def wait_before(self, retry: int, deadline: float | None, now: float) -> float | None:
        """The wait before retry number `retry` (from 0), or None: no more (all used, or it could end past the
        deadline, on time.monotonic())."""
        if retry >= len(self.waits):
            return None
        wait = self.waits[retry]
        if deadline is not None and now + wait + self.call_s > deadline:
            return None
        return wait


def retry_transient(
    call: Callable[[Sequence[int]], list[Code]],
    items: Sequence[int],
    policy: RetryPolicy,
    deadline: float | None,
    on_retry: Callable[[StoreCode, int], None],
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[Code]:
    """call(items) -> one code per item; the items whose code is a transient StoreCode are called again, as the
    policy allows. on_retry(code, count) hears of each retry, by the code it retries."""
    first = call(items)
    if len(first) == len(items) and not any(isinstance(code, StoreCode) and code in TRANSIENT for code in first):
        return first  # nearly every call: nothing to try again
    codes = dict(zip(items, first, strict=True))
    retry = 0
    while True:
        transient = {i: code for i in items if isinstance(code := codes[i], StoreCode) and code in TRANSIENT}
        again = list(transient)
        wait = policy.wait_before(retry, deadline, clock()) if again else None
        if wait is None:
            return [codes[i] for i in items]
        for code, count in Counter(transient.values()).items():
            on_retry(code, count)
        sleep(wait)
        retry += 1
        codes.update(zip(again, call(again), strict=True))
