"""Retention carried out: the ledger's verdicts (tenancy/retention.py) for a save's or a hit's values, the pins they
take at the put, the stored values pinned again in the background, and an operator's drop (docs/retention.md).

A value a save writes takes its pin with the put (host memory; the device path puts it ordinary and it is pinned
right after). A value already stored (a save of a prefix stored before, a hit) is pinned by the store reading it
into scratch memory and writing it back (store/pins.py), on one background thread: never on a save's or a load's
way, and never from engine memory the engine may reuse.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from itertools import groupby
from typing import NamedTuple

from kvsidecar.errors import Forbidden, StoreError
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.trailer import stored_bytes
from kvsidecar.sessions.session import Session
from kvsidecar.store import Pin, Presence, Store, StoreCode
from kvsidecar.tenancy.retention import Action, RetentionLedger, Usage, Verdict
from kvsidecar.values import RetentionArgs
from kvsidecar_contract.placement import DEFAULT_CHECKSUM_EVERY, Chunk, key_prefix

__all__ = ["Dropped", "Retainer", "RetentionPlan"]

log = logging.getLogger(__name__)

# Pin jobs waiting for the background thread; past this a job is not done (its values stay as they are, counted).
_QUEUE_JOBS = 256


class Dropped(NamedTuple):
    """What an operator's drop did."""

    values: int
    bytes: int
    failed: int


class _Job(NamedTuple):
    verdicts: list[Verdict]
    sizes: list[int]


_STOP = None  # the job that ends the background thread


class RetentionPlan:
    """One save's (or hit's) verdicts, by the index of the chunk in its batch."""

    def __init__(self) -> None:
        self.verdicts: dict[int, Verdict] = {}
        self.sizes: dict[int, int] = {}
        self.present: set[int] = set()

    def put_pin(self, j: int) -> Pin | None:
        """The pin chunk j is written with (None: ordinary cache)."""
        v = self.verdicts.get(j)
        return v.pin if v is not None and v.retained else None

    def pins(self, chunks: Sequence[int]) -> list[Pin | None] | None:
        """The pin each of these chunks is written with; None when no chunk of the batch asked for retention."""
        return [self.put_pin(j) for j in chunks] if self.verdicts else None

    def counts(self, start: int, end: int, written: Callable[[int], bool]) -> tuple[int, int]:
        """(retained, unretained) among chunks [start, end): retained where it was stored or is being pinned."""
        retained = unretained = 0
        if not self.verdicts:
            return retained, unretained
        for j in range(start, end):
            v = self.verdicts.get(j)
            if v is None:
                continue
            if not v.retained:
                unretained += 1
            elif j in self.present or written(j):
                retained += 1
        return retained, unretained


class Retainer:
    """Decides and carries out the retention of saves and hits, against one store and the daemon's ledger."""

    def __init__(
        self,
        store: Store,
        ledger: RetentionLedger,
        metrics: Metrics,
        check_hard: Callable[[Session], None] | None = None,
        checksum_every: int = DEFAULT_CHECKSUM_EVERY,
    ) -> None:
        """check_hard raises Forbidden unless the session may pin hard (an operator credential's; by default no
        session may); checksum_every: the daemon's checksum rule (which values carry a trailer: a pin rewrites a
        stored value whole, trailer and all)."""
        self.store = store
        self.checksum_every = checksum_every
        self.ledger = ledger
        self.metrics = metrics
        self.check_hard = check_hard or _no_hard_pins
        self._jobs: queue.Queue[_Job | threading.Event | None] = queue.Queue(_QUEUE_JOBS)
        self._reported: set[str] = set()  # tenants whose gauges were set
        self._report_lock = threading.Lock()
        self._thread: threading.Thread | None = None  # started by the first job: most data paths never pin
        self._thread_lock = threading.Lock()

    def check(self, session: Session, want: RetentionArgs | None) -> None:
        """Forbidden where the request asks for a hard pin and the session may not pin hard."""
        if want is not None and want.hard:
            self.check_hard(session)

    def plan(
        self,
        session: Session,
        memory: SessionMemory,
        chunks: Sequence[Chunk],
        wants: Sequence[RetentionArgs | None],
        presence: Sequence[Presence],
    ) -> RetentionPlan:
        """The verdicts of every chunk whose request asked for retention (runs of chunks share their want)."""
        plan = RetentionPlan()
        if wants.count(None) == len(wants):
            return plan  # no request asked: nothing to decide (every save pays this check alone)
        for _, run in groupby(range(len(chunks)), key=lambda i: id(wants[i])):
            indices = list(run)
            request = wants[indices[0]]
            if request is None:
                continue
            for i, v in self._admit(session, memory, [(i, chunks[i]) for i in indices], request):
                plan.verdicts[i] = v
                plan.sizes[i] = self._stored(chunks[i].key, memory.part_bytes[chunks[i].group][chunks[i].part])
                if presence[i] is Presence.PRESENT:
                    plan.present.add(i)
        return plan

    def settle(self, plan: RetentionPlan, written: Callable[[int], bool]) -> None:
        """After the put (which pinned what it wrote): restore what failed, pin the values already stored."""
        if not plan.verdicts:
            return
        failed, later = [], []
        for j, v in plan.verdicts.items():
            if v.action not in (Action.PIN, Action.RENEW):
                continue
            if j in plan.present:
                later.append(j)
            elif not written(j):
                failed.append(v)
        self.ledger.restore(failed)
        if later:
            self._queue([plan.verdicts[j] for j in later], [plan.sizes[j] for j in later])
        self._count(plan)

    def touch(
        self, session: Session, memory: SessionMemory, chunks: Sequence[Chunk], want: RetentionArgs
    ) -> tuple[int, int]:
        """A hit's values read into engine memory: retain (or renew) them as a save would; (retained, unretained)."""
        plan = RetentionPlan()
        for i, v in self._admit(session, memory, list(enumerate(chunks)), want):
            plan.verdicts[i] = v
            plan.sizes[i] = self._stored(chunks[i].key, memory.part_bytes[chunks[i].group][chunks[i].part])
            plan.present.add(i)
        self.settle(plan, lambda j: False)
        return plan.counts(0, len(chunks), lambda j: False)

    def drop(self, tenant: str) -> Dropped:
        """Every value tenant retains made ordinary cache again, bytes kept; waits for the store (operators)."""
        doomed = self.ledger.drop(tenant)
        failed = 0
        for hard, group in groupby(sorted(doomed, key=lambda d: d[1].hard), key=lambda d: d[1].hard):
            items = list(group)
            try:
                sizes = [self._stored(k, e.size) for k, e in items]
                codes = self.store.pin([k for k, _ in items], sizes, None, hard_before=hard)
            except StoreError as exc:
                self.metrics.store_errors.labels("pin", exc.code.value).inc()
                codes = [exc.code] * len(items)
            failed += sum(code is not StoreCode.OK for code in codes)
        self.report()
        return Dropped(len(doomed), sum(e.size for _, e in doomed), failed)

    def forget_prefix(self, prefix: str) -> None:
        """A reset removed every value under prefix: none of them counts any more."""
        self.ledger.forget_prefix(prefix)
        self.report()

    def usage(self) -> dict[str, Usage]:
        """What each tenant retains now."""
        return self.ledger.usage()

    def report(self) -> None:
        """Each tenant's retained bytes into the metrics (after changes, and by the daemon's housekeeping)."""
        with self._report_lock:
            usage = self.ledger.usage()
            for tenant in self._reported | set(usage):
                u = usage.get(tenant, Usage())
                self.metrics.tenant_retained_bytes.labels(tenant, "soft").set(u.retained_bytes)
                self.metrics.tenant_retained_bytes.labels(tenant, "hard").set(u.hard_bytes)
            self._reported = set(usage)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pin job queued so far is done; whether they all were within timeout."""
        if self._thread is None:
            return True
        done = threading.Event()  # set by the thread when it takes it: every job queued before has run
        try:
            self._jobs.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def stop(self) -> None:
        """Finish the queued jobs and end the thread (before the store closes)."""
        with self._thread_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(_STOP)
            thread.join(timeout=60.0)

    # Helpers.

    def _admit(
        self, session: Session, memory: SessionMemory, chunks: Sequence[tuple[int, Chunk]], want: RetentionArgs
    ) -> list[tuple[int, Verdict]]:
        """The verdicts of the chunks the request's retention covers, a boundary's values together, in prompt order."""
        covered = [(i, c) for i, c in chunks if not want.end_tokens or c.boundary <= want.end_tokens]
        covered.sort(key=lambda ic: ic[1].boundary)
        boundaries = []
        for _, run in groupby(covered, key=lambda ic: ic[1].boundary):
            values = list(run)
            name = values[0][1].key.rpartition("@")[2]  # the boundary's hash: the same for every rank and group
            boundaries.append((name, [(c.key, memory.part_bytes[c.group][c.part]) for _, c in values]))
        namespace = key_prefix(session.layout.model, session.layout.cache_prefix)
        verdicts = self.ledger.admit(session.tenant, namespace, boundaries, want)
        return list(zip([i for i, _ in covered], verdicts, strict=True))

    def _stored(self, key: str, value_bytes: int) -> int:
        """What the store holds for a value (a pin rewrites it whole): its bytes, and its checksum trailer where the
        daemon's rule chose it. Budgets count the value's own bytes."""
        return stored_bytes(key, value_bytes, self.checksum_every)

    def _count(self, plan: RetentionPlan) -> None:
        for v in plan.verdicts.values():
            self.metrics.retention_values.labels(v.action.value).inc()
        self.report()

    def _queue(self, verdicts: list[Verdict], sizes: list[int]) -> None:
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvsidecar-retention", daemon=True)
                self._thread.start()
        try:
            self._jobs.put_nowait(_Job(verdicts, sizes))
        except queue.Full:
            # The store is slower than the pins asked of it: these values stay as they are, and are not counted.
            self.ledger.restore(verdicts)
            self.metrics.retention_values.labels("queue_full").inc(len(verdicts))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            if isinstance(job, threading.Event):
                job.set()
            else:
                self._pin(job)

    def _pin(self, job: _Job) -> None:
        items = sorted(zip(job.verdicts, job.sizes, strict=True), key=lambda vs: _order(vs[0].pin))
        for pin, group in groupby(items, key=lambda vs: vs[0].pin):
            batch = list(group)
            try:
                codes = self.store.pin([v.key for v, _ in batch], [s for _, s in batch], pin)
            except StoreError as exc:
                self.metrics.store_errors.labels("pin", exc.code.value).inc()
                codes = [exc.code] * len(batch)
            failed = [v for (v, _), code in zip(batch, codes, strict=True) if code is not StoreCode.OK]
            if failed:
                log.debug("could not pin %d of %d stored values: %s", len(failed), len(batch), set(codes))
                self.ledger.restore(failed)
                self.metrics.retention_values.labels("failed").inc(len(failed))
        self.report()


def _order(pin: Pin | None) -> tuple[bool, int]:
    return (False, 0) if pin is None else (pin.hard, pin.ttl_ms)


def _no_hard_pins(session: Session) -> None:
    raise Forbidden("hard pins are an operator's: this daemon grants them to no session")
