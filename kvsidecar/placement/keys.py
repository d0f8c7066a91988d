"""Store key strings (rule 3), byte-compatible with vLLM's in-tree Mooncake store connector."""

from __future__ import annotations


def namespace_prefix(
    model_key: str, cache_prefix: str, shard: int, pcp_rank: int, dcp_rank: int, pp_rank: int, group: int
) -> str:
    """The key prefix of one namespace: everything before `@<hash_hex>`."""
    head = f"{cache_prefix}@" if cache_prefix else ""
    return f"{head}{model_key}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"


def block_key(prefix: str, block_hash: bytes) -> str:
    """The key of the value stored under block_hash in the namespace `prefix`."""
    return f"{prefix}@{block_hash.hex()}"


def hash_suffixes(block_hashes: list[bytes] | tuple[bytes, ...]) -> list[str]:
    """`@<hex>` for every hash, computed once per request so keys are one concatenation each."""
    return ["@" + h.hex() for h in block_hashes]
