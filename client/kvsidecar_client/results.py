"""Value types the client returns, built from the daemon's response messages (a lookup's Hit is the contract's own,
`kvsidecar_contract.mapping.hit_from_message`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvsidecar_contract.placement import Hit
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["FailedBlock", "GroupPlacement", "Hit", "LoadResult", "Registration", "SaveResult", "SessionInfo"]


class FailedBlock(NamedTuple):
    """One block a save or load could not move, with the store's reason (e.g. "not_found", "no_space")."""

    group: int
    block_id: int
    reason: str


def _failures(items: Iterable[pb.FailedBlock]) -> tuple[FailedBlock, ...]:
    return tuple(FailedBlock(f.group, f.block_id, f.reason) for f in items)


class SaveResult(NamedTuple):
    """What one save did: values written, already stored, failed, and left to other ranks of the replication set."""

    written: int
    skipped: int
    failed: int
    striped_to_others: int
    bytes_written: int
    failures: tuple[FailedBlock, ...] = ()
    absent: int = 0  # values this rank would write but had no block for (NO_BLOCK)
    retained: int = 0  # values the store keeps ahead of ordinary cache (a save that asked for retention)
    unretained: int = 0  # values it asked to retain that are ordinary cache: the tenant's retention budget is spent

    @classmethod
    def from_proto(cls, message: pb.SaveResponse) -> SaveResult:
        """From the daemon's SaveResponse."""
        return cls(
            message.written,
            message.skipped,
            message.failed,
            message.striped_to_others,
            message.bytes_written,
            _failures(message.failures),
            message.absent,
            message.retained,
            message.unretained,
        )


class LoadResult(NamedTuple):
    """What one load did, naming every block that failed (the engine recomputes exactly those)."""

    loaded: int
    bytes_loaded: int
    failures: tuple[FailedBlock, ...] = ()
    retained: int = 0  # values read that the store keeps ahead of ordinary cache (a load that asked for retention)
    unretained: int = 0

    @property
    def failed_block_ids(self) -> set[int]:
        """The failed blocks' ids (engines that allocate all groups from one block pool keep them unique)."""
        return {f.block_id for f in self.failures}

    @classmethod
    def from_proto(cls, message: pb.LoadResponse) -> LoadResult:
        """From the daemon's LoadResponse."""
        return cls(
            message.loaded, message.bytes_loaded, _failures(message.failures), message.retained, message.unretained
        )


class Registration(NamedTuple):
    """The daemon's view of registered memory: bytes mapped, and bytes of one stored value per group."""

    mapped_bytes: int
    value_bytes: tuple[int, ...]

    @classmethod
    def from_proto(cls, message: pb.RegisterMemoryResponse) -> Registration:
        """From the daemon's RegisterMemoryResponse."""
        return cls(message.mapped_bytes, tuple(message.value_bytes))


class GroupPlacement(NamedTuple):
    """How the daemon places one group for this rank (docs/placement.md rules 1, 2, 6, 7)."""

    replication_factor: int
    shard_id: int
    keys_per_boundary: int
    span_tokens: int
    shared_across_tp: bool = False  # values every TP size reads (rule 11)
    values_per_block: int = 1  # one per KV head this rank holds where shared, else 1


class SessionInfo(NamedTuple):
    """What OpenSession told this client: lease, hit alignment, per-group placement, daemon version."""

    lease_ms: int
    hit_alignment_tokens: int
    fine_grained_hits: bool
    groups: tuple[GroupPlacement, ...]
    daemon_version: str
    tenant: str = ""  # the tenant the daemon put the session in ("" single-tenant)
    packed_hashes: bool = False  # the daemon reads a Lookup's hashes packed into one field

    @classmethod
    def from_proto(cls, message: pb.OpenSessionResponse) -> SessionInfo:
        """From the daemon's OpenSessionResponse."""
        groups = tuple(
            GroupPlacement(
                g.replication_factor,
                g.shard_id,
                g.keys_per_boundary,
                g.span_tokens,
                g.shared_across_tp,
                g.values_per_block or 1,
            )
            for g in message.groups
        )
        return cls(
            message.lease_ms,
            message.hit_alignment_tokens,
            message.fine_grained_hits,
            groups,
            message.daemon_version,
            message.tenant,
            message.packed_hashes,
        )
