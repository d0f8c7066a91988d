"""Retention budgets: which values each tenant's requests keep ahead of ordinary cache, until when, and within what.

Pure bookkeeping under one lock, on an injected clock; the data path carries out what it decides (datapath/
retention.py) and docs/retention.md has the rules:

- A request's values are admitted boundary by boundary, in prompt order, all values of a boundary (every group's,
  every part's) together or none: a hybrid's state without its attention, or attention without the state at its
  boundary, is a hit nobody can use. Admission stops at the first boundary that does not fit.
- A boundary fits when the tenant's retained bytes with it stay within priority % of its budget: the fuller the
  budget, the more a request must matter to be retained. What does not fit is stored as ordinary cache.
- A boundary another rank of the same engine had admitted (same namespace, same boundary) is admitted again for
  this rank's values whatever the budget says, so no rank keeps a boundary its peers dropped (the overshoot is one
  request's share of its other ranks).
- A value already retained is renewed (its time starts again) when the request asks, and at most once per eighth of
  its time; a hard pin (an operator's) is outside the budget and is never replaced by a soft one.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvsidecar.store.base import Pin
from kvsidecar.values import RetentionArgs

__all__ = ["Action", "Entry", "RetentionLedger", "Usage", "Verdict"]

FOREVER = math.inf
# A value is renewed only once at least this share of its time has passed since it was pinned.
_RENEW_AFTER = 1 / 8
# The ledger's deadline runs this much past the store's (whose clock starts when the write ends), so a tenant's
# bytes are never counted free while the store still holds them pinned.
_MARGIN_S = 1.0


class Action(enum.Enum):
    """What the store must do for one value of a request that asked for retention."""

    PIN = "pin"  # not retained yet: write (or rewrite) it with the pin
    RENEW = "renew"  # retained: rewrite it so its time starts again
    KEPT = "kept"  # retained long enough already (or hard-pinned): nothing to do
    OVER = "over"  # over the tenant's budget: ordinary cache


class Entry(NamedTuple):
    """A retained value: whose, how big, until when (FOREVER: a hard pin)."""

    tenant: str
    size: int
    deadline: float
    hard: bool = False


class Verdict(NamedTuple):
    """One value's admission: what to do, the pin it takes if it must be written (None: ordinary cache), and the
    entry it replaced (to restore if the store fails)."""

    key: str
    action: Action
    pin: Pin | None = None
    previous: Entry | None = None

    @property
    def retained(self) -> bool:
        return self.action is not Action.OVER


class Usage(NamedTuple):
    """What one tenant retains now."""

    retained_bytes: int = 0  # soft pins, counted against the budget
    hard_bytes: int = 0  # hard pins, outside it
    values: int = 0


Boundary = tuple[str, Sequence[tuple[str, int]]]  # (boundary id, its values' (key, size)), in prompt order


class RetentionLedger:
    """Every value this daemon retains, by key; per tenant the bytes it holds; budgets from budget_of(tenant)."""

    def __init__(
        self,
        budget_of: Callable[[str], int],
        *,
        max_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """max_seconds caps every request's time (the master refuses longer soft pins)."""
        if max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {max_seconds}")
        self._budget_of = budget_of
        self.max_seconds = max_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._usage: dict[str, Usage] = {}
        self._admitted: dict[tuple[str, str], float] = {}  # (namespace, boundary) -> until when it is admitted
        self._expiry: list[tuple[float, int, str, str]] = []  # (deadline, seq, kind "key"/"boundary", name)
        self._seq = itertools.count()

    def ttl_ms(self, want: RetentionArgs) -> int:
        """The soft pin's time of a request, in whole milliseconds, capped at max_seconds."""
        return max(1, math.ceil(min(want.seconds, self.max_seconds) * 1000))

    def admit(self, tenant: str, namespace: str, boundaries: Sequence[Boundary], want: RetentionArgs) -> list[Verdict]:
        """Each value's verdict, in the order given; what is admitted is counted at once (restore what fails)."""
        now = self._clock()
        hard = want.hard
        ttl = self.ttl_ms(want) / 1000
        deadline = FOREVER if hard else now + ttl + _MARGIN_S
        pin = Pin(hard=True) if hard else Pin(ttl_ms=self.ttl_ms(want))
        limit = self._budget_of(tenant) * min(max(want.priority, 0), 100) // 100
        out: list[Verdict] = []
        with self._lock:
            self._expire(now)
            used = self._usage.get(tenant, Usage()).retained_bytes
            stopped = False
            for boundary, values in boundaries:
                admitted = self._admitted.get((namespace, boundary), 0.0) > now
                new = sum(size for key, size in values if not self._holds(key, hard))
                if not (stopped or hard or admitted or new == 0 or used + new <= limit):
                    stopped = True
                if stopped:
                    # What is retained already stays so (its pin is the store's); the rest is ordinary cache.
                    out.extend(
                        Verdict(key, Action.KEPT, pin) if self._holds(key, hard) else Verdict(key, Action.OVER)
                        for key, _ in values
                    )
                    continue
                used += new
                for key, size in values:
                    out.append(self._verdict(tenant, key, size, deadline, pin, ttl, want.renew, now))
                if not hard:
                    self._admit_boundary(namespace, boundary, deadline)
        return out

    def restore(self, verdicts: Sequence[Verdict]) -> None:
        """Undo what these verdicts counted: the store did not do what they asked."""
        with self._lock:
            for v in verdicts:
                if v.action in (Action.PIN, Action.RENEW):
                    self._remove(v.key)
                    if v.previous is not None:
                        self._add(v.key, v.previous)

    def forget_prefix(self, prefix: str) -> int:
        """Stop counting every value whose key starts with prefix (a reset removed them); how many were counted."""
        with self._lock:
            keys = [k for k in self._entries if k.startswith(prefix)]
            for key in keys:
                self._remove(key)
            return len(keys)

    def drop(self, tenant: str) -> list[tuple[str, Entry]]:
        """Stop counting every value of tenant (an operator drops its retentions); they are returned to unpin."""
        with self._lock:
            self._expire(self._clock())
            doomed = [(k, e) for k, e in self._entries.items() if e.tenant == tenant]
            for key, _ in doomed:
                self._remove(key)
            return doomed

    def usage(self) -> dict[str, Usage]:
        """Each tenant that retains something now, and how much."""
        with self._lock:
            self._expire(self._clock())
            return {t: u for t, u in self._usage.items() if u.values}

    def budget(self, tenant: str) -> int:
        """The tenant's retention budget in bytes."""
        return self._budget_of(tenant)

    def entry(self, key: str) -> Entry | None:
        """The value's entry, while it counts."""
        with self._lock:
            self._expire(self._clock())
            return self._entries.get(key)

    # Helpers; all run under self._lock.

    def _holds(self, key: str, hard: bool) -> bool:
        """Whether key's bytes are already counted for this kind of pin (a soft value asked hard is new to it)."""
        entry = self._entries.get(key)
        return entry is not None and (entry.hard or not hard)

    def _verdict(
        self, tenant: str, key: str, size: int, deadline: float, pin: Pin, ttl: float, renew: bool, now: float
    ) -> Verdict:
        entry = self._entries.get(key)
        if entry is None:
            self._add(key, Entry(tenant, size, deadline, pin.hard))
            return Verdict(key, Action.PIN, pin)
        if entry.hard:
            return Verdict(key, Action.KEPT, Pin(hard=True))  # a hard pin stays until an operator drops it
        if pin.hard:
            self._remove(key)
            self._add(key, Entry(entry.tenant, size, deadline, True))
            return Verdict(key, Action.PIN, pin, previous=entry)
        if renew and entry.deadline - now < ttl * (1 - _RENEW_AFTER) + _MARGIN_S:
            self._remove(key)
            self._add(key, entry._replace(deadline=max(deadline, entry.deadline)))
            return Verdict(key, Action.RENEW, pin, previous=entry)
        return Verdict(key, Action.KEPT, pin)

    def _admit_boundary(self, namespace: str, boundary: str, deadline: float) -> None:
        name = (namespace, boundary)
        if self._admitted.get(name, 0.0) < deadline:
            self._admitted[name] = deadline
            heapq.heappush(self._expiry, (deadline, next(self._seq), "boundary", "\0".join(name)))

    def _add(self, key: str, entry: Entry) -> None:
        self._entries[key] = entry
        u = self._usage.get(entry.tenant, Usage())
        if entry.hard:
            u = u._replace(hard_bytes=u.hard_bytes + entry.size, values=u.values + 1)
        else:
            u = u._replace(retained_bytes=u.retained_bytes + entry.size, values=u.values + 1)
            heapq.heappush(self._expiry, (entry.deadline, next(self._seq), "key", key))
        self._usage[entry.tenant] = u

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        u = self._usage[entry.tenant]
        if entry.hard:
            u = u._replace(hard_bytes=u.hard_bytes - entry.size, values=u.values - 1)
        else:
            u = u._replace(retained_bytes=u.retained_bytes - entry.size, values=u.values - 1)
        if u.values:
            self._usage[entry.tenant] = u
        else:
            del self._usage[entry.tenant]

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            deadline, _, kind, name = heapq.heappop(self._expiry)
            if kind == "key":
                entry = self._entries.get(name)
                if entry is not None and entry.deadline == deadline:
                    self._remove(name)
            else:
                namespace, boundary = name.split("\0", 1)
                if self._admitted.get((namespace, boundary)) == deadline:
                    del self._admitted[namespace, boundary]
