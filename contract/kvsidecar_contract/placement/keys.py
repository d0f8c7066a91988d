"""Store key strings (rule 3), byte-compatible with vLLM's in-tree Mooncake store connector."""

from __future__ import annotations

# Everything after `[<cache_prefix>@]<model>@` in a key, as a regular expression (the same in Python and in
# Mooncake's ECMAScript flavour): what a reset of one model must match exactly, so a model named like another
# tenant's key can never be swept along with it.
KEY_TAIL_PATTERN = r"tp_rank:[0-9]+@pcp[0-9]+@dcp[0-9]+@pp_rank:[0-9]+@group:[0-9]+@[0-9a-f]+"


def model_key(model: str) -> str:
    """The model's field in keys: the last path component of its name (a model key is its own model key)."""
    return model.rstrip("/").split("/")[-1]


def key_prefix(model: str, cache_prefix: str) -> str:
    """`[<cache_prefix>@]<model key>@`: the start of every key of one model under one cache prefix."""
    head = f"{cache_prefix}@" if cache_prefix else ""
    return f"{head}{model_key(model)}@"


def namespace_prefix(
    model_key: str, cache_prefix: str, shard: int, pcp_rank: int, dcp_rank: int, pp_rank: int, group: int
) -> str:
    """The key prefix of one namespace: everything before `@<hash_hex>`."""
    head = key_prefix(model_key, cache_prefix)
    return f"{head}tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"


def block_key(prefix: str, block_hash: bytes) -> str:
    """The key of the value stored under block_hash in the namespace `prefix`."""
    return f"{prefix}@{block_hash.hex()}"


def hash_suffixes(block_hashes: list[bytes] | tuple[bytes, ...]) -> list[str]:
    """`@<hex>` for every hash, computed once per request so keys are one concatenation each."""
    return ["@" + h.hex() for h in block_hashes]
