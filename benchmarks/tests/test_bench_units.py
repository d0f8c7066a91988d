"""The bench's pure parts: statistics, options, the command line it records, the report it renders."""

from __future__ import annotations

import argparse
import io
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import kvsidecar_bench
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.render import render_markdown
from kvsidecar_bench.report import headline
from kvsidecar_bench.settings import QUICK, Settings, add_arguments, command_line, from_args, out_dir
from kvsidecar_bench.shapes import GQA, MLA, Request, hashes_for
from kvsidecar_bench.stats import Samples, gib_per_s, percentile, ratio, rotated


def parse(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def test_samples_report_median_throughput():
    s = Samples()
    for seconds in (1.0, 2.0, 4.0):
        s.add(seconds, 1 << 30)
    assert s.median_s == 2.0
    assert s.gib_s == pytest.approx(0.5)
    assert gib_per_s(1 << 30, 0.5) == 2.0
    assert math.isnan(ratio(1.0, math.nan))


def test_rotation_gives_every_path_a_turn_first():
    paths = ["a", "b", "c"]
    assert [rotated(paths, r)[0] for r in range(4)] == ["a", "b", "c", "a"]


def test_quick_and_full_defaults_and_overrides():
    assert parse() == Settings()
    assert parse("--quick") == QUICK
    s = parse("--quick", "--blocks", "2,4", "--sections", "volume", "--no-real-client")
    assert s.blocks == (2, 4) and s.sections == ("volume",) and not s.real_client and s.quick


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        parse("--sections", "nope")
    with pytest.raises(ValueError, match="multiples of the 16-token block"):
        parse("--lookup-tokens", "100")
    with pytest.raises(ValueError, match="up to 8"):
        parse("--ranks", "16")


def test_the_recorded_command_reproduces_the_settings():
    s = parse("--quick", "--blocks", "2,4", "--segment-size", "64MiB", "--no-real-client")
    line = command_line(s)
    assert line.startswith("kvsidecar bench --quick")
    assert parse(*line.split()[2:]) == s


def test_results_go_where_the_user_says_or_to_a_folder_of_their_own(tmp_path):
    assert out_dir(parse("--quick")) is None  # the tables are printed
    assert out_dir(parse("--out", str(tmp_path))) == tmp_path
    full = out_dir(parse())  # never the checkout's committed docs/benchmarks
    assert full is not None and full.is_dir() and full.is_relative_to(tempfile.gettempdir())
    assert full.name.startswith("kvsidecar-bench-results-") and not any(full.iterdir())
    full.rmdir()
    assert command_line(parse("--out", str(tmp_path))) == "kvsidecar bench"  # where it went changes no result


def test_shapes_match_the_models_they_name():
    assert MLA.value_bytes == 61 * 16 * 576 * 2
    assert GQA.value_bytes == 32 * 2 * 16 * 8 * 128 * 2
    request = Request.of(MLA, "t", 4, 10)
    assert request.save_ids == [0, 1, 2, 3] and request.load_ids == [10, 11, 12, 13]
    assert request.num_tokens == 65 and request.nbytes == 4 * MLA.value_bytes
    assert hashes_for("a", 3) != hashes_for("b", 3) and len(hashes_for("a", 3)[0]) == 32


def test_progress_without_a_terminal_prints_sections_only():
    out = io.StringIO()
    p = Progress(3, stream=out)
    p.section("one")
    p.step("x")
    p.note("a note")
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("] one") and lines[1] == "a note"


def _latency(p50: float) -> dict:
    return {"p50_ms": p50, "p99_ms": 2 * p50}


def _bytes(written: int, ratio: float) -> dict:
    return {"written_bytes": written, "stored_bytes": written, "ratio": ratio, "stored_ratio": ratio}


def _doc() -> dict:
    rates = {
        "save": {"daemon": 9.0, "in-process": 8.0, "memcpy": 10.0},
        "load": {"daemon": 4.0, "in-process": 8.0, "memcpy": 10.0},
    }
    points = [
        {"op": op, "blocks": 64, "path": path, "gib_per_s": rate, "median_s": 0.01, "cpu_s_per_gib": 0.1}
        for op, by_path in rates.items()
        for path, rate in by_path.items()
    ]
    machine = {
        "cpu": "cpu",
        "cores": 2,
        "usable_cores": 2,
        "memory_gib": 1.0,
        "kernel": "k",
        "python": "3",
        "torch_threads": 1,
        "transparent_hugepages": "madvise",
        "versions": {"kvsidecar": "0"},
        "load_average_at_start": [1.0],
    }
    lookup = {
        "tokens": 32768,
        "keys": 10,
        "hit_tokens": 1,
        "overhead": 0.05,
        "daemon": _latency(1.05),
        "raw": _latency(1.0),
        "every": _latency(1.0),
        "case": "full hit",
        "probed": 10,
        "of_every": 1.05,
        "placement": _latency(0.1),
        "in_process": _latency(1.2),
        "of_in_process": 0.875,
    }
    volume = {
        "case": "MLA, T=8",
        "blocks": 1,
        "replication_factor": 8,
        "distinct_bytes": 1 << 20,
        "daemon": {**_bytes(1 << 20, 1.0), "resave_written_bytes": 0},
        "per_rank_writer": {**_bytes(8 << 20, 8.0), "resave_written_bytes": 0},
    }
    return {
        "command": "kvsidecar bench",
        "started": "now",
        "duration_s": 1.0,
        "machine": machine,
        "notes": [],
        "paths": ["daemon", "in-process", "memcpy"],
        "throughput": [{"shape": "mla", "description": "MLA", "value_bytes": 1 << 20, "points": points}],
        "lookup": [lookup],
        "scaling": [],
        "volume": [volume],
    }


def test_headline_ratios_and_targets():
    rows = {r["metric"]: r for r in headline(_doc())}
    save = rows["MLA save (64 blocks): daemon / in-process"]
    assert save["value"] == pytest.approx(1.125) and save["met"] is True
    assert rows["MLA load (64 blocks): daemon / in-process"]["met"] is False
    assert rows["lookup overhead over the raw existence check, 32k tokens"]["met"] is True
    assert rows["lookup, full hit, 32k tokens: daemon / probing every key"]["met"] is True
    bound = rows["lookup, full hit, 32k tokens: daemon / the same staged lookup in-process"]
    assert (bound["value"], bound["met"], bound["target"]) == (0.875, None, "(bound)")
    assert rows["lookup, full hit, 32k tokens: raw checks of the stages / probing every key"]["met"] is None
    assert rows["a step of 32 requests: one batched call / 32 calls"]["met"] is False  # not measured: not met
    assert all(r["goal"] and r["peer"] for r in rows.values())
    assert rows["write volume MLA, T=8: daemon"]["met"] is True


def test_goal_1_judges_only_8_to_128_blocks():
    doc = _doc()
    shape = doc["throughput"][0]
    # 4 blocks, outside the goal's range, is far slower: it stays in the table but the headline judges 8-128.
    shape["points"] += [
        {**p, "blocks": blocks, "gib_per_s": p["gib_per_s"] * (0.1 if blocks == 4 else 1.0)}
        for p in shape["points"]
        for blocks in (4, 128)
    ]
    rows = {r["metric"]: r for r in headline(doc)}
    save = rows["MLA save (worst of 64-128 blocks: 64): daemon / in-process"]
    assert save["value"] == pytest.approx(1.125) and save["met"] is True
    assert not [m for m in rows if " 4-" in m or ": 4)" in m]


def test_the_step_rows_judge_batched_against_separate_calls():
    doc = _doc()
    step = {"shape": "gqa", "requests": 32, "blocks": 80, "bytes": 80 << 21, "verified": True}
    doc["step"] = [
        {**step, "op": "save", "batched_over_separate": 0.5, "batched": _latency(10), "separate": _latency(20)},
        {**step, "op": "load", "batched_over_separate": 1.2, "batched": _latency(12), "separate": _latency(10)},
    ]
    rows = [r for r in headline(doc) if r["goal"] == "2 one RPC per step"]
    assert [(r["value"], r["target"], r["met"]) for r in rows] == [(0.5, "< 1.0", True), (1.2, "< 1.0", False)]
    assert "one SaveBatch / 32 Save calls" in rows[0]["metric"] and "GQA" in rows[0]["metric"]
    assert "separate calls" in rows[0]["peer"]
    doc["headline"] = headline(doc)
    assert "## 1b. One engine step" in render_markdown(doc)


def test_markdown_has_every_section_and_the_command():
    doc = _doc()
    doc["headline"] = headline(doc)
    text = render_markdown(doc, plot="throughput.png")
    for heading in (
        "## Headline",
        "## 1. Save and load",
        "## 2. Lookup latency",
        "## 4. Write volume",
        "## How it was",
    ):
        assert heading in text
    assert "Command: `kvsidecar bench`" in text and "![throughput" in text


def test_the_daemon_command_line_never_imports_the_bench():
    code = "import sys; from kvsidecar.cli.main import build_parser; build_parser(); print(*sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in loaded if m.split(".")[0] in ("kvsidecar_bench", "torch", "mooncake")]


def test_only_mooncake_direct_calls_mooncake():
    package = Path(kvsidecar_bench.__file__).parent
    callers = {p.name for p in package.glob("*.py") if re.search(r"^\s*(from|import) mooncake\b", p.read_text(), re.M)}
    assert callers == {"mooncake_direct.py"}


def test_the_headline_reads_a_bound_a_floor_and_a_machine_too_small_as_what_they_are():
    doc = _doc()
    doc["lookup"][0].update(case="10% hit", of_every=0.27, every=_latency(1.0), raw=_latency(0.22))
    doc["step"] = [
        {"shape": "mla", "requests": 32, "blocks": 80, "bytes": 1, "verified": True, "op": "save",
         "batched_over_separate": 1.2, "batched": _latency(12), "separate": _latency(10)}
    ]  # fmt: skip
    doc["headline"] = headline(doc)
    rows = {r["metric"]: r for r in doc["headline"]}
    load = "MLA load (64 blocks): daemon / in-process"
    assert rows[load]["met"] is False and rows[load]["needs_cores"] == 5  # the JSON keeps the verdict
    floor = rows["lookup, 10% hit, 32k tokens: daemon / probing every key"]
    assert (floor["met"], floor["floor"]) == (False, 0.22)

    def met(text: str, metric: str) -> str:
        return next(line for line in text.splitlines() if f"| {metric} |" in line).rsplit("|", 2)[1].strip()

    two_cores = render_markdown(doc)
    assert met(two_cores, load) == "not on 2 cores"
    assert met(two_cores, "lookup, 10% hit, 32k tokens: daemon / probing every key") == "out of reach (floor 0.22x)"
    assert met(two_cores, "MLA save (64 blocks): daemon / memcpy") == "bound"
    assert met(two_cores, "write volume MLA, T=8: per-rank writer") == "for comparison"
    # Batched against separate calls is the daemon against itself: the cores do not excuse it.
    assert met(two_cores, "MLA step of 32 saves (80 blocks): one SaveBatch / 32 Save calls") == "**no**"
    assert "- *not on 2 cores*: unmet, where the target compares the daemon with calls in the rank's own" in two_cores
    assert "- *out of reach*:" in two_cores and "- *bound*:" in two_cores
    doc["machine"]["usable_cores"] = 8
    assert met(render_markdown(doc), load) == "**no**"
