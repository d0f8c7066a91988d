"""SGLang's page calls as the session's saves, loads and lookups, one group at a time.

SGLang moves each pool in calls of its own (KV pages by `batch_*_v1`, a side pool's pages by `batch_*_v2`), so each
call here is one group's: its pages are the blocks 0..n-1 of a request of n pages whose block hashes are the call's
keys (SGLang's page hashes; a call may start anywhere in a chain, and a key names its boundary wherever it sits),
and every other group's blocks are NO_BLOCK: a save skips them (counted as absent), and a load says it carries the
one group (`groups`), so the daemon neither reads nor reports the others (a daemon older than that reads nothing
for them and reports them failed, `kvsidecar_load_failed_blocks_total{reason="no_block"}`). A load is the hit a
lookup of those pages would answer, so the daemon reads what its rules say that group needs for a prefix ending at
the last page (every page for KV, the window's last pages, a Mamba state at exactly the end): the pages it reads
and does not report failed are the ones loaded. A lookup is always every group's (rule 9): the prefix every pool
can serve.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsidecar_client.client import SidecarClient
from kvsidecar_client.errors import SidecarError
from kvsidecar_client.results import Hit
from kvsidecar_client.sglang.blocks import PageMemory
from kvsidecar_contract.limits import NO_BLOCK
from kvsidecar_contract.placement.spans import Spans

if TYPE_CHECKING:
    import torch

__all__ = ["HASH_BYTES", "PageCalls", "block_hash"]

logger = logging.getLogger(__name__)

HASH_BYTES = 32  # SGLang's page hashes are SHA-256 hex strings


def block_hash(key: str) -> bytes:
    """The daemon's block hash of one SGLang page key: its SHA-256 bytes (any other string is hashed to 32 bytes)."""
    if len(key) == 2 * HASH_BYTES:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


class PageCalls:
    """One rank's session seen as SGLang sees its pools: pages of group g stored, loaded and looked up by key."""

    def __init__(self, client: SidecarClient, memory: PageMemory, page_tokens: int) -> None:
        self._client = client
        self._memory = memory
        self._page = page_tokens
        self._spans = Spans.of(client.spec.to_placement())
        self._groups = len(self._spans.groups)

    def save(self, group: int, keys: Sequence[str], pages: torch.Tensor, parent: str | None = None) -> list[bool]:
        """Store each key's page of the group; True where it is stored (written now, already there, or another
        rank's to write). parent: the key before keys[0] in its chain, where SGLang says it."""
        out = [False] * len(keys)
        for start, stop in self._chunks(group, len(keys)):
            before = keys[start - 1] if start else parent
            # The page before, as a block already saved: the daemon's BlockStored events then name it as the
            # first page's parent (docs/kv-events.md), not the start of a prompt.
            lead = [block_hash(before)] if before is not None else []
            hashes = lead + [block_hash(k) for k in keys[start:stop]]
            with self._memory.saving(group, pages[start:stop]) as ids:
                try:
                    block_ids = self._ids(group, [NO_BLOCK] * len(lead) + ids)
                    tokens = len(hashes) * self._page
                    job = self._client.save(hashes, block_ids, tokens, saved_tokens=len(lead) * self._page)
                    result = job.result()
                except SidecarError as error:
                    logger.warning("kvsidecar: saving %d pages of group %d failed: %s", len(ids), group, error)
                    continue
            failed = {f.block_id for f in result.failures if f.group == group}
            out[start:stop] = [block not in failed for block in ids]
        return out

    def load(self, group: int, keys: Sequence[str], pages: torch.Tensor) -> list[bool]:
        """Load each key's page of the group into its pool; True where it loaded (SGLang keeps the leading Trues)."""
        out = [False] * len(keys)
        for start, stop in self._chunks(group, len(keys)):
            hashes = [block_hash(k) for k in keys[start:stop]]
            tokens = (stop - start) * self._page
            with self._memory.loading(group, pages[start:stop]) as (ids, loaded):
                try:
                    # Whole pages, each under its own end boundary: the hit a lookup of these pages would answer.
                    hit = Hit(tokens, (tokens,) * self._groups)
                    result = self._client.load_detailed(hashes, self._ids(group, ids), hit, groups=(group,))
                except SidecarError as error:
                    logger.warning("kvsidecar: loading %d pages of group %d failed: %s", len(ids), group, error)
                    continue
                failed = {f.block_id for f in result.failures if f.group == group}
                done = [i for i in self._spans.load(tokens)[group] if ids[i] not in failed]
                loaded(done)
            for i in done:
                out[start + i] = True
        return out

    def lookup(self, keys: Sequence[str]) -> int:
        """Pages of the longest prefix of keys every group can serve, from the daemon's staged lookup."""
        if not keys:
            return 0
        # One token past the pages: the daemon never serves a prompt's last token, and here every page is whole.
        hit = self._client.lookup([block_hash(k) for k in keys], len(keys) * self._page + 1)
        if hit.degraded:
            logger.warning("kvsidecar: lookup degraded to a miss: %s", hit.detail)
        return hit.hit_tokens // self._page

    def _ids(self, group: int, ids: list[int]) -> list[list[int]]:
        """Block ids of every group for a call of the group's pages: the others hold nothing of it."""
        return [ids if g == group else [NO_BLOCK] * len(ids) for g in range(self._groups)]

    def _chunks(self, group: int, count: int) -> list[tuple[int, int]]:
        step = self._memory.capacity(group) or max(count, 1)
        return [(start, min(start + step, count)) for start in range(0, count, step)]
