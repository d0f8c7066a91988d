"""What each tier of this node serves: the segment in DRAM and the disk tier under --ssd-dir."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from kvsidecar.metrics import Metrics

__all__ = ["count_tier_hits", "master_memory_holdings"]

log = logging.getLogger(__name__)

MEMORY, DISK = "memory", "disk"


def count_tier_hits(metrics: Metrics, tiers: Sequence[str], sizes: Sequence[int]) -> None:
    """Add loaded blocks (their tier and bytes) to kvsidecar_tier_hits and kvsidecar_tier_hit_bytes."""
    blocks = {MEMORY: 0, DISK: 0}
    nbytes = {MEMORY: 0, DISK: 0}
    for tier, size in zip(tiers, sizes, strict=True):
        # A block that moved between the location query and the read is counted where it was.
        tier = tier or MEMORY
        blocks[tier] += 1
        nbytes[tier] += size
    for tier, count in blocks.items():
        if count:
            metrics.tier_hits.labels(tier).inc(count)
            metrics.tier_hit_bytes.labels(tier).inc(nbytes[tier])


def master_memory_holdings(metrics_text: str) -> tuple[int, int] | None:
    """(objects in memory, bytes allocated in memory) from a mooncake_master's /metrics text, if it says."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("mem_cache_nums_", "master_allocated_bytes"):
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    if len(values) < 2:
        return None
    return int(values["mem_cache_nums_"]), int(values["master_allocated_bytes"])
