"""The connector's stats in vLLM's connector-stats interface: lookups, loads and saves, for vLLM's logs and /metrics.

Each side (scheduler: lookups; workers: loads and saves) counts into a `StatsRecorder`; vLLM takes the counts of
each step with `get_kv_connector_stats`, sums the workers' and the scheduler's (`aggregate`), logs them each
interval (`reduce`) and, through `build_prom_metrics`, adds them to its Prometheus counters
`vllm:kvsidecar_<name>_total`, labelled as vLLM labels its engines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["COUNTERS", "KVSidecarPromMetrics", "KVSidecarStats", "StatsRecorder"]

# (name, what it counts); every one is a sum over the interval.
COUNTERS: tuple[tuple[str, str], ...] = (
    ("lookups", "Prefix lookups the connector asked the kvsidecar store."),
    ("lookup_failures", "Lookups the daemon could not answer (treated as misses)."),
    ("lookup_tokens", "Prompt tokens asked about in lookups."),
    ("hit_tokens", "Tokens the store could serve, by the lookups' answers."),
    ("lookup_seconds", "Seconds spent waiting for lookups."),
    ("loads", "Loads of a request's hit from the store."),
    ("loaded_blocks", "Values read from the store into the KV cache."),
    ("loaded_bytes", "Bytes read from the store into the KV cache."),
    ("load_failed_blocks", "Blocks whose load failed (recomputed), including those of failed loads."),
    ("load_seconds", "Seconds from a step's LoadBatch call to its answer."),
    ("saves", "Saves of a request's computed blocks to the store."),
    ("saved_blocks", "Values written to the store."),
    ("saved_bytes", "Bytes written to the store."),
    ("save_skipped_blocks", "Values a save found already stored."),
    ("save_failed_blocks", "Values whose write failed (a later save may store them)."),
    ("save_failures", "Saves that failed as a whole."),
    ("save_seconds", "Seconds from a save's call to its answer."),
)
_NAMES = tuple(name for name, _ in COUNTERS)


@dataclass
class KVSidecarStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's counts (vLLM sends `data` from the workers to the scheduler and the logger)."""

    def __post_init__(self) -> None:
        for name in _NAMES:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_NAMES, 0)

    def aggregate(self, other: KVConnectorStats) -> KVSidecarStats:
        for name in _NAMES:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval for vLLM's log line: counts, the hit rate and the mean times."""
        d = self.data
        out: dict[str, int | float] = {name: d[name] for name in _NAMES if not name.endswith("_seconds") and d[name]}
        if d["lookup_tokens"]:
            out["hit_rate"] = round(d["hit_tokens"] / d["lookup_tokens"], 4)
        for op in ("lookup", "load", "save"):
            count = d[f"{op}s"]
            if count:
                out[f"{op}_ms_mean"] = round(1000 * d[f"{op}_seconds"] / count, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in _NAMES)


class StatsRecorder:
    """Counts from any thread; `take` hands over what was counted since the last take."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(_NAMES, 0)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] += value  # KeyError for a name not in COUNTERS: a bug

    def take(self) -> KVSidecarStats | None:
        """The counts since the last take, or None when nothing happened."""
        with self._lock:
            counts: dict[str, float] = self._counts
            self._counts = dict.fromkeys(_NAMES, 0)
        stats = KVSidecarStats(data=counts)
        return None if stats.is_empty() else stats


class KVSidecarPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """vLLM's Prometheus counters of the connector, one per entry of COUNTERS, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvsidecar_{name}", documentation=text, labelnames=self._labelnames)
            for name, text in COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.labels(*labels).inc(value)
