"""Sessions with guarded memory, for fuzz tests: which segments and geometries serve each group, and the check that
only a successful Load of the owning session wrote, and only into the slices of the block ids it named."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.fuzzwire import Outcome, Wire
from support.guarded import Geometry, GuardedSegment, Range


@dataclass
class Guarded:
    """A registered session and, per group, the (segment, geometry) of each of its regions in order."""

    session: str
    groups: list[list[tuple[GuardedSegment, Geometry]]]
    segments: list[GuardedSegment] = field(default_factory=list)

    def allowed(self, block_ids: Sequence[pb.BlockIds]) -> dict[str, list[Range]]:
        """Per segment name, the slices a Load naming these ids may write."""
        out: dict[str, list[Range]] = {s.name: [] for s in self.segments}
        for g, regions in enumerate(self.groups):
            if g >= len(block_ids):
                break
            for segment, geo in regions:
                out.setdefault(segment.name, []).extend(geo.slices(block_ids[g].ids))
        return out


def check_memory(
    owners: Sequence[Guarded], writer: Guarded | None, outcome: Outcome, ids: Sequence[pb.BlockIds] = ()
) -> None:
    """Only a successful Load may change memory: its own session's, in the slices of the ids it named."""
    allowed = writer.allowed(ids) if writer is not None and outcome.ok else {}
    for owner in owners:
        for segment in owner.segments:
            bad = segment.violations(allowed.get(segment.name, []) if owner is writer else [])
            if bad:
                raise AssertionError(
                    f"{outcome.method} ({outcome.code.name}) changed bytes it may not write in segment "
                    f"{segment.name} of {segment.size} bytes, at {bad[:5]}"
                )


def loaded_ids(method: str, req: Any, out: Outcome) -> list[pb.BlockIds]:
    """The block ids a request may have written into: a Load's, or those of a LoadBatch's answered items."""
    if method == "Load":
        return list(req.block_ids)
    if method != "LoadBatch" or not out.ok:
        return []
    response = out.response
    if isinstance(response, bytes):  # a raw call's answer
        response = pb.LoadBatchResponse.FromString(response)
    answered = [
        i.request for i, r in zip(req.items, response.results, strict=True) if r.WhichOneof("outcome") == "response"
    ]
    groups = max((len(r.block_ids) for r in answered), default=0)
    return [
        pb.BlockIds(ids=[b for r in answered if g < len(r.block_ids) for b in r.block_ids[g].ids])
        for g in range(groups)
    ]


def close_all(wire: Wire, sessions: Sequence[str], segments: Sequence[GuardedSegment]) -> None:
    """Close sessions (whatever state they are in) and unlink segments."""
    for sid in sessions:
        wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=sid))
    for segment in segments:
        segment.close()
