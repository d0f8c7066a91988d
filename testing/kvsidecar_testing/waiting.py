"""Waiting for a state, not for a time: a clock and a backoff that tests can replace."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["DEFAULT_BACKOFF", "SYSTEM_CLOCK", "Backoff", "Clock", "SystemClock", "WaitTimeout", "wait_until"]

T = TypeVar("T")


class Clock(Protocol):
    """Monotonic time and a way to pass it; a fake one makes waits instant and deterministic."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass(frozen=True)
class Backoff:
    """Delays between checks: `first`, growing by `factor`, never above `most` seconds."""

    first: float = 0.02
    factor: float = 2.0
    most: float = 0.5

    def delays(self) -> Iterator[float]:
        delay = self.first
        while True:
            yield delay
            delay = min(delay * self.factor, self.most)


class WaitTimeout(TimeoutError):
    """A state was not reached in time; says which and what was last seen."""


SYSTEM_CLOCK: Clock = SystemClock()
DEFAULT_BACKOFF = Backoff()


def wait_until(
    check: Callable[[], T],
    *,
    timeout: float,
    what: str,
    clock: Clock = SYSTEM_CLOCK,
    backoff: Backoff = DEFAULT_BACKOFF,
    detail: Callable[[], str] | None = None,
) -> T:
    """Call `check` until it returns something truthy and return that; WaitTimeout after `timeout` seconds.

    The scale of a timeout is how long the state may take on a loaded machine; the backoff keeps the checks cheap.
    """
    deadline = clock.monotonic() + timeout
    for delay in backoff.delays():
        result = check()
        if result:
            return result
        left = deadline - clock.monotonic()
        if left <= 0:
            extra = f":\n{detail()}" if detail is not None else ""
            raise WaitTimeout(f"{what}: not reached within {timeout:g} s{extra}")
        clock.sleep(min(delay, left))
    raise AssertionError("unreachable")  # delays() never ends
