"""Timing and statistics: samples, medians, percentiles, throughput and ratios."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["GIB", "Samples", "gib_per_s", "percentile", "ratio", "rotated", "timed"]

GIB = float(1 << 30)
T = TypeVar("T")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def gib_per_s(nbytes: float, seconds: float) -> float:
    """Throughput in GiB/s (NaN when nothing was timed)."""
    return nbytes / seconds / GIB if seconds > 0 else math.nan


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either is missing."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """items rotated left by `shift`: each round starts with another path, so none always runs first."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])


@dataclass
class Samples:
    """Durations (seconds) of one measured operation, with the bytes each one moved."""

    seconds: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)

    def add(self, seconds: float, nbytes: int = 0) -> None:
        """Record one run."""
        self.seconds.append(seconds)
        self.nbytes.append(nbytes)

    def __len__(self) -> int:
        return len(self.seconds)

    @property
    def median_s(self) -> float:
        """Median duration."""
        return statistics.median(self.seconds) if self.seconds else math.nan

    def p(self, q: float) -> float:
        """q-th percentile of the durations."""
        return percentile(self.seconds, q)

    @property
    def gib_s(self) -> float:
        """Median of the per-run throughputs, GiB/s."""
        rates = [gib_per_s(b, s) for b, s in zip(self.nbytes, self.seconds, strict=True) if s > 0]
        return statistics.median(rates) if rates else math.nan

    def as_dict(self) -> dict[str, object]:
        """Raw samples and their summary, for the JSON report."""
        return {
            "seconds": [round(s, 7) for s in self.seconds],
            "bytes": self.nbytes,
            "median_s": _round(self.median_s),
            "p99_s": _round(self.p(99)),
            "gib_per_s": _round(self.gib_s),
        }


def _round(value: float, digits: int = 7) -> float | None:
    return None if math.isnan(value) else round(value, digits)


@contextmanager
def timed(record: Callable[[float], None]) -> Iterator[None]:
    """Time the block with perf_counter and hand the seconds to `record`."""
    start = time.perf_counter()
    yield
    record(time.perf_counter() - start)
