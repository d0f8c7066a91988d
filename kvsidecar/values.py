"""The daemon's domain values that requests carry in and results carry out; wire.py converts them to and from proto.

Plain values only: nothing here maps memory, talks to the store or knows gRPC.

Imports: reasons.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvsidecar.reasons import Reason
from kvsidecar_contract.placement import Parallel

__all__ = [
    "CudaHandle",
    "MemfdHandle",
    "Failure",
    "Handle",
    "LoadArgs",
    "LoadOutcome",
    "LookupArgs",
    "RegionRequest",
    "RetentionArgs",
    "Role",
    "SaveArgs",
    "SaveOutcome",
    "SessionSummary",
    "ShmHandle",
]


class Role(enum.Enum):
    """What a session may do."""

    RANK = "rank"  # registers memory, saves, loads, looks up
    SCHEDULER = "scheduler"  # looks up only


@dataclass(frozen=True, slots=True)
class ShmHandle:
    """A named POSIX shared-memory segment of the engine."""

    name: str


@dataclass(frozen=True, slots=True)
class MemfdHandle:
    """The index-th sealed memfd the session handed over its side socket."""

    index: int


@dataclass(frozen=True, slots=True)
class CudaHandle:
    """A CUDA allocation of the engine, as torch's IPC reduction describes it, and which GPU it is on."""

    device: int  # the engine's index of the GPU, which may not be the daemon's
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str = ""  # the GPU's UUID (empty from an older client)


Handle = ShmHandle | CudaHandle | MemfdHandle  # what names a region's memory


@dataclass(frozen=True, slots=True)
class RegionRequest:
    """One strided view of engine memory as a RegisterMemory request describes it (checked and mapped by memory/)."""

    handle: Handle | None  # None: the request named no handle
    mapping_bytes: int
    offset: int
    stride: int
    block_bytes: int
    num_blocks: int
    groups: tuple[int, ...]
    heads: int = 0  # KV heads a block holds head-major (equal consecutive parts); 0: not declared


class Failure(NamedTuple):
    """A block whose save or load failed, and why."""

    group: int
    block_id: int
    reason: Reason


class SaveOutcome(NamedTuple):
    """What one save did."""

    written: int
    skipped: int
    failures: tuple[Failure, ...]
    striped_to_others: int
    bytes_written: int
    absent: int = 0
    retained: int = 0  # values kept ahead of ordinary cache (docs/retention.md)
    unretained: int = 0  # values asked to be retained that stay ordinary cache (the tenant's budget is spent)


class RetentionArgs(NamedTuple):
    """How long a request's values are kept ahead of ordinary cache, and how much that matters (docs/retention.md)."""

    seconds: float  # from now; unused for a hard pin
    priority: int = 100  # 0-100: the share of its tenant's retention budget it may fill
    renew: bool = False  # values already retained start their time again
    end_tokens: int = 0  # only the values of tokens [0, end_tokens) (0: all)
    hard: bool = False  # an operator's hard pin


class SaveArgs(NamedTuple):
    """One request's save: its hashes, per-group block ids, tokens computed and tokens saved before."""

    hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    num_tokens: int
    saved: int = 0
    tokens: Sequence[int] = ()  # the request's token ids from tokens_start on, if the client sent them (KV events)
    tokens_start: int = 0
    retention: RetentionArgs | None = None


class LookupArgs(NamedTuple):
    """One lookup: the prompt's hashes, its tokens, and whether the engine drafts with EAGLE (one block less)."""

    hashes: Sequence[bytes]
    num_tokens: int
    eagle: bool = False


class LoadArgs(NamedTuple):
    """One request's load: a lookup's hit and tails, and the tokens the engine already holds."""

    hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    hit_tokens: int
    tails: Sequence[int]
    start_tokens: int = 0
    retention: RetentionArgs | None = None  # a hit retains what it read as a save would
    carried: Sequence[int] = ()  # the groups the load is for (empty: every group); the others are not read


class LoadOutcome(NamedTuple):
    """What one load did."""

    loaded: int
    bytes_loaded: int
    failures: tuple[Failure, ...]
    retained: int = 0
    unretained: int = 0


class SessionSummary(NamedTuple):
    """What operators see of one open session (Stats)."""

    id_prefix: str
    role: Role
    model: str
    cache_prefix: str
    parallel: Parallel
    mapped_bytes: int
    age_seconds: float
    client_name: str
    tenant: str = ""
    data_connections: int = 0  # connections bound to it on the data socket now
