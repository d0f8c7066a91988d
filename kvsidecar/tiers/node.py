"""The daemon's side of the disk tier: the directory's lock, the engine, what recovery found, and the metrics."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvsidecar.metrics import Metrics
from kvsidecar.store.base import Store
from kvsidecar.tiers.directory import SsdDirLock
from kvsidecar.tiers.engine import DiskEngine
from kvsidecar.tiers.holdings import count_tier_hits, master_memory_holdings
from kvsidecar.tiers.results import DiskStats
from kvsidecar.tiers.tiered import DISK, MEMORY, TieredStore

__all__ = ["DEFAULT_BUFFER_BYTES", "DEFAULT_SIZE_BYTES", "DiskTierNode", "DiskTierSettings"]

log = logging.getLogger("kvsidecar")

MiB = 1 << 20
DEFAULT_SIZE_BYTES = 8 << 30  # laptop-sized; see docs/ssd-tier.md for a GPU node
DEFAULT_BUFFER_BYTES = 64 * MiB  # the write queue: about a second of a laptop's saves
_SAMPLE_EVERY_S = 5.0


@dataclass(frozen=True)
class DiskTierSettings:
    """What the disk tier is told (cut from Config): its directory and sizes, the master it sits beside, and the
    DRAM tier's size it reports beside its own."""

    directory: str
    size: int
    buffer_size: int
    master: str  # the external master's address, "" for the embedded one
    master_client_ttl: float
    memory_size: int


class DiskTierNode:
    """One daemon's disk tier under its directory (--ssd-dir), locked for as long as the daemon runs."""

    def __init__(
        self, config: DiskTierSettings, metrics: Metrics, master_metrics_url: Callable[[], str | None]
    ) -> None:
        """Lock the directory (SsdDirBusy names a live owner), recover its index and start the writer."""
        self.metrics = metrics
        self.directory = os.path.realpath(config.directory)
        self.lock = SsdDirLock.claim(self.directory, master=config.master)
        self._master_client_ttl = config.master_client_ttl
        try:
            self.engine = DiskEngine(self.directory, config.size, queue_bytes=config.buffer_size)
        except BaseException:
            self.lock.release()
            raise
        self._master_metrics_url = master_metrics_url
        self._seen = DiskStats()
        self._sampled = 0.0
        # No opener proxy: an http_proxy in the environment must not intercept a loopback scrape.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        r = self.engine.recovery
        self.note = (
            f"disk tier {self.directory}: recovered {r.blocks} block{'' if r.blocks == 1 else 's'} on disk "
            f"({r.bytes / MiB:.1f} MiB in {r.files} file{'' if r.files == 1 else 's'}, {r.seconds:.2f} s"
            + (f"; {r.cut_tails} torn index tail{'' if r.cut_tails == 1 else 's'} cut)" if r.cut_tails else ")")
        )
        (log.warning if r.cut_tails else log.info)(
            "%s; %s writes, files of %d MiB",
            self.note,
            "O_DIRECT" if self.engine.direct else "buffered",
            self.engine.file_size // MiB,
        )
        _warn_if_larger_than_filesystem(self.directory, config.size)
        metrics.disk_recovered_blocks.inc(r.blocks)
        metrics.disk_recovered_bytes.inc(r.bytes)
        metrics.tier_capacity_bytes.labels(DISK).set(config.size)
        metrics.tier_capacity_bytes.labels(MEMORY).set(config.memory_size)

    def wrap(self, dram: Store) -> TieredStore:
        """The store the daemon serves: dram with this disk tier behind it (closing it closes the engine)."""
        store = TieredStore(dram, self.engine, partial(count_tier_hits, self.metrics))
        store.note_health(self.note)
        # A killed earlier owner's segment may still be listed by the external master: reads routed there go to a
        # segment nobody serves. Until the master forgets it, lookups and loads ask the disk alone.
        until = self.lock.dead_segment_until(self._master_client_ttl)
        self.lock.record_dead_until(until)
        left = until - time.time()
        if left > 0:
            store.disk_only_for(left)
            log.warning(
                "disk tier: an earlier daemon on %s was killed and master %s may still list its segment: lookups and "
                "loads use the disk alone for %.1f s",
                self.directory,
                self.lock.master,
                left,
            )
        self.housekeep()
        return store

    def housekeep(self) -> None:
        """Once a second: mark the owner alive and bring the disk counters up to date; gauges every few seconds."""
        self.lock.touch()
        now = self.engine.snapshot()
        m, seen = self.metrics, self._seen
        m.disk_written_bytes.inc(now.written_bytes - seen.written_bytes)
        m.disk_corrupt_reads.inc(now.corrupt_reads - seen.corrupt_reads)
        m.disk_evicted_blocks.inc(now.evicted_blocks - seen.evicted_blocks)
        m.disk_evicted_bytes.inc(now.evicted_bytes - seen.evicted_bytes)
        m.disk_writing.set(0 if self.engine.not_writing() else 1)
        for reason, count in (now.skipped - seen.skipped).items():
            m.disk_skipped_writes.labels(reason).inc(count)
        m.disk_queued_bytes.set(now.queued_bytes)
        m.tier_blocks.labels(DISK).set(now.blocks)
        m.tier_bytes.labels(DISK).set(now.bytes)
        self._seen = now
        if time.monotonic() - self._sampled >= _SAMPLE_EVERY_S:
            self._sampled = time.monotonic()
            self._sample_memory()

    def release(self) -> None:
        """Close the engine (if the store did not) and unlock the directory."""
        try:
            self.engine.close()
        finally:
            self.lock.release()

    def _sample_memory(self) -> None:
        with contextlib.suppress(OSError):
            st = os.statvfs(self.directory)
            self.metrics.disk_filesystem_free_bytes.set(st.f_bavail * st.f_frsize)
        url = self._master_metrics_url()  # only an embedded master's numbers are this node's alone
        if url is None:
            return
        try:
            with self._opener.open(url + "/metrics", timeout=2.0) as response:
                held = master_memory_holdings(response.read().decode("utf-8", "replace"))
        except (OSError, ValueError) as exc:
            log.debug("could not read the embedded master's metrics: %s", exc)
            return
        if held is not None:
            self.metrics.tier_blocks.labels(MEMORY).set(held[0])
            self.metrics.tier_bytes.labels(MEMORY).set(held[1])


def _warn_if_larger_than_filesystem(directory: str, size: int) -> None:
    """A tier the filesystem cannot hold stops writing once the filesystem is full: said at start, not found then."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if size > total:
        log.warning(
            "disk tier %s: --ssd-size %.0f MiB is larger than its filesystem (%.0f MiB in all, %.0f MiB free): the "
            "tier stops writing when the filesystem is full",
            directory,
            size / MiB,
            total / MiB,
            free / MiB,
        )
