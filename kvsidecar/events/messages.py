"""vLLM's KV-event messages, as values of our own that encode to the same msgpack bytes.

vLLM (`vllm.distributed.kv_events`, 0.33) publishes `KVEventBatch(ts, events, data_parallel_rank)` as a msgpack
array, whose events are tagged structs: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, each a map with a `type`
key naming its class and without the fields left at their defaults. These classes have the same names, fields and
defaults (less vLLM's optional fields we never set: locality, ownership, session_id, lookahead_token_ids), so vLLM's
own decoder (`msgspec.msgpack.Decoder(KVEventBatch)`) reads what we encode unchanged; the vLLM 0.33 suite
(tests/vllm_connector/test_kv_events.py) checks that with vLLM's classes.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "encode_batch",
]

MEDIUM_CPU = "CPU"  # the store's DRAM pool (Mooncake segments)
MEDIUM_STORAGE = "STORAGE"  # the disk tier under --ssd-dir

BlockHash = bytes | int  # vLLM's ExternalBlockHash: the engine's hash bytes (or their int form)


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One KV-cache event; tagged with its class name, as vLLM's KVCacheEvent."""


class BlockStored(_Event):
    """Consecutive blocks of one group now held: hashes in prompt order, the first's parent, their tokens."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event):
    """Blocks no longer held in `medium`."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    """Every block the topic's subscriber knows of is gone."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: a timestamp (time.time()) and events in order."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch's msgpack bytes, as vLLM's publisher sends them."""
    return _ENCODER.encode(batch)
