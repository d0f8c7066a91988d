"""What each tier of this node holds and serves: the segment in DRAM and the disk tier under --ssd-dir."""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.request
from collections.abc import Callable, Sequence

from kvsidecar.metrics import Metrics
from kvsidecar.tiers.directory import inventory

__all__ = ["TierSampler", "count_tier_hits", "master_memory_holdings"]

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


class TierSampler:
    """Refreshes the tier gauges: disk from the directory, memory from the embedded master (which only we use)."""

    def __init__(
        self,
        metrics: Metrics,
        directory: str,
        capacity: int,
        segment_size: int,
        master_metrics_url: Callable[[], str | None],
    ) -> None:
        self._metrics = metrics
        self._directory = directory
        self._master_metrics_url = master_metrics_url
        metrics.tier_capacity_bytes.labels(DISK).set(capacity)
        metrics.tier_capacity_bytes.labels(MEMORY).set(segment_size)
        # No opener proxy: an http_proxy in the environment must not intercept a loopback scrape.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def sample(self) -> None:
        """One refresh; a failure leaves the last values."""
        disk = inventory(self._directory)
        self._metrics.tier_blocks.labels(DISK).set(disk.keys)
        self._metrics.tier_bytes.labels(DISK).set(disk.bytes)
        try:
            st = os.statvfs(self._directory)
            self._metrics.disk_filesystem_free_bytes.set(st.f_bavail * st.f_frsize)
        except OSError:
            pass
        url = self._master_metrics_url()
        if url is None:
            return
        try:
            with self._opener.open(url + "/metrics", timeout=2.0) as response:
                held = master_memory_holdings(response.read().decode("utf-8", "replace"))
        except (OSError, ValueError) as exc:
            log.debug("could not read the embedded master's metrics: %s", exc)
            return
        if held is not None:
            self._metrics.tier_blocks.labels(MEMORY).set(held[0])
            self._metrics.tier_bytes.labels(MEMORY).set(held[1])
