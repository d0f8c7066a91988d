"""The connector's scheduler side: lookups, and each step's plan of loads and saves for the workers.

It runs in vLLM's scheduler process with a `scheduler`-role session (lookups only, no memory). Everything here is
bookkeeping over vLLM's request and block state; the worker side moves the bytes.

Lookups never hold up vLLM's scheduling loop: a request's lookup is sent from a client thread when vLLM first asks
about it, and vLLM is told "not known yet" (`None`, which vLLM 0.32 and 0.33 take as "ask again next step", keeping
the request waiting) until the answer is in. A step waits for answers at most `LOOKUP_STEP_WAIT` seconds, all its
requests together (`LOOKUP_IDLE_WAIT` after a step that computed nothing: there is no batch to hold up, and an
engine spinning through empty steps would take the CPU the daemon needs to answer); a lookup not answered within
the lookup deadline is a miss.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_client.client import SidecarClient
from kvsidecar_client.deadlines import DEFAULT_LOOKUP_TIMEOUT
from kvsidecar_client.errors import SidecarError
from kvsidecar_client.results import Hit
from kvsidecar_client.retention import Retention, retention_of
from kvsidecar_client.vllm.metadata import KVSidecarMetadata, LoadSpec, SaveSpec
from kvsidecar_client.vllm.plan import Spans, check_save, load_block_ids
from kvsidecar_client.vllm.specs import EngineGroups
from kvsidecar_client.vllm.stats import KVSidecarStats, StatsRecorder

__all__ = ["LOOKUP_IDLE_WAIT", "LOOKUP_STEP_WAIT", "SchedulerSide"]

log = logging.getLogger("kvsidecar_client.vllm")

# How long one scheduler step may wait, over all its requests, for lookups in flight: a fast daemon's answer is
# used in the step that asked (a one-block lookup takes ~1 ms here), a slow one's in a later step.
LOOKUP_STEP_WAIT = 0.001
# The same after a step that scheduled no token: the engine is idle but for requests waiting on the connector.
LOOKUP_IDLE_WAIT = 0.01


@dataclass
class _Lookup:
    """A lookup in flight: the (hashes, tokens) it asks about, its answer to come, and when it becomes a miss."""

    key: tuple[int, int]
    future: concurrent.futures.Future[Hit]
    deadline: float


@dataclass
class _Tracked:
    """What the scheduler side remembers about one request between vLLM's calls."""

    request: Any
    lookup_start: int = 0
    hit: Hit | None = None
    # The store's answer while the request waits (None: a miss), and the (hashes, tokens) it was asked for.
    answer: Hit | None = None
    answer_key: tuple[int, int] | None = None
    lookup: _Lookup | None = None
    saved_tokens: int = 0
    had_saves: bool = False
    loading: bool = False
    known_blocks: frozenset[int] = field(default_factory=frozenset)
    retention: Retention | None = None  # what its kv_transfer_params ask to keep (or the engine's default)


class SchedulerSide:
    """Lookups for vLLM's scheduler and the metadata its workers act on; one per engine."""

    def __init__(
        self,
        client: SidecarClient,
        groups: EngineGroups,
        shape: Spans,
        *,
        eagle: bool = False,
        load: bool = True,
        save: bool = True,
        stats: StatsRecorder | None = None,
        lookup_deadline: float = DEFAULT_LOOKUP_TIMEOUT,
        step_wait: float = LOOKUP_STEP_WAIT,
        idle_wait: float = LOOKUP_IDLE_WAIT,
        retention: Retention | None = None,
    ) -> None:
        """retention: the retention of requests whose kv_transfer_params ask for none (docs/retention.md)."""
        self._client = client
        self._stats = stats if stats is not None else StatsRecorder()
        self._groups = groups
        self._shape = shape
        self._eagle = eagle
        self._load = load
        self._save = save
        self._lookup_deadline = lookup_deadline
        self._retention = retention
        self._step_wait = step_wait
        self._idle_wait = idle_wait
        self._wait_left = step_wait  # of this step's wait for lookups in flight
        self._recurrent = any(g.recurrent for g in shape.groups)
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[LoadSpec] = []
        self._delayed_saves: set[str] = set()
        self._manager: Any = None
        self._null_block = 0

    def bind_kv_cache_manager(self, manager: Any) -> None:
        """vLLM's KV-cache manager: the live block table of every request, and the id of its null block."""
        self._manager = manager
        self._null_block = int(manager.block_pool.null_block.block_id)

    # ---- admission ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past `num_computed_tokens` the store can serve, loaded asynchronously when there are any; None
        while the store's answer is not in yet (vLLM keeps the request waiting and asks again next step).

        vLLM asks again at every step while a request waits; the store is asked once, and its answer kept until
        the request is scheduled (a preempted request asks afresh) or finished. A hit that goes stale meanwhile
        is safe: the load names the blocks it could not write and vLLM recomputes them.
        """
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = _Tracked(request, retention=self._retention_of(request))
        tracked.hit = None
        # A request admitted again (after a preemption) holds none of the blocks it held before.
        tracked.known_blocks = frozenset()
        if not self._load:
            return 0, False
        u = self._shape.hash_block_size
        hashes = list(request.block_hashes[: request.num_tokens // u])
        if len(hashes) * u <= num_computed_tokens:
            return 0, False  # the store cannot beat the local prefix cache
        key = (len(hashes), request.num_tokens)
        if tracked.answer_key != key:
            answered, answer = self._answer(tracked, hashes, key)
            if not answered:
                return None, False
            tracked.answer, tracked.answer_key = answer, key
        hit = tracked.answer
        if hit is None or hit.hit_tokens <= num_computed_tokens:
            return 0, False
        tracked.hit = hit
        tracked.lookup_start = num_computed_tokens
        return hit.hit_tokens - num_computed_tokens, True

    def _answer(self, tracked: _Tracked, hashes: list[bytes], key: tuple[int, int]) -> tuple[bool, Hit | None]:
        """(answered, the store's hit or None for a miss) for `key`: starts its lookup if none is in flight, and
        waits for it no longer than what is left of this step's wait."""
        request = tracked.request
        pending = tracked.lookup
        if pending is None or pending.key != key:
            if pending is not None:
                pending.future.cancel()
            try:
                future = self._client.lookup_async(hashes, request.num_tokens, eagle=self._eagle)
            except SidecarError as error:  # the client is closed
                log.warning(
                    "kvsidecar lookup for request %s not sent, treating it as a miss: %s", request.request_id, error
                )
                tracked.lookup = None
                return True, None
            pending = tracked.lookup = _Lookup(key, future, time.monotonic() + self._lookup_deadline)
        future = pending.future
        if not future.done() and self._wait_left > 0:
            started = time.monotonic()
            concurrent.futures.wait((future,), timeout=self._wait_left)
            self._wait_left -= time.monotonic() - started
        if not future.done():
            if time.monotonic() < pending.deadline:
                return False, None
            # Its answer no longer counts, whenever it comes: the request proceeds as a miss.
            future.cancel()
            tracked.lookup = None
            log.warning(
                "kvsidecar lookup for request %s not answered within %.3g s, treating it as a miss",
                request.request_id,
                self._lookup_deadline,
            )
            return True, None
        tracked.lookup = None
        sent = pending.deadline - self._lookup_deadline
        try:
            hit = future.result()
        except SidecarError as error:
            # A lookup is an optimization: a refused one is a miss, and the engine recomputes.
            log.warning("kvsidecar lookup for request %s failed, treating it as a miss: %s", request.request_id, error)
            self._stats.add(lookups=1, lookup_failures=1, lookup_seconds=time.monotonic() - sent)
            return True, None
        self._stats.add(
            lookups=1,
            lookup_tokens=request.num_tokens,
            hit_tokens=hit.hit_tokens,
            lookup_seconds=time.monotonic() - sent,
            lookup_failures=1 if hit.degraded else 0,
        )
        return True, (hit if hit.hit_tokens > 0 else None)

    @property
    def lookups_in_flight(self) -> int:
        """Requests whose lookup was sent and not yet taken up by vLLM (for operators and tests)."""
        return sum(1 for tracked in self._tracked.values() if tracked.lookup is not None)

    def wait_for_lookups(self, timeout: float) -> bool:
        """Wait up to `timeout` s until every lookup in flight is answered (tests that want a step's answers in
        the next step); True when none is left unanswered."""
        futures = [t.lookup.future for t in self._tracked.values() if t.lookup is not None]
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of a hit once vLLM has allocated the blocks it goes into."""
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            # Scheduled: the answer kept while it waited is spent (after a preemption it is asked afresh).
            tracked.answer, tracked.answer_key = None, None
        if num_external_tokens <= 0 or tracked is None or tracked.hit is None:
            return
        hit, start = tracked.hit, tracked.lookup_start
        tracked.hit = None
        ids = self._groups.select(blocks.get_block_ids())
        reads = load_block_ids(self._shape, ids, hit.hit_tokens, start)
        refused = ""
        if start + num_external_tokens != hit.hit_tokens:
            # The daemon serves exactly the hit it found (its tail boundaries are for that length); a shorter
            # load is not one it can do, so the whole range is recomputed instead.
            refused = f"vLLM admitted {num_external_tokens} external tokens of the {hit.hit_tokens - start} found"
        elif any(b == self._null_block for group in reads for b in group):
            refused = "vLLM gave a null block to a block the load writes"
        u = self._shape.hash_block_size
        self._pending_loads.append(
            LoadSpec(
                req_id=request.request_id,
                block_hashes=tuple(request.block_hashes[: max(hit.hit_tokens, *hit.tail_boundaries) // u]),
                block_ids=tuple(tuple(g) for g in ids),
                hit=hit,
                start_tokens=start,
                reads=tuple(tuple(g) for g in reads),
                refused=refused,
                retention=tracked.retention,
            )
        )
        tracked.loading = True

    # ---- each step ----

    def build_connector_meta(self, scheduler_output: Any) -> KVSidecarMetadata:
        """This step's loads and saves, and the blocks it may write (which saves still reading them must fence)."""
        # vLLM builds the metadata once at the end of each schedule(): the next step may wait afresh, longer when
        # this one computed nothing (no running request to hold up).
        busy = bool(getattr(scheduler_output, "num_scheduled_tokens", None))
        self._wait_left = self._step_wait if busy else self._idle_wait
        meta = KVSidecarMetadata(loads=self._pending_loads, delayed_saves=frozenset(self._delayed_saves))
        self._pending_loads = []
        self._delayed_saves = set()
        reused: set[int] = set()
        for load in meta.loads:
            reused.update(b for group in load.reads for b in group)
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
            reused.add(int(copy.dst_block_id))
        reused.update(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
        for req_id, computed in self._scheduled(scheduler_output):
            tracked = self._tracked.get(req_id)
            if tracked is None or self._manager is None:
                continue
            table = self._manager.get_block_ids(req_id)
            blocks = frozenset(b for group in table for b in group if b != self._null_block)
            reused.update(blocks - tracked.known_blocks)
            tracked.known_blocks = blocks
            ids = self._groups.select(table)
            # Recurrent state is written in place by every step of its request.
            for g, shape in enumerate(self._shape.groups):
                if shape.recurrent:
                    reused.update(b for b in ids[g] if b != self._null_block)
            if self._save:
                scheduled = scheduler_output.num_scheduled_tokens[req_id]
                save = self._plan_save(tracked, ids, computed, scheduled, scheduler_output)
                if save is not None:
                    meta.saves.append(save)
        reused.discard(self._null_block)
        meta.reused_block_ids = frozenset(reused)
        return meta

    def _scheduled(self, scheduler_output: Any) -> Iterable[tuple[str, int]]:
        """(request id, tokens computed before this step) of every request this step computes."""
        for new in scheduler_output.scheduled_new_reqs:
            yield new.req_id, new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        yield from zip(cached.req_ids, cached.num_computed_tokens, strict=True)

    def _plan_save(
        self, tracked: _Tracked, ids: Sequence[Sequence[int]], computed: int, scheduled: int, scheduler_output: Any
    ) -> SaveSpec | None:
        request = tracked.request
        u = self._shape.hash_block_size
        # Tokens whose KV is final after this step: draft tokens are not (they may be rejected).
        num_tokens = min(computed + scheduled, request.num_tokens, len(request.block_hashes) * u)
        saved = tracked.saved_tokens
        if num_tokens <= saved:
            return None
        if self._recurrent and num_tokens != computed + scheduled:
            # Recurrent state after this step includes draft tokens: no state of this step is one to store.
            tracked.saved_tokens = num_tokens
            return None
        check = check_save(self._shape, ids, num_tokens, saved, self._null_block)
        tracked.saved_tokens = num_tokens
        if not check.ok:
            log.debug(
                "kvsidecar: not saving request %s up to %d tokens: %s", request.request_id, num_tokens, check.reason
            )
            return None
        if not check.chunks:
            return None
        tracked.had_saves = True
        # From the start of the widest block this save may write: every written block's tokens are covered.
        first = saved - saved % max(self._shape.spans)
        return SaveSpec(
            req_id=request.request_id,
            block_hashes=tuple(request.block_hashes[: num_tokens // u]),
            block_ids=check.block_ids,
            num_tokens=num_tokens,
            saved_tokens=saved,
            reads=check.reads,
            token_ids=tuple(request.all_token_ids[first:num_tokens]),
            token_ids_start=first,
            retention=tracked.retention,
        )

    def _retention_of(self, request: Any) -> Retention | None:
        """What the request's kv_transfer_params ask to keep (vLLM's, Dynamo's or this client's names), else the
        engine's default; a request that gets them wrong keeps the default, and the log says why."""
        params = getattr(request, "kv_transfer_params", None)
        try:
            return retention_of(params, self._retention)
        except SidecarError as error:
            log.warning("kvsidecar: request %s: its retention is not used: %s", request.request_id, error)
            return self._retention

    def take_stats(self) -> KVSidecarStats | None:
        """Lookups counted since the last call, or None."""
        return self._stats.take()

    def update_connector_output(self, connector_output: Any) -> None:
        """Loads the workers finished: their requests no longer hold blocks for the connector."""
        for req_id in connector_output.finished_recving or ():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.loading = False

    # ---- the end of a request ----

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the request's blocks until the workers report the connector is done with them.

        A load in flight writes into them: vLLM frees them when the workers report it received. Saves in flight
        read them: the workers report them sent once every save of the request is done.
        """
        req_id = request.request_id
        tracked = self._tracked.pop(req_id, None)
        if tracked is None:
            return False, None
        if tracked.lookup is not None:
            # Finished (aborted) while its lookup is in flight: nothing waits for the answer any more.
            tracked.lookup.future.cancel()
            tracked.lookup = None
        if any(load.req_id == req_id for load in self._pending_loads):
            # Planned but not yet sent to the workers: drop it, nothing writes into the blocks.
            self._pending_loads = [load for load in self._pending_loads if load.req_id != req_id]
            tracked.loading = False
        if tracked.loading:
            return True, None
        if tracked.had_saves:
            self._delayed_saves.add(req_id)
            return True, None
        return False, None
