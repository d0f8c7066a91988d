"""Prometheus metrics of the daemon, on a registry passed in (tests use their own).

Imports: ; prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

DEFAULT_METRICS_ADDRESS = "127.0.0.1:9469"  # where the daemon serves /metrics: loopback
# Store calls are batch calls over loopback or RDMA: from ~0.1 ms (existence) to seconds (a big put under load).
STORE_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ListenerDrops:
    """Packets each fenced listener refused, read from the kernel at scrape time (SO_MEMINFO drops)."""

    NAME = "kvsidecar_listener_dropped_packets"
    HELP = "Packets the kernel dropped at a fenced listener: connection attempts from outside its allow-list."

    def __init__(self, source: Callable[[], dict[tuple[str, str], int]], registry: CollectorRegistry) -> None:
        """source answers the packets each (role, address) refused so far (the daemon's fence)."""
        self._source = source
        registry.register(self)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.NAME, self.HELP, labels=["role", "address"])

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for (role, address), count in sorted(self._source().items()):
            family.add_metric([role, address], count)
        yield family


class Metrics:
    """Every counter, gauge and histogram the daemon exports; names are part of the operator contract."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        listener_drops: Callable[[], dict[tuple[str, str], int]] = dict,
    ) -> None:
        """registry: where the metrics go (a fresh one by default); listener_drops: the packets each fenced listener
        refused (the daemon's fence; none by default)."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lookup_requests = Counter("kvsidecar_lookup_requests", "Prefix lookups answered.", ["outcome"], registry=r)
        self.lookup_tokens = Counter("kvsidecar_lookup_tokens", "Prompt tokens asked about in lookups.", registry=r)
        self.lookup_hit_tokens = Counter(
            "kvsidecar_lookup_hit_tokens", "Tokens reported as hits by lookups.", registry=r
        )
        self.saved_blocks = Counter(
            "kvsidecar_saved_blocks", "Blocks written to the store.", ["group_kind"], registry=r
        )
        self.save_skipped_blocks = Counter(
            "kvsidecar_save_skipped_blocks",
            "Blocks not written because the store already held them.",
            ["group_kind"],
            registry=r,
        )
        self.save_failed_blocks = Counter(
            "kvsidecar_save_failed_blocks", "Blocks whose write failed.", ["group_kind", "reason"], registry=r
        )
        self.loaded_blocks = Counter(
            "kvsidecar_loaded_blocks", "Blocks read from the store into engine memory.", ["group_kind"], registry=r
        )
        self.load_failed_blocks = Counter(
            "kvsidecar_load_failed_blocks",
            "Blocks whose read failed (the engine recomputes them).",
            ["group_kind", "reason"],
            registry=r,
        )
        self.checksums = Counter(
            "kvsidecar_value_checksums",
            "Values given a checksum at save (summed), values whose checksum a load checked (verified), and of those "
            "the ones whose bytes did not match (mismatch: never served, removed from the store, recomputed).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("summed", "verified", "mismatch"):
            self.checksums.labels(outcome)
        self.saved_bytes = Counter("kvsidecar_saved_bytes", "Bytes written to the store.", registry=r)
        self.loaded_bytes = Counter("kvsidecar_loaded_bytes", "Bytes read from the store.", registry=r)
        self.store_operation_seconds = Histogram(
            "kvsidecar_store_operation_seconds",
            "Duration of one batch call to the store.",
            ["operation"],
            buckets=STORE_LATENCY_BUCKETS,
            registry=r,
        )
        self.store_errors = Counter(
            "kvsidecar_store_errors",
            "Store calls that failed as a whole (not per key).",
            ["operation", "reason"],
            registry=r,
        )
        self.store_retries = Counter(
            "kvsidecar_store_retries",
            "Values a store call is made for again after a transient failure, by operation and the failure's reason.",
            ["operation", "reason"],
            registry=r,
        )
        self.sessions = Gauge("kvsidecar_sessions", "Open engine sessions.", ["role"], registry=r)
        self.regions_bytes = Gauge(
            "kvsidecar_registered_region_bytes", "Bytes of engine memory mapped by the daemon.", registry=r
        )
        self.gpu_pinned_bytes = Gauge(
            "kvsidecar_gpu_pinned_segment_bytes",
            "Bytes of the store's segment page-locked for the GPU path (0 on a CPU node or until it is done).",
            registry=r,
        )
        self.gpu_staging_bytes = Gauge(
            "kvsidecar_gpu_staging_bytes", "GPU memory the daemon holds as staging for device transfers.", registry=r
        )
        self.gpu_failed = Gauge(
            "kvsidecar_gpu_failed",
            "1 once the GPU path hit a sticky CUDA error (GPU requests refused until a restart), else 0.",
            registry=r,
        )
        self.store_healthy = Gauge(
            "kvsidecar_store_healthy", "1 when the Mooncake store and its master answer, else 0.", registry=r
        )
        self.requests = Counter(
            "kvsidecar_requests",
            "Requests received, by method (a SaveBatch or LoadBatch counts once, its items in batch_items).",
            ["method"],
            registry=r,
        )
        self.batch_items = Counter(
            "kvsidecar_batch_items",
            "Items received in SaveBatch and LoadBatch requests, by method.",
            ["method"],
            registry=r,
        )
        self.data_socket_requests = Counter(
            "kvsidecar_data_socket_requests",
            "Of the requests, those received on the data socket (the rest came over gRPC), by method.",
            ["method"],
            registry=r,
        )
        self.data_socket_connections = Gauge(
            "kvsidecar_data_socket_connections",
            "Data-socket connections open now (one daemon thread each).",
            registry=r,
        )
        self.requests_rejected = Counter(
            "kvsidecar_requests_rejected",
            "Requests refused with an error status, by method and gRPC code.",
            ["method", "code"],
            registry=r,
        )
        # Tiers (memory and, with --ssd-dir, disk); without a disk tier they stay at zero.
        self.tier_hits = Counter(
            "kvsidecar_tier_hits", "Blocks loaded, by the tier that held them (memory, disk).", ["tier"], registry=r
        )
        self.tier_hit_bytes = Counter(
            "kvsidecar_tier_hit_bytes", "Bytes loaded, by the tier that held them.", ["tier"], registry=r
        )
        self.tier_blocks = Gauge("kvsidecar_tier_blocks", "Blocks each tier of this node holds.", ["tier"], registry=r)
        self.tier_bytes = Gauge("kvsidecar_tier_bytes", "Bytes each tier of this node holds.", ["tier"], registry=r)
        self.tier_capacity_bytes = Gauge(
            "kvsidecar_tier_capacity_bytes", "Bytes each tier of this node may hold.", ["tier"], registry=r
        )
        self.disk_filesystem_free_bytes = Gauge(
            "kvsidecar_disk_tier_filesystem_free_bytes",
            "Free bytes of the filesystem holding --ssd-dir.",
            registry=r,
        )
        self.disk_recovered_blocks = Counter(
            "kvsidecar_disk_tier_recovered_blocks", "Disk-tier blocks found again at start.", registry=r
        )
        self.disk_recovered_bytes = Counter(
            "kvsidecar_disk_tier_recovered_bytes", "Disk-tier bytes found again at start.", registry=r
        )
        self.disk_written_bytes = Counter(
            "kvsidecar_disk_tier_written_bytes", "Value bytes written to the disk tier (durable).", registry=r
        )
        self.disk_skipped_writes = Counter(
            "kvsidecar_disk_tier_skipped_writes",
            "Values not written to the disk tier, by reason (queue_full, no_space, io_error, too_large, device_source: "
            "a GPU rank's value whose DRAM replica is on another node); DRAM still holds them.",
            ["reason"],
            registry=r,
        )
        self.disk_corrupt_reads = Counter(
            "kvsidecar_disk_tier_corrupt_reads",
            "Disk-tier values whose checksum failed on read (a miss, never served).",
            registry=r,
        )
        self.disk_queued_bytes = Gauge(
            "kvsidecar_disk_tier_queued_bytes", "Value bytes waiting to be written to the disk tier.", registry=r
        )
        self.disk_evicted_blocks = Counter(
            "kvsidecar_disk_tier_evicted_blocks",
            "Disk-tier blocks dropped with their file to make room (every drop is also logged).",
            registry=r,
        )
        self.disk_evicted_bytes = Counter(
            "kvsidecar_disk_tier_evicted_bytes", "Value bytes of the disk-tier blocks dropped to make room.", registry=r
        )
        self.disk_writing = Gauge(
            "kvsidecar_disk_tier_writing",
            "1 while the disk tier writes, 0 while its filesystem refuses writes (full, failing); 1 without one.",
            registry=r,
        )
        self.disk_writing.set(1)
        for reason in ("queue_full", "no_space", "io_error", "too_large", "device_source"):
            self.disk_skipped_writes.labels(reason)
        # Both tiers exported from the start (zero without a disk tier), so dashboards and alerts always find them.
        for tier in ("memory", "disk"):
            for family in (self.tier_hits, self.tier_hit_bytes, self.tier_blocks, self.tier_bytes):
                family.labels(tier)
            self.tier_capacity_bytes.labels(tier)
        self.listener_info = Gauge(
            "kvsidecar_listener_info",
            "Every listener of the daemon process (1), with its address and who may connect to it.",
            ["role", "address", "allowed"],
            registry=r,
        )
        self.listener_drops = ListenerDrops(listener_drops, r)

        # Per tenant; the label takes only names from the tenants file (and "none"), so it stays bounded.
        self.tenant_lookup_tokens = Counter(
            "kvsidecar_tenant_lookup_tokens", "Prompt tokens looked up, per tenant.", ["tenant"], registry=r
        )
        self.tenant_lookup_hit_tokens = Counter(
            "kvsidecar_tenant_lookup_hit_tokens", "Tokens lookups hit, per tenant.", ["tenant"], registry=r
        )
        self.tenant_loaded_blocks = Counter(
            "kvsidecar_tenant_loaded_blocks", "Values read into engine memory, per tenant.", ["tenant"], registry=r
        )
        self.tenant_loaded_bytes = Counter(
            "kvsidecar_tenant_loaded_bytes", "Bytes read from the store, per tenant.", ["tenant"], registry=r
        )
        self.tenant_saved_blocks = Counter(
            "kvsidecar_tenant_saved_blocks", "Values written to the store, per tenant.", ["tenant"], registry=r
        )
        self.tenant_saved_bytes = Counter(
            "kvsidecar_tenant_saved_bytes", "Bytes written to the store, per tenant.", ["tenant"], registry=r
        )
        self.tenant_refused = Counter(
            "kvsidecar_tenant_refused",
            "Requests or values refused to a tenant: reason permission (a prefix or right it lacks) or tenant_budget "
            "(values of saves past its write budget).",
            ["tenant", "reason"],
            registry=r,
        )

        # Retention (docs/retention.md): the tenant label is "" on a daemon without a tenants file.
        self.tenant_retained_bytes = Gauge(
            "kvsidecar_tenant_retained_bytes",
            "Bytes a tenant's requests keep ahead of ordinary cache now: pin soft (counted against its retention "
            "budget) or hard (an operator's).",
            ["tenant", "pin"],
            registry=r,
        )
        self.retention_values = Counter(
            "kvsidecar_retention_values",
            "Values of saves and hits that asked for retention, by outcome: pin (newly retained), renew, kept "
            "(retained already), over (the tenant's budget is spent: ordinary cache), failed (the store could not "
            "pin a stored value), queue_full (too many pins waiting).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("pin", "renew", "kept", "over", "failed", "queue_full"):
            self.retention_values.labels(outcome)

    def tenant_totals(self, tenants: set[str]) -> dict[str, float]:
        """The per-tenant counters summed over the given tenants, by sample name (Stats for a non-admin tenant)."""
        out: dict[str, float] = {}
        for metric in self.registry.collect():
            if not metric.name.startswith("kvsidecar_tenant_"):
                continue
            for s in metric.samples:
                if s.name.endswith("_total") and s.labels.get("tenant") in tenants:
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def totals(self) -> dict[str, float]:
        """Every unlabelled counter's total, by sample name (for Stats); the disk tier's only where it has a size."""
        samples = [s for metric in self.registry.collect() for s in metric.samples]
        disk = any(
            s.name == "kvsidecar_tier_capacity_bytes" and s.labels == {"tier": "disk"} and s.value for s in samples
        )
        return {
            s.name: s.value
            for s in samples
            if s.name.endswith("_total") and not s.labels and (disk or not s.name.startswith("kvsidecar_disk_tier_"))
        }
