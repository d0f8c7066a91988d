"""Store key strings (rule 3): one namespace per value meaning, structurally disjoint from vLLM's in-tree keys.

    kvs1@<cache_prefix>@<model>~<value_id>@s<shard>.c<pcp>.d<dcp>.p<pp>.g<group>@<hash_hex>

`<value_id>` (docs/values.md) is a digest of everything that decides what a value's bytes mean: the client's value
identity (model config, weights sample or revision, dtypes, physical layout, region order), the session's groups,
KV heads, hash block size and parallel sizes, and VALUE_FORMAT. Two engines share a key only when all of it agrees.

Why keys can never equal a key of vLLM's in-tree Mooncake store connector: every in-tree key ends with
`@group:<int>@<hex>` (vLLM 0.33 `PoolKey.build_prefix` always writes `@group:`, then `@<chunk hash hex>`), whatever
its cache prefix, model name or store namespace hold. Hex holds no '@', so in any key the field before the last '@'
is well defined; ours is `s<int>.c<int>.d<int>.p<int>.g<int>`, which holds no ':', and theirs always does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from kvsidecar_contract.placement.packed import PackedHashes

__all__ = [
    "DEFAULT_CHECKSUM_EVERY",
    "FORMAT_TAG",
    "KEY_FORMAT",
    "KEY_TAIL_PATTERN",
    "VALUE_FORMAT",
    "VALUE_ID_CHARS",
    "block_key",
    "hash_suffixes",
    "key_prefix",
    "model_key",
    "namespace_prefix",
    "value_id",
]

# The value format: how the daemon builds a block's value from the registered regions (one group's regions, in
# registration order, each its block's bytes) and what follows them. Bump it whenever that changes: every value id
# changes with it, so old values then never match. 2: a value whose key is chosen for a checksum (one in the
# layout's checksum_every) ends with a 16-byte trailer holding it (kvsidecar/movers/trailer.py).
VALUE_FORMAT = 2
# Which keys' values carry a checksum trailer by default: one in 32 (the daemon's --checksums sampled).
DEFAULT_CHECKSUM_EVERY = 32
# The key format's tag: how a key is laid out (below), apart from what its values hold; a reset of a model sweeps
# its keys of every value format.
KEY_FORMAT = 1
FORMAT_TAG = f"kvs{KEY_FORMAT}"
VALUE_ID_CHARS = 24  # hex digits of the value id (96 bits)

# Everything after key_prefix(model, cache_prefix) in a key, as a regular expression (the same in Python and in
# Mooncake's ECMAScript flavour): what a reset of one model must match exactly, so a model whose name continues
# this one's ("a~b" after "a") can never be swept along with it. Every value id of the model matches.
KEY_TAIL_PATTERN = rf"[0-9a-f]{{{VALUE_ID_CHARS}}}@s[0-9]+\.c[0-9]+\.d[0-9]+\.p[0-9]+\.g[0-9]+@[0-9a-f]+"


def value_id(identity: str, session: Mapping[str, object], checksum_every: int) -> str:
    """A namespace's value id: a digest of the client's identity, what the daemon knows of the session, the format
    and which of its values end with a checksum trailer (checksum_every: one key in N; 1 all; 0 none)."""
    text = json.dumps(
        {"format": VALUE_FORMAT, "checksums": checksum_every, "identity": identity, "session": session},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:VALUE_ID_CHARS]


def model_key(model: str) -> str:
    """The model's name in keys: the last path component of its name (a model key is its own model key)."""
    return model.rstrip("/").split("/")[-1]


def key_prefix(model: str, cache_prefix: str) -> str:
    """`kvs1@<cache_prefix>@<model key>~`: the start of every key of one model, any value id, under one prefix."""
    return f"{FORMAT_TAG}@{cache_prefix}@{model_key(model)}~"


def namespace_prefix(
    model_key: str, cache_prefix: str, shard: int, pcp_rank: int, dcp_rank: int, pp_rank: int, group: int
) -> str:
    """The key prefix of one namespace: everything before `@<hash_hex>`.

    `model_key` is a Layout's: `<model key>~<value id>` (the id is hex, so the last '~' splits them).
    """
    name, sep, vid = model_key.rpartition("~")
    if not sep or not vid:
        raise ValueError(f"a namespace needs a model key with its value id (`name~id`), got {model_key!r}")
    return f"{key_prefix(name, cache_prefix)}{vid}@s{shard}.c{pcp_rank}.d{dcp_rank}.p{pp_rank}.g{group}"


def block_key(prefix: str, block_hash: bytes) -> str:
    """The key of the value stored under block_hash in the namespace `prefix`."""
    return f"{prefix}@{block_hash.hex()}"


def hash_suffixes(block_hashes: Sequence[bytes]) -> list[str]:
    """`@<hex>` for every hash, computed once per request so keys are one concatenation each."""
    if isinstance(block_hashes, PackedHashes):
        return block_hashes.suffixes()
    return ["@" + h.hex() for h in block_hashes]
