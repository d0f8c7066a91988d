"""The human-readable report, rendered from the JSON document alone (so it can be re-rendered from results.json)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvsidecar.bench.report import OP_TITLES, PATH_TITLES, rate
from kvsidecar.bench.stats import ratio

__all__ = ["render_markdown"]


def _f(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def render_markdown(doc: dict[str, Any], *, plot: str | None = None) -> str:
    """The human-readable report of a JSON document from `to_json`."""
    from kvsidecar.bench.method import METHOD

    m = doc["machine"]
    lines = [
        "# kvsidecar bench",
        "",
        f"Command: `{doc['command']}`  ",
        f"Started {doc['started']}, took {doc['duration_s']:.0f} s.  ",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['memory_gib']} GiB, "
        f"Linux {m['kernel']}, Python {m['python']}, torch threads {m['torch_threads']}, "
        f"transparent huge pages `{m['transparent_hugepages']}`.  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".  ",
        f"Load average at start {m['load_average_at_start']}, at end {m.get('load_average_at_end', [])}: "
        "the machine is shared, so compare paths within this run (they were measured side by side, interleaved) "
        "rather than across runs.",
        "",
    ]
    for note in doc["notes"]:
        lines.append(f"- {note}")
    if doc["notes"]:
        lines.append("")
    lines += ["## Headline", ""]
    lines += _table(
        ["metric", "value", "target", "met"],
        [
            [
                r["metric"],
                _f(r["value"]) + ("%" if r["unit"] == "%" else "x"),
                r["target"],
                {True: "yes", False: "**no**", None: "-"}[r["met"]],
            ]
            for r in doc["headline"]
        ],
    )
    lines.append("")
    lines += _throughput_md(doc, plot)
    lines += _lookup_md(doc)
    lines += _scaling_md(doc)
    lines += _volume_md(doc)
    lines += ["## How it was measured", "", METHOD.strip(), ""]
    return "\n".join(lines)


def _throughput_md(doc: dict[str, Any], plot: str | None) -> list[str]:
    if not doc["throughput"]:
        return []
    paths = doc["paths"]
    lines = ["## 1. Save and load throughput (GiB/s, median of rounds)", ""]
    lines += [f"- **{p}**: {PATH_TITLES.get(p, p)}" for p in paths]
    lines.append("")
    for shape in doc["throughput"]:
        lines += [f"### {shape['description']}", ""]
        rows = []
        for op in ("save", "save_cold", "load"):
            for n in sorted({p["blocks"] for p in shape["points"] if p["op"] == op}):
                rates = [rate(shape, op, n, path) for path in paths]
                d = rates[paths.index("daemon")] if "daemon" in paths else math.nan
                ip = rates[paths.index("in-process")] if "in-process" in paths else math.nan
                mc = rates[paths.index("memcpy")] if "memcpy" in paths else math.nan
                cpu = {p["path"]: p["cpu_s_per_gib"] for p in shape["points"] if p["op"] == op and p["blocks"] == n}
                rows.append(
                    [OP_TITLES[op], str(n), f"{n * shape['value_bytes'] / 2**20:.0f}"]
                    + [_f(r) for r in rates]
                    + [_f(ratio(d, ip)), _f(ratio(d, mc)), _f(cpu.get("daemon"), 3), _f(cpu.get("in-process"), 3)]
                )
        header = ["op", "blocks", "MiB", *paths, "daemon/in-proc", "daemon/memcpy", "CPU s/GiB daemon"]
        header.append("CPU s/GiB in-proc")
        lines += _table(header, rows)
        lines.append("")
    if plot:
        lines += [f"![throughput against block count]({plot})", ""]
    return lines


def _lookup_md(doc: dict[str, Any]) -> list[str]:
    if not doc["lookup"]:
        return []
    lines = [
        "## 2. Lookup latency (ms): T=8, H=8, groups mla + full_attention + mamba, full hit",
        "",
    ]
    rows = [
        [
            str(lp["tokens"]),
            str(lp["keys"]),
            _f(lp["daemon"]["p50_ms"]),
            _f(lp["daemon"]["p99_ms"]),
            _f(lp["raw"]["p50_ms"]),
            _f(lp["raw"]["p99_ms"]),
            _f(100 * lp["overhead"], 1) + "%" if lp["overhead"] is not None else "-",
            _f(lp["placement"]["p50_ms"]),
        ]
        for lp in doc["lookup"]
    ]
    lines += _table(
        [
            "prompt tokens",
            "keys probed",
            "daemon p50",
            "daemon p99",
            "raw exist p50",
            "raw exist p99",
            "overhead (p50)",
            "placement p50",
        ],
        rows,
    )
    return [*lines, ""]


def _scaling_md(doc: dict[str, Any]) -> list[str]:
    if not doc["scaling"]:
        return []
    first = doc["scaling"][0]
    lines = [
        "## 3. Scaling: ranks saving and loading at once "
        f"({first['bytes_per_request'] / 2**20:.0f} MiB per request and rank)",
        "",
    ]
    rows = [
        [
            str(sp["ranks"]),
            _f(sp["per_rank_save_gib_s"]),
            _f(sp["per_rank_load_gib_s"]),
            _f(sp["aggregate_gib_s"]),
            _f(sp["daemon_cpu_s_per_gib"], 3),
            _f(sp["daemon_rss_mib"], 0),
            _f(sp["daemon_peak_rss_mib"], 0),
        ]
        for sp in doc["scaling"]
    ]
    lines += _table(
        [
            "ranks",
            "per-rank save GiB/s",
            "per-rank load GiB/s",
            "aggregate GiB/s",
            "daemon CPU s/GiB",
            "daemon RSS MiB",
            "peak RSS MiB",
        ],
        rows,
    )
    idle = doc.get("daemon_idle") or {}
    if idle:
        lines += ["", f"Daemon at rest before the run: RSS {idle.get('rss_mib', 0):.0f} MiB (its segment included)."]
    return [*lines, ""]


def _volume_md(doc: dict[str, Any]) -> list[str]:
    if not doc["volume"]:
        return []
    lines = ["## 4. Write volume: bytes written per distinct byte of KV (8 ranks save the same request)", ""]
    rows = []
    for vr in doc["volume"]:
        d, n = vr["daemon"], vr["per_rank_writer"]
        rows.append(
            [
                vr["case"],
                str(vr["replication_factor"]),
                _f(vr["distinct_bytes"] / 2**20),
                _f(d["written_bytes"] / 2**20),
                _f(d["ratio"], 3),
                _f(d["stored_ratio"], 3),
                str(d["resave_written_bytes"]),
                _f(n["ratio"], 3),
                _f(n["stored_ratio"], 3),
            ]
        )
    lines += _table(
        [
            "case",
            "ranks per copy",
            "distinct MiB",
            "daemon wrote MiB",
            "daemon ratio",
            "daemon ratio (store)",
            "re-save bytes",
            "per-rank writer ratio",
            "per-rank (store)",
        ],
        rows,
    )
    return [*lines, ""]
