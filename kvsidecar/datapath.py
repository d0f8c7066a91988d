"""Save, lookup, load and reset: placement plans carried out against the store and engine memory.

Synchronous by design: the service runs these on the gRPC server's threads.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvsidecar.budget import TENANT_BUDGET_REASON, WriteBudget
from kvsidecar.memory import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.session import Session
from kvsidecar.store import Presence, Store, StoreCode, StoreError
from kvsidecar.store.codes import NO_BLOCK_REASON
from kvsidecar.tiers import count_tier_hits
from kvsidecar.values import Failure, LoadOutcome, LookupOutcome, SaveOutcome
from kvsidecar_contract.placement import (
    KEY_TAIL_PATTERN,
    NO_BLOCK,
    Chunk,
    Hit,
    StagedLookup,
    key_prefix,
    load_plan,
    save_plan,
)

__all__ = ["DataPath", "Failure", "LoadOutcome", "LookupOutcome", "NoSpaceBackoff", "SaveOutcome"]

log = logging.getLogger(__name__)


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


class DataPath:
    """Runs each request's plan with one batch call per step, and counts everything for operators."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        backoff: NoSpaceBackoff | None = None,
        budget_of: Callable[[str], WriteBudget | None] = lambda tenant: None,
        tiers: Callable[[Sequence[str]], list[str]] | None = None,
    ) -> None:
        """tiers, given, says where each key is before a load (the disk tier's hit metrics); budget_of gives a
        tenant's write budget."""
        self.store = store
        self.metrics = metrics
        self.backoff = backoff or NoSpaceBackoff()
        self.tiers = tiers
        self._budget_of = budget_of

    def save(
        self,
        session: Session,
        hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        saved: int,
        deadline: float | None = None,
    ) -> SaveOutcome:
        """Write this rank's missing chunks: one existence check, then one zero-copy batch put.

        deadline (time.monotonic()) is the client's: past it the engine may reuse the blocks, so a put that has
        not started is skipped, and values written after it are removed again rather than served as wrong bytes.
        """
        memory = session.require_memory()
        plan = save_plan(session.geometry, hashes, block_ids, num_tokens, saved)
        if not plan.chunks:
            return SaveOutcome(0, 0, (), plan.others, 0, plan.absent)
        with _holding(memory):
            buffers = [memory.buffers(c.group, c.block_id) for c in plan.chunks]
            keys = [c.key for c in plan.chunks]
            try:
                with self._timed("exists"):
                    presence = self.store.exists(keys)
            except StoreError as exc:
                self.metrics.store_errors.labels("exists", exc.code.value).inc()
                return self._save_failed(session, plan.chunks, exc.code, plan.others)
            todo = [i for i, p in enumerate(presence) if p is not Presence.PRESENT]
            # A tenant past its write budget writes the values that fit, in prompt order; the rest are skipped,
            # so its floods cannot evict every other tenant's working set.
            over_budget: list[int] = []
            budget = self._budget_of(session.tenant) if session.tenant else None
            if budget is not None and todo:
                fit = budget.admit([memory.value_bytes[plan.chunks[i].group] for i in todo])
                todo, over_budget = todo[:fit], todo[fit:]
            if _past(deadline):
                codes = [StoreCode.DEADLINE_EXCEEDED] * len(todo)
            elif todo and self.backoff.active():
                # A full store is evicting in the background; hammering it only slows that down.
                codes = [StoreCode.NO_SPACE] * len(todo)
            else:
                try:
                    with self._timed("put"):
                        codes = self.store.put_from(
                            [keys[i] for i in todo], [buffers[i][0] for i in todo], [buffers[i][1] for i in todo]
                        )
                except StoreError as exc:
                    self.metrics.store_errors.labels("put", exc.code.value).inc()
                    codes = [exc.code] * len(todo)
                if todo:
                    self.backoff.record(StoreCode.NO_SPACE in codes)
                if _past(deadline):
                    codes = self._revoke([keys[i] for i in todo], codes)
        skipped = len(plan.chunks) - len(todo) - len(over_budget)
        written = 0
        bytes_written = 0
        kinds = _kinds(session)
        failures = [Failure(plan.chunks[i].group, plan.chunks[i].block_id, TENANT_BUDGET_REASON) for i in over_budget]
        for f in failures:
            self.metrics.save_failed_blocks.labels(kinds[f.group], TENANT_BUDGET_REASON).inc()
        if session.tenant and over_budget:
            self.metrics.tenant_refused.labels(session.tenant, TENANT_BUDGET_REASON).inc(len(over_budget))
        # Counted per group and added to the metrics once per group: a save moves hundreds of chunks.
        saved_per_group = [0] * len(kinds)
        for i, code in zip(todo, codes, strict=True):
            chunk = plan.chunks[i]
            if code in (StoreCode.OK, StoreCode.EXISTS):  # EXISTS: a concurrent save won the race; same bytes
                written += 1
                bytes_written += memory.value_bytes[chunk.group]
                saved_per_group[chunk.group] += 1
            else:
                failures.append(Failure(chunk.group, chunk.block_id, code.value))
                self.metrics.save_failed_blocks.labels(kinds[chunk.group], code.value).inc()
        skipped_per_group = [0] * len(kinds)
        for i, p in enumerate(presence):
            if p is Presence.PRESENT:
                skipped_per_group[plan.chunks[i].group] += 1
        for g, kind in enumerate(kinds):
            if saved_per_group[g]:
                self.metrics.saved_blocks.labels(kind).inc(saved_per_group[g])
            if skipped_per_group[g]:
                self.metrics.save_skipped_blocks.labels(kind).inc(skipped_per_group[g])
        self.metrics.saved_bytes.inc(bytes_written)
        if session.tenant:
            self.metrics.tenant_saved_blocks.labels(session.tenant).inc(written)
            self.metrics.tenant_saved_bytes.labels(session.tenant).inc(bytes_written)
        return SaveOutcome(written, skipped, tuple(failures), plan.others, bytes_written, plan.absent)

    def lookup(self, session: Session, hashes: Sequence[bytes], num_tokens: int, eagle: bool) -> LookupOutcome:
        """Probe in stages, each one batch, only what can still change the answer; a store failure is a miss."""
        geo = session.geometry
        staged = StagedLookup(geo, hashes, num_tokens, eagle=eagle)
        self.metrics.lookup_tokens.inc(num_tokens)
        if session.tenant:
            self.metrics.tenant_lookup_tokens.labels(session.tenant).inc(num_tokens)
        unknown = 0
        while not staged.done:
            keys = staged.next_keys()
            if not keys:
                staged.record(())
                continue
            try:
                with self._timed("exists"):
                    presence = self.store.exists(keys)
            except StoreError as exc:
                self.metrics.store_errors.labels("exists", exc.code.value).inc()
                self.metrics.lookup_requests.labels("degraded").inc()
                return LookupOutcome(Hit(0, (0,) * len(geo.groups)), True, f"store unavailable: {exc.reason}")
            # C-level passes: a full hit on a 128k-token prompt at T=8 with three groups probes ~140k keys.
            staged.record(list(map(operator.is_, presence, itertools.repeat(Presence.PRESENT))))
            unknown += presence.count(Presence.UNKNOWN)
        hit = staged.answer()
        self.metrics.lookup_hit_tokens.inc(hit.tokens)
        if session.tenant:
            self.metrics.tenant_lookup_hit_tokens.labels(session.tenant).inc(hit.tokens)
        # Unanswered probes count as missing (never as hits); the answer says it may be shorter than the truth.
        if unknown:
            self.metrics.lookup_requests.labels("degraded").inc()
            return LookupOutcome(hit, True, f"{unknown} of {staged.probes} existence probes failed")
        self.metrics.lookup_requests.labels("hit" if hit.tokens else "miss").inc()
        return LookupOutcome(hit, False, "")

    def load(
        self,
        session: Session,
        hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        hit_tokens: int,
        tails: Sequence[int],
        start_tokens: int,
    ) -> LoadOutcome:
        """Read the hit's chunks straight into engine memory with one batch get; name every block that failed."""
        memory = session.require_memory()
        planned = load_plan(session.geometry, hashes, block_ids, hit_tokens, tails, start_tokens)
        kinds = _kinds(session)
        # A span without a block cannot receive its value: the engine recomputes it.
        nowhere = [c for c in planned if c.block_id == NO_BLOCK]
        for c in nowhere:
            self.metrics.load_failed_blocks.labels(kinds[c.group], NO_BLOCK_REASON).inc()
        chunks = [c for c in planned if c.block_id != NO_BLOCK]
        if not chunks:
            return LoadOutcome(0, 0, tuple(Failure(c.group, c.block_id, NO_BLOCK_REASON) for c in nowhere))
        with _holding(memory):
            buffers = [memory.buffers(c.group, c.block_id) for c in chunks]
            where = self._where([c.key for c in chunks])
            try:
                with self._timed("get"):
                    codes = self.store.get_into(
                        [c.key for c in chunks], [b[0] for b in buffers], [b[1] for b in buffers]
                    )
            except StoreError as exc:
                self.metrics.store_errors.labels("get", exc.code.value).inc()
                codes = [exc.code] * len(chunks)
        loaded = 0
        nbytes = 0
        failures = [Failure(c.group, c.block_id, NO_BLOCK_REASON) for c in nowhere]
        loaded_per_group = [0] * len(kinds)
        for chunk, code in zip(chunks, codes, strict=True):
            if code is StoreCode.OK:
                loaded += 1
                nbytes += memory.value_bytes[chunk.group]
                loaded_per_group[chunk.group] += 1
            else:
                failures.append(Failure(chunk.group, chunk.block_id, code.value))
                self.metrics.load_failed_blocks.labels(kinds[chunk.group], code.value).inc()
        for g, kind in enumerate(kinds):
            if loaded_per_group[g]:
                self.metrics.loaded_blocks.labels(kind).inc(loaded_per_group[g])
        self.metrics.loaded_bytes.inc(nbytes)
        if session.tenant:
            self.metrics.tenant_loaded_blocks.labels(session.tenant).inc(loaded)
            self.metrics.tenant_loaded_bytes.labels(session.tenant).inc(nbytes)
        if where is not None:
            ok = [i for i, code in enumerate(codes) if code is StoreCode.OK]
            count_tier_hits(self.metrics, [where[i] for i in ok], [memory.value_bytes[chunks[i].group] for i in ok])
        return LoadOutcome(loaded, nbytes, tuple(failures))

    def _where(self, keys: list[str]) -> list[str] | None:
        if self.tiers is None:
            return None
        try:
            with self._timed("tiers"):
                return self.tiers(keys)
        except StoreError as exc:
            self.metrics.store_errors.labels("tiers", exc.code.value).inc()
            return None

    def reset(self, session: Session) -> int:
        """Remove every block of the session's model under its cache prefix, and nothing else."""
        layout = session.layout
        # The rest of the key must have exactly the key format's shape: a reset of one model must not sweep along
        # a model whose name continues it in some other tenant's keys.
        with self._timed("remove"):
            return self.store.remove_prefix(key_prefix(layout.model, layout.cache_prefix), KEY_TAIL_PATTERN)

    def _revoke(self, keys: Sequence[str], codes: Sequence[StoreCode]) -> list[StoreCode]:
        """Remove values read after the client's deadline: their blocks may have been reused meanwhile."""
        written = [k for k, c in zip(keys, codes, strict=True) if c is StoreCode.OK]
        if written:
            try:
                with self._timed("remove"):
                    self.store.remove(written)
            except StoreError as exc:
                # Nothing more can be done from here; say so loudly, the values may be served.
                self.metrics.store_errors.labels("remove", exc.code.value).inc()
                log.error("could not remove %d values saved past their deadline: %s", len(written), exc)
        return [StoreCode.DEADLINE_EXCEEDED] * len(codes)

    def _save_failed(self, session: Session, chunks: Sequence[Chunk], code: StoreCode, others: int) -> SaveOutcome:
        kinds = _kinds(session)
        for c in chunks:
            self.metrics.save_failed_blocks.labels(kinds[c.group], code.value).inc()
        return SaveOutcome(0, 0, tuple(Failure(c.group, c.block_id, code.value) for c in chunks), others, 0)

    @contextmanager
    def _timed(self, operation: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.metrics.store_operation_seconds.labels(operation).observe(time.perf_counter() - start)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


@contextmanager
def _holding(memory: SessionMemory) -> Iterator[None]:
    memory.acquire()
    try:
        yield
    finally:
        memory.release()


def _kinds(session: Session) -> list[str]:
    return [g.kind.value for g in session.layout.groups]
