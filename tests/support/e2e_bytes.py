"""The bytes an engine rank holds in each KV-cache block, from the engine's point of view (end-to-end tests).

Beside `oracle.py` and built on its `group_bytes`: what a rank holds depends on which heads, which sequence slice,
which layers and which state shard it owns, never on the placement rules, so end-to-end tests can check the daemon's
loads against it. A block's bytes are a pseudo-random pattern named by a tag: who holds it (`group_bytes`), which
group and tensor, and which prefix of the prompt the block's tokens (or the recurrent state) stand for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from kvsidecar_contract.placement import GroupSpec, Layout
from support.oracle import group_bytes

POISON = 0xA5  # what a cleared (freshly allocated) block holds before a load


def pattern(tag: str, nbytes: int) -> bytes:
    """The bytes of a block named by tag: pseudo-random, so a block from any other tag or offset differs."""
    return hashlib.shake_256(tag.encode()).digest(nbytes)


def digest(data: bytes) -> str:
    """The short fingerprint the rank processes report per block."""
    return hashlib.sha256(data).hexdigest()[:24]


def chained_hashes(salt: str, count: int) -> list[bytes]:
    """Block hashes of a prompt: hash i names the whole prefix [0, (i + 1) * U), as an engine chains them."""
    out, prev = [], b""
    for i in range(count):
        prev = hashlib.sha256(prev + f"{salt}:{i}".encode()).digest()
        out.append(prev)
    return out


class Prompt(NamedTuple):
    """A prompt as the engine sees it: its length and its chained block hashes (one per U tokens).

    Prompts with the same salt share their token prefix: hash i is the same for every length that reaches it.
    """

    salt: str
    num_tokens: int
    hash_block_size: int

    @property
    def hashes(self) -> list[bytes]:
        """One chained hash per complete U tokens."""
        return chained_hashes(self.salt, self.num_tokens // self.hash_block_size)

    @property
    def complete(self) -> int:
        """Tokens in complete U units: the longest prefix a block hash names."""
        return self.num_tokens - self.num_tokens % self.hash_block_size


def tokens_per_block(group: GroupSpec, dcp_size: int) -> int:
    """Sequence tokens one physical block stands for on a rank.

    An attention block holds block_size of this rank's tokens, and under DCP a rank holds every D-th token, so the
    block reaches over block_size * D positions. A recurrent block slot holds one state, at block_size granularity.
    """
    return group.block_size if group.recurrent else group.block_size * dcp_size


def blocks_of(group: GroupSpec, dcp_size: int, num_tokens: int) -> int:
    """Physical blocks the engine allocates to hold num_tokens tokens of this group."""
    s = tokens_per_block(group, dcp_size)
    return -(-num_tokens // s)


class RankId(NamedTuple):
    """Which engine rank: TP, PCP and PP rank."""

    tp: int
    pcp: int = 0
    pp: int = 0


def holder(layout: Layout, group: int, rank: RankId) -> str:
    """A stable name for what this rank holds in this group; equal names mean byte-identical content."""
    return repr(group_bytes(layout, layout.groups[group], rank.tp, rank.pcp, rank.pp))


def _tag(layout: Layout, group: int, tensor: int, rank: RankId, what: str, prompt: Prompt, end: int) -> str:
    # `end` names the prefix: the block's tokens (or the state) depend on every token before it.
    prefix = prompt.hashes[end // prompt.hash_block_size - 1].hex()
    return f"{layout.model_key}|g{group}|t{tensor}|{holder(layout, group, rank)}|{what}|{end}|{prefix}"


def cold_block_tags(layout: Layout, group: int, tensor: int, rank: RankId, prompt: Prompt) -> dict[int, str]:
    """After prefilling `prompt`: block index -> tag of what that block holds (only blocks with a complete unit).

    Attention block k holds tokens [k*S, min((k+1)*S, end)) where end is the last complete U unit; a recurrent block
    k holds the state after min((k+1)*S, end) tokens.
    """
    spec = layout.groups[group]
    s = tokens_per_block(spec, layout.parallel.dcp_size)
    end = prompt.complete
    out = {}
    for k in range(-(-end // s)):
        valid = min((k + 1) * s, end)
        out[k] = _tag(layout, group, tensor, rank, "state" if spec.recurrent else "kv", prompt, valid)
    return out


def warm_block_tags(
    layout: Layout, group: int, tensor: int, rank: RankId, cold: Prompt, hit_tokens: int, start_tokens: int = 0
) -> dict[int, str]:
    """After loading a hit of hit_tokens of a prompt prefilled as `cold`: block index -> tag it must hold.

    Attention: every block overlapping the tokens the engine attends to at the hit end ([hit - W + 1, hit) for a
    sliding window, as vLLM counts it, else [0, hit)), as the cold prefill left it. Recurrent: the state after
    exactly hit_tokens tokens, in the block whose slot covers the hit end. Blocks ending at or before
    start_tokens, which the engine already holds, and every other block stay as they were.
    """
    if hit_tokens <= start_tokens:
        return {}
    spec = layout.groups[group]
    s = tokens_per_block(spec, layout.parallel.dcp_size)
    last = (hit_tokens - 1) // s
    if spec.recurrent:
        return {last: _tag(layout, group, tensor, rank, "state", cold, hit_tokens)}
    window = spec.attention_window
    first = 0 if window is None else max(0, hit_tokens - window + 1) // s
    first = max(first, start_tokens // s)
    cold_tags = cold_block_tags(layout, group, tensor, rank, cold)
    return {k: cold_tags[k] for k in range(first, last + 1)}


def expected_digests(
    tags_by_block: dict[int, str], block_ids: Sequence[int], num_blocks: int, block_bytes: int
) -> list[str]:
    """Digest of every block of one tensor: the tagged pattern where block_ids[k] is tagged k, else poison."""
    out = [digest(bytes([POISON]) * block_bytes)] * num_blocks
    for k, tag in tags_by_block.items():
        out[block_ids[k]] = digest(pattern(tag, block_bytes))
    return out
