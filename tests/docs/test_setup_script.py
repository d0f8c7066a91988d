"""The README's first command on an already set-up checkout: scripts/setup.sh only checks (seconds, no pip), and
finds what changed since the last set-up (a pyproject.toml, the script, the flavour) so that it installs again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parents[1]  # the environment this suite runs in, which scripts/setup.sh made
# What the last set-up installed from, as scripts/setup.sh stamps it.
STAMPED = (
    "pyproject.toml",
    "contract/pyproject.toml",
    "client/pyproject.toml",
    "benchmarks/pyproject.toml",
    "testing/pyproject.toml",
    "scripts/setup.sh",
)


def setup(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh"), *args],
        env={**os.environ, "VENV": str(VENV), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_second_run_only_checks():
    done = setup(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"setup: {VENV} is up to date with this checkout (nothing to install)",
        f"setup: {VENV} ready (0.1.0)",
    ]


def test_what_changed_since_the_last_set_up_is_named(tmp_path):
    for name in STAMPED:  # a checkout that differs from this one only where the test changes it
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    same = setup(tmp_path, "--check")
    assert (same.returncode, same.stdout) == (0, f"setup: {VENV} is up to date with this checkout\n"), same.stderr
    client = tmp_path / "client" / "pyproject.toml"
    client.write_text(client.read_text().replace('version = "0.1.0"', 'version = "0.1.1"', 1))
    changed = setup(tmp_path, "--check")
    assert changed.returncode == 1
    assert changed.stdout == f"setup: {VENV} needs setting up: changed since the last set-up: client/pyproject.toml\n"
    other = setup(tmp_path, "--check", FLAVOUR="cuda")
    assert other.stdout.endswith("changed since the last set-up: client/pyproject.toml, flavour\n"), other.stdout
    empty = setup(tmp_path, "--check", VENV=str(tmp_path / "none"))
    assert (empty.returncode, empty.stdout) == (1, f"setup: {tmp_path}/none needs setting up: no environment at "
                                                   f"{tmp_path}/none yet\n")  # fmt: skip
