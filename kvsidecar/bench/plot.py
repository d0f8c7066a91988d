"""Throughput against block count as a PNG, if matplotlib is installed (the `bench` extra); else nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_throughput"]

_STYLE = {"daemon": "o-", "in-process": "s--", "real-client": "^:", "memcpy": "x-."}


def plot_throughput(doc: dict[str, Any], path: Path) -> str | None:
    """Write the plot; return None when it was written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvsidecar[bench]'): no plot"
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
                    ax.plot(xs, ys, _STYLE.get(name, "-"), label=name)
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
