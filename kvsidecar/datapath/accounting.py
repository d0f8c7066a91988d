"""One request's save or load outcome from its chunks' results, counted for operators (the data path's accounting)."""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Sequence

from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.sums import Loaded
from kvsidecar.reasons import Reason
from kvsidecar.sessions.session import Session
from kvsidecar.store import StoreCode
from kvsidecar.values import Failure, LoadOutcome, SaveOutcome
from kvsidecar_contract.placement import Chunk, SavePlan

__all__ = ["Saved", "kinds_of", "load_outcome", "save_failed", "save_outcome"]

log = logging.getLogger(__name__)


class Saved(enum.Enum):
    """A chunk of a save that did not fail: its value was already stored, or this save wrote it."""

    PRESENT = "present"
    WRITTEN = "written"


ChunkResult = Saved | Reason


def kinds_of(session: Session) -> list[str]:
    """Each group's kind, as metrics label it."""
    return [g.kind.value for g in session.layout.groups]


def save_outcome(
    metrics: Metrics, session: Session, memory: SessionMemory, plan: SavePlan, results: Sequence[ChunkResult]
) -> SaveOutcome:
    """One request's save from its chunks' results, counted for operators."""
    kinds = kinds_of(session)
    written = bytes_written = skipped = 0
    over_budget: list[Failure] = []
    failures: list[Failure] = []
    # Counted per group and added to the metrics once per group: a save moves hundreds of chunks.
    saved_per_group = [0] * len(kinds)
    skipped_per_group = [0] * len(kinds)
    for chunk, result in zip(plan.chunks, results, strict=True):
        # Blocks for operators: a block cut per KV head (rule 11) counts once, by its first head's value.
        if result is Saved.PRESENT:
            skipped += 1
            skipped_per_group[chunk.group] += chunk.part == 0
        elif result is Saved.WRITTEN:
            written += 1
            bytes_written += memory.part_bytes[chunk.group][chunk.part]
            saved_per_group[chunk.group] += chunk.part == 0
        else:
            (over_budget if result is Reason.TENANT_BUDGET else failures).append(
                Failure(chunk.group, chunk.block_id, result)
            )
            metrics.save_failed_blocks.labels(kinds[chunk.group], result.value).inc()
    if session.tenant and over_budget:
        metrics.tenant_refused.labels(session.tenant, Reason.TENANT_BUDGET.value).inc(len(over_budget))
    for g, kind in enumerate(kinds):
        if saved_per_group[g]:
            metrics.saved_blocks.labels(kind).inc(saved_per_group[g])
        if skipped_per_group[g]:
            metrics.save_skipped_blocks.labels(kind).inc(skipped_per_group[g])
    metrics.saved_bytes.inc(bytes_written)
    if session.tenant:
        metrics.tenant_saved_blocks.labels(session.tenant).inc(written)
        metrics.tenant_saved_bytes.labels(session.tenant).inc(bytes_written)
    return SaveOutcome(written, skipped, (*over_budget, *failures), plan.others, bytes_written, plan.absent)


def load_outcome(
    metrics: Metrics,
    session: Session,
    memory: SessionMemory,
    chunks: Sequence[Chunk],
    nowhere: Sequence[Chunk],
    codes: Sequence[Loaded],
) -> LoadOutcome:
    """One request's load from its chunks' codes, counted for operators; what failed is logged once per request,
    with the first key that failed its checksum."""
    kinds = kinds_of(session)
    loaded = nbytes = 0
    failures = [Failure(c.group, c.block_id, Reason.NO_BLOCK) for c in nowhere if c.part == 0]
    # Operators count blocks: a block cut in one value per KV head (rule 11) is loaded when every head is, and
    # fails once, whichever of its heads failed.
    loaded_per_group = [0] * len(kinds)
    failed: dict[tuple[int, int], Loaded] = {}
    corrupt: list[str] = []
    for chunk, code in zip(chunks, codes, strict=True):
        if chunk.part == 0:
            loaded_per_group[chunk.group] += 1
        if code is StoreCode.OK:
            loaded += 1
            nbytes += memory.part_bytes[chunk.group][chunk.part]
            continue
        if code is Reason.CHECKSUM_MISMATCH:
            corrupt.append(chunk.key)
        if (chunk.group, chunk.span_index) not in failed:
            failed[chunk.group, chunk.span_index] = code
            failures.append(Failure(chunk.group, chunk.block_id, code if isinstance(code, Reason) else Reason.of(code)))
    for (g, _), code in failed.items():
        loaded_per_group[g] -= 1
        metrics.load_failed_blocks.labels(kinds[g], code.value).inc()
    if failed:
        # Once per request: a load that fails what a lookup promised costs the engine a recompute.
        causes = Counter(code.value for code in failed.values())
        log.warning(
            "load of session %s: %d of %d blocks failed (%s); the engine recomputes them%s",
            session.id[:8],
            len(failed),
            len({(c.group, c.span_index) for c in chunks}),
            ", ".join(f"{reason}: {n}" for reason, n in causes.most_common()),
            f"; {len(corrupt)} values read failed their checksum (first {corrupt[0]}): not served, removed from "
            "the store"
            if corrupt
            else "",
        )
    for g, kind in enumerate(kinds):
        if loaded_per_group[g]:
            metrics.loaded_blocks.labels(kind).inc(loaded_per_group[g])
    metrics.loaded_bytes.inc(nbytes)
    if session.tenant:
        metrics.tenant_loaded_blocks.labels(session.tenant).inc(loaded)
        metrics.tenant_loaded_bytes.labels(session.tenant).inc(nbytes)
    return LoadOutcome(loaded, nbytes, tuple(failures))


def save_failed(
    metrics: Metrics, session: Session, chunks: Sequence[Chunk], code: StoreCode, others: int
) -> SaveOutcome:
    """A save none of whose values could be asked about: every chunk failed with the store's code."""
    kinds = kinds_of(session)
    reason = Reason.of(code)
    for c in chunks:
        metrics.save_failed_blocks.labels(kinds[c.group], reason.value).inc()
    return SaveOutcome(0, 0, tuple(Failure(c.group, c.block_id, reason) for c in chunks), others, 0)
