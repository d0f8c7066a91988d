"""The GPU check's own harness, dry-run on CPU (GPU_CHECK_INSTALL=here: the daemon as installed for this Python):
what a lent GPU machine hands back (at most 8 files: here always two), a section past its time limit failing and
leaving nothing it started running, and a wheelhouse that cannot be built failing instead of coming out empty."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif("KVSIDECAR_GPU_CHECK" in os.environ, reason="the GPU check does not run itself"),
]

REPO = Path(__file__).resolve().parents[2]
MARKER = b"KVSIDECAR_GPU_CHECK="


def marked() -> list[int]:
    """Processes that carry a GPU-check section's marker in their environment."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                environ = (p / "environ").read_bytes()
            except OSError:
                continue
            if MARKER in environ:
                found.append(int(p.name))
    return found


def test_a_section_past_its_limit_fails_leaves_nothing_running_and_two_files_come_back(tmp_path):
    out = tmp_path / "out"
    # The section's own pytest keeps its folders there, not in Mooncake's; short, since its daemons bind Unix
    # sockets under it (107 bytes at most, which this test's own folder under pytest's would pass).
    short = Path(tempfile.mkdtemp(prefix="gpuck-"))
    env = {
        **os.environ,
        "TMPDIR": str(short),
        "OUT": str(out),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "GPU_CHECK_INSTALL": "here",
        "PYTHON": sys.executable,
        "GPU_CHECK_ONLY": "path",
        "GPU_CHECK_LIMIT": "6",  # the path section starts a daemon and ranks and runs for longer
    }
    try:
        done = subprocess.run(
            ["bash", "scripts/gpu-check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL path (exit 124: past 6 s)" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["check.tar.gz", "summary.txt"]
    assert (out / "summary.txt").read_text() == done.stdout
    with tarfile.open(out / "check.tar.gz") as archive:
        assert "results/path.log" in archive.getnames()
    assert marked() == [], "a process the section started is still running"


def test_a_wheelhouse_without_the_daemons_packages_fails_saying_so(tmp_path):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a Python without the daemon's packages: a clone without .venv
    env = {**os.environ, "PY": str(bare / "bin" / "python"), "WHEELHOUSE": str(tmp_path / "wheelhouse")}
    done = subprocess.run(
        ["bash", "scripts/gpu/wheelhouse.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "has no grpcio: run scripts/setup.sh first" in done.stderr
