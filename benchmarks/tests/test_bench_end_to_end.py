"""`kvsidecar bench` in a tiny run, end to end: real masters, a real daemon process, rank processes, the report.

Timings are never asserted (the machine is shared); the report's structure and the write-volume property are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar_bench import add_arguments, run

pytestmark = pytest.mark.integration

TINY = [
    "--quick",
    "--shapes", "mla",
    "--blocks", "2",
    "--rounds", "1",
    "--cold-blocks", "2",
    "--cold-rounds", "1",
    "--step-requests", "4",
    "--step-rounds", "1",
    "--lookup-tokens", "256",
    "--lookup-reps", "2",
    "--ranks", "1,2",
    "--scale-blocks", "2",
    "--scale-rounds", "1",
    "--volume-blocks", "2",
    "--segment-size", "64MiB",
    "--no-progress",
]  # fmt: skip


def _children(pid: int) -> list[int]:
    """Live child processes of pid, except multiprocessing's resource tracker (shared_tensor's, lives with us)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in command:
            out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("bench")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    before = set(_children(os.getpid()))
    assert run(parser.parse_args([*TINY, "--out", str(out)])) == 0
    # Every process the bench started (masters, daemon, mooncake_client, rank processes) was stopped and reaped.
    assert set(_children(os.getpid())) <= before
    doc = json.loads((out / "results.json").read_text())
    return doc, (out / "results.md").read_text(), out


def test_an_interrupted_run_stops_what_it_started_and_says_which_folder_it_removed():
    argv = [str(Path(sys.executable).with_name("kvsidecar-bench")), *(a for a in TINY if a != "--no-progress")]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's Ctrl-C, even under nohup
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the first section starts: its processes are being started
        assert "starting masters, the daemon and Mooncake clients" in first, first
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err
    said = re.search(r"every process it started was stopped and its temporary folder (\S+) removed", err)
    assert said, err
    assert not Path(said.group(1)).exists()


def test_every_path_moved_the_right_bytes(report):
    doc, _, _ = report
    assert doc["paths"][0] == "daemon" and "in-process" in doc["paths"] and "memcpy" in doc["paths"]
    (shape,) = doc["throughput"]
    assert shape["shape"] == "mla" and all(shape["verified"].values())
    measured = {(p["op"], p["path"]) for p in shape["points"] if p["gib_per_s"] is not None}
    for path in doc["paths"]:
        assert {("save", path), ("load", path), ("save_cold", path)} <= measured


def test_lookup_scaling_and_report_structure(report):
    doc, markdown, out = report
    cases = {lp["case"]: lp for lp in doc["lookup"]}
    assert set(cases) == {"full hit", "10% hit", "miss"}
    lookup = cases["full hit"]
    assert lookup["tokens"] == 256 and lookup["hit_tokens"] == 240 and lookup["keys"] == 16 * 17
    assert len(lookup["daemon"]["seconds"]) == 2 and len(lookup["raw"]["seconds"]) == 2
    # The in-process lookup is the raw calls and the keys built for them: never quicker than the calls alone.
    assert all(a >= b for a, b in zip(lookup["in_process"]["seconds"], lookup["raw"]["seconds"], strict=True))
    # A full hit probes everything that can matter (the boundary at the last token cannot).
    assert len(lookup["every"]["seconds"]) == 2 and lookup["keys"] - 17 <= lookup["probed"] <= lookup["keys"]
    assert cases["miss"]["hit_tokens"] == 0 and cases["miss"]["probed"] < lookup["keys"]
    assert 0 < cases["10% hit"]["hit_tokens"] < 240
    assert [s["ranks"] for s in doc["scaling"]] == [1, 2]
    assert all(s["daemon_rss_mib"] > 0 for s in doc["scaling"])
    assert doc["command"].startswith("kvsidecar bench --quick") and doc["machine"]["cores"] >= 1
    for heading in ("## Headline", "## 1. Save and load", "## 2. Lookup", "## 3. Scaling", "## 4. Write volume"):
        assert heading in markdown
    assert doc["command"] in markdown
    plotted = (out / "throughput.png").exists()
    assert plotted == ("![throughput" in markdown)


def test_a_step_is_measured_both_ways_with_its_bytes_checked(report):
    doc, markdown, _ = report
    steps = {(sp["shape"], sp["op"]): sp for sp in doc["step"]}
    assert set(steps) == {("mla", "save"), ("mla", "load")}
    for sp in steps.values():
        assert (sp["requests"], sp["blocks"]) == (4, 1 + 2 + 3 + 4) and sp["verified"]
        assert len(sp["batched"]["seconds"]) == len(sp["separate"]["seconds"]) == 1
        assert sp["batched_over_separate"] is not None
    rows = [r for r in doc["headline"] if r["goal"] == "2 one RPC per step"]
    assert len(rows) == 2 and all(r["met"] is not None for r in rows)
    assert "## 1b. One engine step" in markdown


def test_write_volume_is_one_byte_per_distinct_byte(report):
    doc, _, _ = report
    cases = {v["case"]: v for v in doc["volume"]}
    assert set(cases) == {"MLA, T=8", "GQA, T=8, H=2"}
    for case, copies in (("MLA, T=8", 8), ("GQA, T=8, H=2", 4)):
        v = cases[case]
        assert v["replication_factor"] == copies
        # Striping and existence checks: no value is written twice, by the writers' count and the master's.
        assert v["daemon"]["ratio"] == 1.0
        # The store holds every value's trailer besides its KV bytes.
        assert v["daemon"]["written_bytes"] == v["distinct_bytes"]
        assert v["daemon"]["stored_bytes"] == v["distinct_bytes"] + v["daemon"]["trailer_bytes"]
        assert v["daemon"]["resave_written_bytes"] == 0
        # A writer without shared placement stores every rank's copy.
        assert v["per_rank_writer"]["ratio"] == float(copies)
        assert v["per_rank_writer"]["stored_bytes"] == copies * v["distinct_bytes"]
