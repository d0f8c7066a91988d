"""The report: results as one JSON document, with the headline ratios against the issue's targets."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsidecar_bench.lookup import LookupPoint
from kvsidecar_bench.scaling import ScalePoint
from kvsidecar_bench.settings import Settings
from kvsidecar_bench.stats import Samples, ratio
from kvsidecar_bench.throughput import ShapeResult
from kvsidecar_bench.volume import VolumeResult

__all__ = ["OP_TITLES", "PATH_TITLES", "Results", "headline", "rate", "to_json"]

SCHEMA = 1
PATH_TITLES = {
    "daemon": "daemon (client -> gRPC -> daemon -> Mooncake)",
    "in-process": "in-process Mooncake (vLLM in-tree style)",
    "real-client": "Mooncake real client (dummy client -> mooncake_client)",
    "memcpy": "memcpy of the same bytes (one core, one contiguous copy per tensor)",
}
OP_TITLES = {"save": "save, warm segment", "save_cold": "save, cold segment", "load": "load"}
LOOKUP_TARGET_TOKENS = 32768


@dataclass
class Results:
    """Everything a run measured, before it becomes JSON."""

    settings: Settings
    command: str
    machine: dict[str, Any]
    started: str
    paths: list[str]
    daemon_command: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    load_average_at_end: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    throughput: list[ShapeResult] = field(default_factory=list)
    lookup: list[LookupPoint] = field(default_factory=list)
    scaling: list[ScalePoint] = field(default_factory=list)
    volume: list[VolumeResult] = field(default_factory=list)
    daemon_idle: dict[str, float] = field(default_factory=dict)


def _num(value: float, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def _latency(samples: Samples) -> dict[str, Any]:
    return {
        "p50_ms": _num(samples.median_s * 1e3),
        "p99_ms": _num(samples.p(99) * 1e3),
        "seconds": [round(s, 7) for s in samples.seconds],
    }


def to_json(results: Results) -> dict[str, Any]:
    """The whole run as plain JSON values (raw samples included)."""
    doc: dict[str, Any] = {
        "kvsidecar_bench": SCHEMA,
        "command": results.command,
        "quick": results.settings.quick,
        "started": results.started,
        "duration_s": round(results.duration_s, 1),
        "machine": {**results.machine, "load_average_at_end": results.load_average_at_end},
        "settings": asdict(results.settings),
        "daemon_command": results.daemon_command,
        "daemon_idle": results.daemon_idle,
        "paths": results.paths,
        "notes": results.notes,
        "throughput": [],
        "lookup": [],
        "scaling": [],
        "volume": [],
    }
    for shape_result in results.throughput:
        shape = shape_result.shape
        points = []
        for op, by_blocks in shape_result.results.items():
            for blocks, by_path in sorted(by_blocks.items()):
                for path, point in by_path.items():
                    points.append(
                        {
                            "op": op,
                            "blocks": blocks,
                            "path": path,
                            "gib_per_s": _num(point.samples.gib_s),
                            "median_s": _num(point.samples.median_s, 7),
                            "cpu_s_per_gib": _num(point.cpu_s_per_gib),
                            "samples": point.samples.as_dict(),
                        }
                    )
        doc["throughput"].append(
            {
                "shape": shape.name,
                "description": shape.describe(),
                "value_bytes": shape.value_bytes,
                "slices_per_value": shape.regions,
                "verified": shape_result.verified,
                "points": points,
            }
        )
    for lp in results.lookup:
        doc["lookup"].append(
            {
                "tokens": lp.tokens,
                "keys": lp.keys,
                "hit_tokens": lp.hit_tokens,
                "daemon": _latency(lp.daemon),
                "raw": _latency(lp.raw),
                "placement": _latency(lp.placement),
                "overhead": _num(lp.overhead),
            }
        )
    for sp in results.scaling:
        doc["scaling"].append(
            {
                "ranks": sp.ranks,
                "rounds": sp.rounds,
                "bytes_per_request": sp.bytes_per_request,
                "per_rank_save_gib_s": _num(sp.per_rank_save),
                "per_rank_load_gib_s": _num(sp.per_rank_load),
                "aggregate_gib_s": _num(sp.aggregate_gib_s),
                "wall_s": _num(sp.wall_s),
                "daemon_cpu_s": _num(sp.daemon_cpu_s),
                "daemon_cpu_s_per_gib": _num(sp.daemon_cpu_s_per_gib),
                "daemon_rss_mib": round(sp.daemon_rss_bytes / 2**20, 1),
                "daemon_peak_rss_mib": round(sp.daemon_peak_rss_bytes / 2**20, 1),
                "save_gib_s_by_rank": [_num(v) for v in sp.save_gib_s],
                "load_gib_s_by_rank": [_num(v) for v in sp.load_gib_s],
            }
        )
    for vr in results.volume:
        doc["volume"].append(
            {
                "case": vr.case,
                "blocks": vr.blocks,
                "replication_factor": vr.factor,
                "distinct_bytes": vr.distinct_bytes,
                "daemon": {
                    "written_bytes": vr.daemon_written,
                    "stored_bytes": vr.daemon_stored,
                    "ratio": _num(vr.daemon_ratio),
                    "stored_ratio": _num(vr.daemon_stored_ratio),
                    "resave_written_bytes": vr.resave_written,
                },
                "per_rank_writer": {
                    "written_bytes": vr.naive_written,
                    "stored_bytes": vr.naive_stored,
                    "ratio": _num(vr.naive_ratio),
                    "stored_ratio": _num(vr.naive_stored / vr.distinct_bytes),
                    "resave_written_bytes": vr.naive_rewritten,
                },
            }
        )
    doc["headline"] = headline(doc)
    return doc


# ---- headline ----


def rate(doc_shape: dict[str, Any], op: str, blocks: int, path: str) -> float:
    """GiB/s of one point of a shape's JSON, NaN if not measured."""
    for p in doc_shape["points"]:
        if p["op"] == op and p["blocks"] == blocks and p["path"] == path and p["gib_per_s"] is not None:
            return float(p["gib_per_s"])
    return math.nan


def _row(metric: str, value: float, target: str, met: bool | None, unit: str = "x") -> dict[str, Any]:
    return {"metric": metric, "value": _num(value, 3), "unit": unit, "target": target, "met": met}


def headline(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The ratios the issue asks for, each with its target."""
    rows = []
    for shape in doc["throughput"]:
        name = shape["shape"].upper()
        warm = sorted({p["blocks"] for p in shape["points"] if p["op"] == "save"})
        if warm:
            n = warm[-1]
            for op in ("save", "load"):
                d = rate(shape, op, n, "daemon")
                for other, target in (("in-process", 0.9), ("memcpy", 0.5)):
                    r = ratio(d, rate(shape, op, n, other))
                    met = None if math.isnan(r) else r >= target
                    rows.append(_row(f"{name} {op} ({n} blocks): daemon / {other}", r, f">= {target}", met))
        cold = sorted({p["blocks"] for p in shape["points"] if p["op"] == "save_cold"})
        if cold:
            n = cold[-1]
            r = ratio(rate(shape, "save_cold", n, "daemon"), rate(shape, "save_cold", n, "in-process"))
            rows.append(
                _row(
                    f"{name} save, cold segment ({n} blocks): daemon / in-process",
                    r,
                    ">= 0.9",
                    None if math.isnan(r) else r >= 0.9,
                )
            )
    for lp in doc["lookup"]:
        if lp["tokens"] == LOOKUP_TARGET_TOKENS and lp["overhead"] is not None:
            rows.append(
                _row(
                    "lookup overhead over the raw existence check, 32k tokens",
                    100 * lp["overhead"],
                    "< 20%",
                    lp["overhead"] < 0.2,
                    "%",
                )
            )
    scaling = doc["scaling"]
    if len(scaling) > 1:
        one, top = scaling[0], scaling[-1]
        r = ratio(top["aggregate_gib_s"] or math.nan, one["aggregate_gib_s"] or math.nan)
        rows.append(
            _row(
                f"aggregate throughput, {top['ranks']} ranks / {one['ranks']} rank",
                r,
                ">= 0.9 (2 cores shared)",
                None if math.isnan(r) else r >= 0.9,
            )
        )
    for vr in doc["volume"]:
        d = vr["daemon"]["ratio"]
        rows.append(_row(f"write volume {vr['case']}: daemon", d, "= 1.0", d == 1.0))
        rows.append(
            _row(f"write volume {vr['case']}: per-rank writer", vr["per_rank_writer"]["ratio"], "(no dedup)", None)
        )
    return rows
