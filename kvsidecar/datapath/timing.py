"""A store call's duration into its histogram: the data path times every store call it makes."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Observer", "Timed"]


class Observer(Protocol):
    """A histogram's child, as prometheus_client makes it."""

    def observe(self, amount: float) -> None: ...


class Timed:
    """One store call's duration into its histogram, error or not (a class: cheaper per call than a generator)."""

    __slots__ = ("_histogram", "_start")

    def __init__(self, histogram: Observer) -> None:
        self._histogram = histogram
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._histogram.observe(time.perf_counter() - self._start)
