"""Save, lookup, load and reset: placement plans carried out against the store and engine memory.

Synchronous by design: the service runs these in worker threads, off the event loop.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from kvsidecar.datapath.accounting import ChunkResult, Saved, kinds_of, load_outcome, save_failed, save_outcome
from kvsidecar.datapath.backoff import NoSpaceBackoff
from kvsidecar.datapath.retention import Retainer, RetentionPlan
from kvsidecar.datapath.retries import RetryPolicy, retry_transient
from kvsidecar.datapath.timing import Observer, Timed
from kvsidecar.errors import BadRequest, StoreError
from kvsidecar.events.feed import NO_EVENTS, StoreEvents
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.base import Mover
from kvsidecar.movers.sums import Loaded
from kvsidecar.reasons import Reason
from kvsidecar.sessions.session import Session
from kvsidecar.store import Presence, Store, StoreCode
from kvsidecar.tenancy.budget import WriteBudget
from kvsidecar.tenancy.retention import RetentionLedger
from kvsidecar.values import LoadArgs, LoadOutcome, LookupArgs, RetentionArgs, SaveArgs, SaveOutcome
from kvsidecar_contract.batches import Batch
from kvsidecar_contract.limits import MAX_HASHES
from kvsidecar_contract.placement import (
    KEY_TAIL_PATTERN,
    NO_BLOCK,
    Chunk,
    Hit,
    SavePlan,
    StagedLookup,
    key_prefix,
    load_plan,
    save_plan,
)

__all__ = ["DataPath"]

log = logging.getLogger(__name__)


class DataPath:
    """Runs each request's plan with one batch call per step, and counts everything for operators; the bytes move
    through the session's mover (movers/), whatever memory it is."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        backoff: NoSpaceBackoff | None = None,
        budget_of: Callable[[str], WriteBudget | None] = lambda tenant: None,
        events: StoreEvents = NO_EVENTS,
        max_lookup_hashes: int = MAX_HASHES,
        retries: RetryPolicy | None = None,
        retention: Retainer | None = None,
    ) -> None:
        """budget_of gives a tenant's write budget; events hears of every value written and every reset (KV events
        for routers); max_lookup_hashes bounds one Lookup's work (--max-lookup-hashes); retries says how a load tries
        again what the store failed transiently; retention keeps what requests ask ahead of ordinary cache (by
        default nothing: no tenant has a budget)."""
        self.store = store
        self.max_lookup_hashes = max_lookup_hashes
        self.metrics = metrics
        self.backoff = backoff or NoSpaceBackoff()
        self._budget_of = budget_of
        self.events = events
        self.retries = retries or RetryPolicy()
        self.retention = retention or Retainer(store, RetentionLedger(lambda tenant: 0, max_seconds=1.0), metrics)
        self._histograms: dict[str, Observer] = {}  # store_operation_seconds, by operation

    def save(self, session: Session, request: SaveArgs, deadline: float | None = None) -> SaveOutcome:
        """Write this rank's missing chunks: one existence check, then one zero-copy batch put.

        deadline (time.monotonic()) is the client's: past it the engine may reuse the blocks, so a put that has
        not started is skipped, and values written after it are removed again rather than served as wrong bytes.
        """
        batch: Batch[SaveArgs, SaveOutcome] = Batch([request])
        self.save_many(session, batch, deadline)
        return batch.result()

    def save_many(self, session: Session, batch: Batch[SaveArgs, SaveOutcome], deadline: float | None = None) -> None:
        """Several requests' saves (an engine step) with one existence check and one batch put for all of them,
        each open request of the batch answered on its own, as `save` would answer it.

        A request whose plan is refused (bad block ids, inconsistent counts) gets its error and the others go on.
        """
        mover = session.require_mover()
        memory = mover.memory
        saves = batch.step(lambda r: _Save(r, self._save_plan(session, r)))
        saves.settle(lambda s: None if s.plan.chunks else SaveOutcome(0, 0, (), s.plan.others, 0, s.plan.absent))
        if not saves.open():
            return
        with _holding(memory):
            saves.vet(lambda s: mover.check(s.plan.chunks))
            staged = saves.open()
            chunks = [c for s in staged for c in s.plan.chunks]
            wants = (
                [s.args.retention for s in staged for _ in s.plan.chunks]
                if any(s.args.retention is not None for s in staged)
                else None
            )
            results, kept = (
                self._put_missing(session, mover, chunks, deadline, wants) if chunks else ([], RetentionPlan())
            )
        if isinstance(results, StoreCode):  # the existence check failed: nothing was written
            code = results
            saves.settle(lambda s: save_failed(self.metrics, session, s.plan.chunks, code, s.plan.others))
            return
        saves.answer_spans(
            lambda s: len(s.plan.chunks), lambda s, span: self._saved(session, memory, s, results, span, kept)
        )

    def _save_plan(self, session: Session, request: SaveArgs) -> SavePlan:
        self.retention.check(session, request.retention)
        return save_plan(session.geometry, request.hashes, request.block_ids, request.num_tokens, request.saved)

    def _saved(
        self,
        session: Session,
        memory: SessionMemory,
        save: _Save,
        results: Sequence[ChunkResult],
        span: slice,
        kept: RetentionPlan,
    ) -> SaveOutcome:
        """One request's save from its chunks' results (its span of the batch's), counted and told to events."""
        plan, request = save.plan, save.args
        mine = results[span]
        retained, unretained = kept.counts(span.start, span.stop, lambda j: results[j] is Saved.WRITTEN)
        outcome = save_outcome(self.metrics, session, memory, plan, mine)
        written = [c for c, result in zip(plan.chunks, mine, strict=True) if result is Saved.WRITTEN]
        self.events.stored(
            session.tenant, session.geometry, request.hashes, written, request.tokens, request.tokens_start
        )
        return outcome._replace(retained=retained, unretained=unretained) if retained or unretained else outcome

    def _put_missing(
        self,
        session: Session,
        mover: Mover,
        chunks: Sequence[Chunk],
        deadline: float | None,
        wants: Sequence[RetentionArgs | None] | None,
    ) -> tuple[list[ChunkResult] | StoreCode, RetentionPlan]:
        """Per chunk: PRESENT (already stored), WRITTEN, or why its write failed; a StoreCode if none was asked.
        With the retention each chunk's request asked (wants None: none asked), and what became of it."""
        memory = mover.memory
        keys = [c.key for c in chunks]
        try:
            with self._timed("exists"):
                presence = self.store.exists(keys)
        except StoreError as exc:
            self.metrics.store_errors.labels("exists", exc.code.value).inc()
            return exc.code, RetentionPlan()
        kept = RetentionPlan() if wants is None else self.retention.plan(session, memory, chunks, wants, presence)
        results: list[ChunkResult] = [Saved.PRESENT] * len(chunks)
        # A key twice in one batch (two requests of a step computing the same prefix) is written once, and its
        # repeat shares the outcome: the bytes behind one key are the same whichever block holds them.
        first: dict[str, int] = {}
        todo: list[int] = []
        repeats: list[tuple[int, int]] = []
        for j, p in enumerate(presence):
            if p is not Presence.PRESENT:
                if keys[j] in first:
                    repeats.append((j, first[keys[j]]))
                else:
                    first[keys[j]] = j
                    todo.append(j)
        # A tenant past its write budget writes the values that fit, in prompt order; the rest are skipped,
        # so its floods cannot evict every other tenant's working set.
        budget = self._budget_of(session.tenant) if session.tenant else None
        if budget is not None and todo:
            fit = budget.admit([memory.part_bytes[chunks[j].group][chunks[j].part] for j in todo])
            for j in todo[fit:]:
                results[j] = Reason.TENANT_BUDGET
            todo = todo[:fit]
        codes: list[StoreCode] = []
        if _past(deadline):
            codes = [StoreCode.DEADLINE_EXCEEDED] * len(todo)
        elif todo and self.backoff.active():
            # A full store is evicting in the background; hammering it only slows that down.
            codes = [StoreCode.NO_SPACE] * len(todo)
        elif todo:
            # Most saves write every chunk they carry: those go as they are, without copies.
            every = len(todo) == len(chunks)
            with self._timed("put"):
                codes = mover.put(
                    keys if every else [keys[j] for j in todo],
                    chunks if every else [chunks[j] for j in todo],
                    kept.pins(todo),
                )
            self.backoff.record(StoreCode.NO_SPACE in codes)
            if _past(deadline):
                codes = self._revoke([keys[j] for j in todo], codes)
        for j, code in zip(todo, codes, strict=True):
            # EXISTS: a concurrent save won the race; same bytes.
            results[j] = Saved.WRITTEN if code in (StoreCode.OK, StoreCode.EXISTS) else Reason.of(code)
        for j, f in repeats:
            results[j] = results[f]
        self.retention.settle(kept, lambda j: results[j] is Saved.WRITTEN)
        return results, kept

    def lookup(self, session: Session, request: LookupArgs) -> Hit:
        """Probe in stages, each one batch, only what can still change the answer; a store failure is a miss."""
        if len(request.hashes) > self.max_lookup_hashes:
            # One call's work holds the GIL and a lookup thread for all of it: bounded, so others' lookups go on.
            raise BadRequest(
                f"a Lookup of {len(request.hashes)} block hashes: at most {self.max_lookup_hashes} per call "
                "(--max-lookup-hashes); look up the prompt's first blocks, a hit never extends past a miss"
            )
        geo = session.geometry
        num_tokens = request.num_tokens
        staged = StagedLookup(geo, request.hashes, num_tokens, eagle=request.eagle)
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
                return Hit.miss(len(geo.groups), f"store unavailable: {exc.reason}")
            # C-level passes: a full hit on a 128k-token prompt at T=8 with three groups probes ~140k keys.
            staged.record(list(map(operator.is_, presence, itertools.repeat(Presence.PRESENT))))
            unknown += presence.count(Presence.UNKNOWN)
        hit = staged.answer()
        self.metrics.lookup_hit_tokens.inc(hit.hit_tokens)
        if session.tenant:
            self.metrics.tenant_lookup_hit_tokens.labels(session.tenant).inc(hit.hit_tokens)
        # Unanswered probes count as missing (never as hits); the answer says it may be shorter than the truth.
        if unknown:
            self.metrics.lookup_requests.labels("degraded").inc()
            return hit._replace(degraded=True, detail=f"{unknown} of {staged.probes} existence probes failed")
        self.metrics.lookup_requests.labels("hit" if hit.hit_tokens else "miss").inc()
        return hit

    def load(self, session: Session, request: LoadArgs, deadline: float | None = None) -> LoadOutcome:
        """Read the hit's chunks straight into engine memory with one batch get; name every block that failed.

        deadline (time.monotonic()) is the client's: a transient store failure is tried again only while the retry
        can end before it."""
        batch: Batch[LoadArgs, LoadOutcome] = Batch([request])
        self.load_many(session, batch, deadline)
        return batch.result()

    def load_many(self, session: Session, batch: Batch[LoadArgs, LoadOutcome], deadline: float | None = None) -> None:
        """Several requests' loads (an engine step) with one batch get for all of them, each open request of the
        batch answered on its own. A request whose plan is refused gets its error; nothing is read for it."""
        mover = session.require_mover()
        memory = mover.memory
        loads = batch.step(lambda r: self._load_plan(session, r))
        with _holding(memory):
            loads.vet(lambda load: mover.check(load.reads))
            every = [c for load in loads.open() for c in load.reads]
            codes = self._get(mover, every, deadline) if every else []
        loads.answer_spans(
            lambda load: len(load.reads), lambda load, span: self._loaded(session, memory, load, codes[span])
        )

    def _load_plan(self, session: Session, request: LoadArgs) -> _Load:
        """A request's chunks to read (of the groups it carries), apart from those without a block (counted failed:
        the engine recomputes them)."""
        self.retention.check(session, request.retention)
        r = request
        plan = load_plan(session.geometry, r.hashes, r.block_ids, r.hit_tokens, r.tails, r.start_tokens, r.carried)
        nowhere = [c for c in plan if c.block_id == NO_BLOCK]
        if nowhere:
            kinds = kinds_of(session)
            for c in nowhere:
                if c.part == 0:  # one block, however many values per KV head it is cut into (rule 11)
                    self.metrics.load_failed_blocks.labels(kinds[c.group], Reason.NO_BLOCK.value).inc()
            plan = tuple(c for c in plan if c.block_id != NO_BLOCK)
        return _Load(request, plan, nowhere)

    def _loaded(self, session: Session, memory: SessionMemory, load: _Load, codes: Sequence[Loaded]) -> LoadOutcome:
        """One request's load from its chunks' codes, counted; what it read retained as it asked."""
        outcome = load_outcome(self.metrics, session, memory, load.reads, load.nowhere, codes)
        want = load.args.retention
        if want is None:
            return outcome
        read = [c for c, code in zip(load.reads, codes, strict=True) if code is StoreCode.OK]
        retained, unretained = self.retention.touch(session, memory, read, want)
        return outcome._replace(retained=retained, unretained=unretained)

    def _get(self, mover: Mover, chunks: Sequence[Chunk], deadline: float | None) -> list[Loaded]:
        """Each chunk's read into its block; a key read into n blocks (n requests of a step sharing a prefix) is
        read in n batches, its k-th block in the k-th, so that no batch names a key twice: Mooncake fills only the
        last of a key's places in one batch and reports every one read. A transient failure is read again while the
        deadline allows."""
        keys = [c.key for c in chunks]
        retried = self.metrics.store_retries.labels

        def read(batch: Sequence[int]) -> list[Loaded]:
            whole = len(batch) == len(chunks)  # the first round of a batch naming no key twice: as it is
            with self._timed("get"):
                return mover.get(
                    keys if whole else [keys[j] for j in batch], chunks if whole else [chunks[j] for j in batch]
                )

        def on_retry(code: StoreCode, n: int) -> None:
            retried("get", code.value).inc(n)

        if len(set(keys)) == len(keys):  # nearly every load: one round
            return retry_transient(read, range(len(chunks)), self.retries, deadline, on_retry)
        codes: list[Loaded] = [StoreCode.OK] * len(chunks)
        seen: dict[str, int] = {}
        rounds: list[list[int]] = []
        for j, key in enumerate(keys):
            k = seen.get(key, 0)
            seen[key] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(j)
        for batch in rounds:
            got = retry_transient(read, batch, self.retries, deadline, on_retry)
            for j, code in zip(batch, got, strict=True):
                codes[j] = code
        return codes

    def reset(self, session: Session) -> int:
        """Remove every block of the session's model under its cache prefix, and nothing else."""
        layout = session.layout
        # The rest of the key must have exactly the key format's shape: a reset of one model must not sweep along
        # a model whose name continues it in some other tenant's keys.
        prefix = key_prefix(layout.model, layout.cache_prefix)
        with self._timed("remove"):
            removed = self.store.remove_prefix(prefix, KEY_TAIL_PATTERN)
        self.retention.forget_prefix(prefix)
        self.events.cleared(session.tenant, prefix)
        return removed

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

    def _timed(self, operation: str) -> Timed:
        """Times a store call into store_operation_seconds (the label's child looked up once per data path)."""
        histogram = self._histograms.get(operation)
        if histogram is None:
            histogram = self._histograms[operation] = self.metrics.store_operation_seconds.labels(operation)
        return Timed(histogram)


class _Save(NamedTuple):
    """A save request with its plan."""

    args: SaveArgs
    plan: SavePlan


class _Load(NamedTuple):
    """A load request with the chunks it reads and those it has no block for."""

    args: LoadArgs
    reads: Sequence[Chunk]
    nowhere: Sequence[Chunk]


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


@contextmanager
def _holding(memory: SessionMemory) -> Iterator[None]:
    memory.acquire()
    try:
        yield
    finally:
        memory.release()
