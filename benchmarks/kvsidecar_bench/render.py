"""The human-readable report and its plot, rendered from the JSON document alone (so results.json re-renders)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvsidecar_bench.report import OP_TITLES, path_titles, rate
from kvsidecar_bench.stats import ratio

__all__ = ["plot_throughput", "render_markdown"]

_PLOT_STYLE = {"daemon": "o-", "in-process": "s--", "real-client": "^:", "memcpy": "x-."}


def _f(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return [*out, *("| " + " | ".join(row) + " |" for row in rows), ""]


def _section(title: str, items: Sequence[Any], columns: Sequence[tuple[str, Callable[[Any], str]]]) -> list[str]:
    """A heading and a table of one row per item, one column per (heading, cell of an item)."""
    return [title, "", *_table([h for h, _ in columns], [[cell(item) for _, cell in columns] for item in items])]


def render_markdown(doc: dict[str, Any], *, plot: str | None = None) -> str:
    """The human-readable report of a JSON document from `report.to_json`."""
    m = doc["machine"]
    lines = [
        "# kvsidecar bench",
        "",
        f"Command: `{doc['command']}`  ",
        f"Started {doc['started']}, took {doc['duration_s']:.0f} s.  ",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['memory_gib']} GiB, "
        f"Linux {m['kernel']}, Python {m['python']}, torch threads {m['torch_threads']}, "
        f"transparent huge pages `{m['transparent_hugepages']}`.  ",
        *_gpu_line(m),
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".  ",
        f"Load average at start {m['load_average_at_start']}, at end {m.get('load_average_at_end', [])}: "
        "the machine is shared, so compare paths within this run (they were measured side by side, interleaved) "
        "rather than across runs.",
        "",
    ]
    lines += [f"- {note}" for note in doc["notes"]] + ([""] if doc["notes"] else [])
    cores = m.get("usable_cores") or m["cores"]
    lines += _section(
        "## Headline",
        doc["headline"],
        [
            ("goal", lambda r: r.get("goal", "-")),
            ("metric", lambda r: r["metric"]),
            ("measured against", lambda r: r.get("peer", "-")),
            ("value", lambda r: _f(r["value"]) + {"%": "%", "s": " s"}.get(r["unit"], "x")),
            ("target", lambda r: r["target"]),
            ("met", lambda r: _verdict(r, cores)),
        ],
    )
    lines += _verdict_legend(doc["headline"], cores)
    lines += _throughput_md(doc, plot) + _step_md(doc) + _lookup_md(doc) + _scaling_md(doc) + _volume_md(doc)
    lines += [
        "## How it was measured",
        "",
        'How every path is built and timed: docs/benchmarks/README.md, "How it was measured".',
        "",
    ]
    return "\n".join(lines)


def _verdict(row: dict[str, Any], cores: int) -> str:
    """Whether a row met its target, read as what it is: a bound is no target, and a miss this machine cannot
    help (its own floor is past the target, or the target assumes more cores than it has) is no regression."""
    if row["met"] is True:
        return "yes"
    if row["met"] is None:
        if not row["target"].startswith("("):
            return "-"  # not measured
        return "bound" if row["target"] == "(bound)" else "for comparison"
    if row.get("floor") is not None:
        return f"out of reach (floor {_f(row['floor'])}x)"
    if cores < row.get("needs_cores", 0):
        return f"not on {cores} cores"
    return "**no**"


def _verdict_legend(rows: Sequence[dict[str, Any]], cores: int) -> list[str]:
    """What the softer verdicts of this table mean, for those it has."""
    legend = []
    verdicts = [_verdict(r, cores) for r in rows]
    needs = max((r.get("needs_cores", 0) for r in rows if _verdict(r, cores).startswith("not on")), default=0)
    if "bound" in verdicts:
        legend.append(
            "*bound*: a limit the path is measured against (memcpy, the raw checks it must make, the same calls "
            "in-process), not a target."
        )
    if any(v.startswith("out of reach") for v in verdicts):
        legend.append(
            "*out of reach*: a bound measured in this run (the raw checks of the keys the lookup must probe, made "
            "in-process) is already past the target, so no daemon reaches it on this master."
        )
    if any(v.startswith("not on") for v in verdicts):
        legend.append(
            f"*not on {cores} cores*: unmet, where the target compares the daemon with calls in the rank's own "
            f"process and assumes at least {needs} usable cores: an 8-block save through the daemon keeps "
            "five threads of two processes busy, in-process Mooncake two, so here the daemon's threads wait for the "
            "rank's (docs/benchmarks/perf-changes.md)."
        )
    return [*(f"- {line}" for line in legend), *([""] if legend else [])]


def _gpu_line(machine: dict[str, Any]) -> list[str]:
    gpu = machine.get("gpu")
    if not gpu:
        return []
    return [
        f"GPU (cuda:0 of {gpu['count']}): {gpu['name']}, {gpu['memory_gib']} GiB, compute capability "
        f"{gpu['capability']}, driver {gpu['driver']}, CUDA {gpu['cuda']} (torch).  "
    ]


def _throughput_md(doc: dict[str, Any], plot: str | None) -> list[str]:
    if not doc["throughput"]:
        return []
    paths = doc["paths"]
    lines = ["## 1. Save and load throughput (GiB/s, median of rounds)", ""]
    titles = path_titles(doc)
    lines += [f"- **{p}**: {titles.get(p, p)}" for p in paths] + [""]
    for shape in doc["throughput"]:
        rows = []
        for op in ("save", "save_cold", "load"):
            for n in sorted({p["blocks"] for p in shape["points"] if p["op"] == op}):
                rates = {path: rate(shape, op, n, path) for path in paths}
                d, ip, mc = (rates.get(p, math.nan) for p in ("daemon", "in-process", "memcpy"))
                cpu = {p["path"]: p["cpu_s_per_gib"] for p in shape["points"] if p["op"] == op and p["blocks"] == n}
                rows.append(
                    [OP_TITLES[op], str(n), f"{n * shape['value_bytes'] / 2**20:.0f}"]
                    + [_f(rates[p]) for p in paths]
                    + [_f(ratio(d, ip)), _f(ratio(d, mc)), _f(cpu.get("daemon"), 3), _f(cpu.get("in-process"), 3)]
                )
        header = ["op", "blocks", "MiB", *paths, "daemon/in-proc", "daemon/memcpy", "CPU s/GiB daemon"]
        lines += [f"### {shape['description']}", "", *_table([*header, "CPU s/GiB in-proc"], rows)]
    if plot:
        lines += [f"![throughput against block count]({plot})", ""]
    return lines


def _step_md(doc: dict[str, Any]) -> list[str]:
    if not doc.get("step"):
        return []
    first = doc["step"][0]
    title = (
        f"## 1b. One engine step: {first['requests']} requests of 1-4 blocks, one batched call against one call per "
        "request (ms per step, interleaved)"
    )
    return _section(
        title,
        doc["step"],
        [
            ("shape", lambda sp: sp["shape"]),
            ("op", lambda sp: sp["op"]),
            ("blocks", lambda sp: str(sp["blocks"])),
            ("MiB", lambda sp: f"{sp['bytes'] / 2**20:.0f}"),
            ("batched p50", lambda sp: _f(sp["batched"]["p50_ms"])),
            ("separate p50", lambda sp: _f(sp["separate"]["p50_ms"])),
            ("batched / separate", lambda sp: _f(sp["batched_over_separate"], 3)),
            ("CPU batched / separate", lambda sp: _f(sp.get("cpu_batched_over_separate"), 3)),
            ("bytes verified", lambda sp: "yes" if sp["verified"] else "**no**"),
        ],
    )


def _lookup_md(doc: dict[str, Any]) -> list[str]:
    if not doc["lookup"]:
        return []
    title = "## 2. Lookup latency (ms): T=8, H=8, groups mla + full_attention + mamba, staged probes"
    return _section(
        title,
        doc["lookup"],
        [
            ("prompt tokens", lambda lp: str(lp["tokens"])),
            ("case", lambda lp: lp.get("case", "full hit")),
            ("keys probed / all", lambda lp: f"{lp.get('probed', lp['keys'])} / {lp['keys']}"),
            ("daemon p50", lambda lp: _f(lp["daemon"]["p50_ms"])),
            ("daemon p99", lambda lp: _f(lp["daemon"]["p99_ms"])),
            ("in-process p50", lambda lp: _f(lp.get("in_process", {}).get("p50_ms"))),
            ("daemon / in-process", lambda lp: _f(lp.get("of_in_process"), 3)),
            ("raw probed p50", lambda lp: _f(lp["raw"]["p50_ms"])),
            ("raw every key p50", lambda lp: _f(lp.get("every", {}).get("p50_ms"))),
            ("overhead (p50)", lambda lp: _f(100 * lp["overhead"], 1) + "%" if lp["overhead"] is not None else "-"),
            ("daemon / every key", lambda lp: _f(lp.get("of_every"), 3)),
            ("placement p50", lambda lp: _f(lp["placement"]["p50_ms"])),
        ],
    )


def _scaling_md(doc: dict[str, Any]) -> list[str]:
    if not doc["scaling"]:
        return []
    first = doc["scaling"][0]
    mib = first["bytes_per_request"] / 2**20
    title = f"## 3. Scaling: ranks saving and loading at once ({mib:.0f} MiB per request and rank)"
    lines = _section(
        title,
        doc["scaling"],
        [
            ("ranks", lambda sp: str(sp["ranks"])),
            ("per-rank save GiB/s", lambda sp: _f(sp["per_rank_save_gib_s"])),
            ("per-rank load GiB/s", lambda sp: _f(sp["per_rank_load_gib_s"])),
            ("aggregate GiB/s", lambda sp: _f(sp["aggregate_gib_s"])),
            ("daemon CPU s/GiB", lambda sp: _f(sp["daemon_cpu_s_per_gib"], 3)),
            ("daemon RSS MiB", lambda sp: _f(sp["daemon_rss_mib"], 0)),
            ("peak RSS MiB", lambda sp: _f(sp["daemon_peak_rss_mib"], 0)),
        ],
    )
    idle = doc.get("daemon_idle") or {}
    if idle:
        lines += [f"Daemon at rest before the run: RSS {idle.get('rss_mib', 0):.0f} MiB (its segment included).", ""]
    return lines


def _volume_md(doc: dict[str, Any]) -> list[str]:
    if not doc["volume"]:
        return []
    title = "## 4. Write volume: bytes written per distinct byte of KV (8 ranks save the same request)"
    return _section(
        title,
        doc["volume"],
        [
            ("case", lambda v: v["case"]),
            ("ranks per copy", lambda v: str(v["replication_factor"])),
            ("distinct MiB", lambda v: _f(v["distinct_bytes"] / 2**20)),
            ("daemon wrote MiB", lambda v: _f(v["daemon"]["written_bytes"] / 2**20)),
            ("daemon ratio", lambda v: _f(v["daemon"]["ratio"], 3)),
            ("daemon ratio (store)", lambda v: _f(v["daemon"]["stored_ratio"], 3)),
            ("re-save bytes", lambda v: str(v["daemon"]["resave_written_bytes"])),
            ("per-rank writer ratio", lambda v: _f(v["per_rank_writer"]["ratio"], 3)),
            ("per-rank (store)", lambda v: _f(v["per_rank_writer"]["stored_ratio"], 3)),
        ],
    )


def plot_throughput(doc: dict[str, Any], path: Path) -> str | None:
    """Throughput against block count as a PNG if matplotlib is installed; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e './benchmarks[plot]'): no plot"
    shapes = doc["throughput"]
    if not shapes:
        return "no throughput section: no plot"
    ops = ("save", "load")
    fig, axes = plt.subplots(len(shapes), len(ops), figsize=(11, 4 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        for col, op in enumerate(ops):
            ax = axes[row][col]
            for name in doc["paths"]:
                points = sorted(
                    (p["blocks"], p["gib_per_s"])
                    for p in shape["points"]
                    if p["op"] == op and p["path"] == name and p["gib_per_s"] is not None
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, _PLOT_STYLE.get(name, "-"), label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("blocks per request")
            ax.set_ylabel("GiB/s (median)")
            ax.set_ylim(bottom=0)
            mib = shape["value_bytes"] / 2**20
            ax.set_title(f"{shape['shape'].upper()} {op} (warm segment), {mib:.2f} MiB per block")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(doc["command"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
