"""The daemon's disk tier: claims --ssd-dir, configures Mooncake's offload, reports recovery and refreshes gauges."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from kvsidecar.config import Config
from kvsidecar.errors import StoreError
from kvsidecar.metrics import Metrics
from kvsidecar.store import Presence, Store
from kvsidecar.tiers.directory import SsdDirLock, inventory, listed_keys, offload_environment, ttl_wait_seconds
from kvsidecar.tiers.holdings import TierSampler

__all__ = ["DiskTier"]

log = logging.getLogger("kvsidecar")

MiB = 1 << 20
_SAMPLE_EVERY_S = 5.0
# Recovered keys are checked against the master in one batch at start, up to this many.
_CHECK_KEYS = 200_000
# ...and this many of them read back, spread over the directory.
_READ_SAMPLES = 4


class DiskTier:
    """One daemon's disk tier under config.ssd_dir, locked for as long as the daemon runs."""

    def __init__(self, config: Config, metrics: Metrics, master_metrics_url: Callable[[], str | None]) -> None:
        """Lock the directory (raises DiskDirBusy naming the live owner) and note what it holds.

        master_metrics_url answers the embedded master's metrics address while it runs (None otherwise: an
        external master's numbers are not this node's alone)."""
        self.config = config
        self.metrics = metrics
        self.directory = os.path.realpath(config.ssd_dir)
        self.lock = SsdDirLock.claim(self.directory)
        self.found = inventory(self.directory)
        self.recovered = 0
        self._sampler = TierSampler(metrics, self.directory, config.ssd_size, config.segment_size, master_metrics_url)
        self._sampled = 0.0

    def environ(self) -> str:
        """Set Mooncake's offload environment for this process; return the directory for setup()."""
        cfg = self.config
        os.environ.update(offload_environment(self.directory, cfg.ssd_size, cfg.ssd_buffer_size, cfg.segment_size))
        return self.directory

    async def wait_for_master_to_forget(self) -> None:
        """External master: wait until it has expired the previous owner, else it keeps our blocks (upstream #3052)."""
        wait = ttl_wait_seconds(self.lock.last_alive, self.lock.stopped, self.config.master_client_ttl, time.time())
        if wait > 0 and self.found.buckets:
            log.info(
                "disk tier %s: the previous daemon %s %.1f s ago; waiting %.1f s for master %s to expire it "
                "(its client TTL is %.0f s, --master-client-ttl), else it would keep our %d blocks unreachable",
                self.directory,
                "stopped" if self.lock.stopped is not None else "was killed, last alive",
                time.time() - (self.lock.stopped or self.lock.last_alive or 0),
                wait,
                self.config.master,
                self.config.master_client_ttl,
                self.found.keys,
            )
            await asyncio.sleep(wait)

    def report_recovery(self, store: Store) -> None:
        """Log and publish how many of the blocks on disk the master serves again."""
        if self.found.keys:
            keys = listed_keys(self.directory, _CHECK_KEYS)
            presence = store.exists(keys)
            self.recovered = sum(p is Presence.PRESENT for p in presence)
            if len(keys) < self.found.keys:  # not all checked: scale the count
                self.recovered = self.recovered * self.found.keys // max(1, len(keys))
            present = [k for k, p in zip(keys, presence, strict=True) if p is Presence.PRESENT]
            if present and not self._readable(store, present[:: max(1, len(present) // _READ_SAMPLES)]):
                # Known to the master but not readable: it still maps them to the previous owner (upstream #3052).
                log.warning(
                    "disk tier %s: the master lists the blocks found on disk but cannot serve them (it still maps "
                    "them to the previous daemon, Mooncake #3052); they come back after a restart that waits out its "
                    "client TTL (--master-client-ttl %s s)",
                    self.directory,
                    self.config.master_client_ttl,
                )
                self.recovered = 0
        recovered_bytes = self.found.bytes * self.recovered // max(1, self.found.keys)
        self.metrics.disk_recovered_blocks.inc(self.recovered)
        self.metrics.disk_recovered_bytes.inc(recovered_bytes)
        note = (
            f"disk tier {self.directory}: recovered {self.recovered} of {self.found.keys} blocks on disk "
            f"({recovered_bytes / MiB:.1f} MiB in {self.found.buckets} buckets)"
        )
        store.note_health(note)
        (log.warning if self.recovered < self.found.keys else log.info)(note)
        self.housekeep()

    @staticmethod
    def _readable(store: Store, keys: list[str]) -> bool:
        try:
            return all(store.readable(k) for k in keys)
        except StoreError as exc:
            log.warning("could not read back a recovered block: %s", exc)
            return False

    def housekeep(self) -> None:
        """Once a second: mark the owner alive; every few seconds refresh the tier gauges."""
        self.lock.touch()
        now = time.monotonic()
        if now - self._sampled >= _SAMPLE_EVERY_S:
            self._sampled = now
            self._sampler.sample()

    def release(self) -> None:
        """Unlock the directory (after the store is closed)."""
        self.lock.release()
