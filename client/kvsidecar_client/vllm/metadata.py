"""What the scheduler side tells every worker each step: loads to start, saves to issue, blocks about to be reused.

Plain picklable values: vLLM ships the metadata to worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvsidecar_client.results import Hit
from kvsidecar_client.retention import Retention

__all__ = ["KVSidecarMetadata", "LoadSpec", "SaveSpec"]


@dataclass(frozen=True)
class LoadSpec:
    """Read a lookup's hit into a request's blocks (one list of block ids per session group).

    `reads` are the block ids the load writes (for reporting every one of them when the daemon cannot be asked).
    `refused` says why the scheduler already knows the load cannot be right: the worker then reports all of
    `reads` as failed without asking the daemon.
    """

    req_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    hit: Hit
    start_tokens: int
    reads: tuple[tuple[int, ...], ...]
    refused: str = ""
    retention: Retention | None = None  # what the hit keeps ahead of ordinary cache (the request's or the default)


@dataclass(frozen=True)
class SaveSpec:
    """Save a request's blocks over (saved_tokens, num_tokens]; `reads` are the block ids the daemon reads."""

    req_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    saved_tokens: int
    reads: frozenset[int]
    # The request's tokens from token_ids_start on, covering every block this save writes (for the KV events).
    token_ids: tuple[int, ...] = ()
    token_ids_start: int = 0
    retention: Retention | None = None  # what the save keeps ahead of ordinary cache (the request's or the default)


@dataclass
class KVSidecarMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the worker side."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Finished requests whose blocks vLLM keeps until every worker reports their saves done.
    delayed_saves: frozenset[str] = frozenset()
    # Blocks this step may write (new allocations, copies, loads, recurrent state written in place): a save
    # still reading one of them must finish before the step's forward pass or load starts.
    reused_block_ids: frozenset[int] = frozenset()
