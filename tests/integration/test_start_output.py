"""What `kvsidecar serve` prints at a start, as the README runs it: the daemon's own lines only (Mooncake's glog
notice and its "Local segment descriptor not found" E line, printed at every start, go to the debug log), while a
setup that fails still shows what Mooncake said."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar_testing.processes import free_port, stop_pid
from kvsidecar_testing.waiting import wait_until

pytestmark = pytest.mark.integration

KVSIDECAR = str(Path(sys.executable).with_name("kvsidecar"))
DAEMON_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) kvsidecar[.\w]*: ")


def serve_until_ready(tmp_path: Path, *flags: str) -> list[str]:
    """Start `kvsidecar serve` with its socket under tmp_path, wait for its ready and pre-fault lines, stop it."""
    log = tmp_path / "serve.log"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    with open(log, "wb") as out:
        proc = subprocess.Popen([KVSIDECAR, "serve", "--metrics-address", f"127.0.0.1:{free_port()}", *flags],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    try:

        def started() -> bool:
            assert proc.poll() is None, log.read_text()
            text = log.read_text()
            return " ready: " in text and "pre-faulted" in text

        wait_until(started, timeout=60, what="the ready and pre-fault lines", detail=log.read_text)
    finally:
        assert stop_pid(proc, timeout=30) == 0, log.read_text()
    return log.read_text().splitlines()


def test_a_start_prints_only_the_daemons_own_lines(tmp_path):
    lines = serve_until_ready(tmp_path)
    assert lines and all(DAEMON_LINE.match(line) for line in lines), "\n".join(lines)
    assert not [line for line in lines if "InitGoogleLogging" in line or "descriptor not found" in line]


def test_the_debug_log_says_what_mooncake_printed_and_that_it_is_expected(tmp_path):
    lines = serve_until_ready(tmp_path, "--log-level", "debug")
    expected = [line.split(": ", 2)[2] for line in lines if "Mooncake's client setup printed" in line]
    assert expected[0].startswith("WARNING: Logging before InitGoogleLogging()"), expected
    assert expected[1].endswith("] Local segment descriptor not found"), expected


def test_a_setup_that_fails_still_shows_what_mooncake_said(tmp_path):
    # A master's port that accepts connections and never answers: the daemon's wait for it passes, and Mooncake's
    # setup fails past its RPC timeout (1 s here).
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), MC_STORE_CLIENT_SETUP_RETRIES="1", MC_RPC_TIMEOUT_MS="1000")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        nobody = f"127.0.0.1:{silent.getsockname()[1]}"
        flags = ["--master", nobody, "--metrics-address", "127.0.0.1:0", "--master-timeout", "1"]
        out = subprocess.run([KVSIDECAR, "serve", *flags], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, out.stderr
    assert re.search(r"^E\d{4} .*\] Failed to create client", out.stderr, re.MULTILINE), out.stderr  # Mooncake's own
    assert "Mooncake's client setup failed; it also printed: WARNING: Logging before InitGoogleLogging()" in out.stderr
    assert f"cannot start: unavailable: Mooncake setup returned -1 (internal) for master {nobody}" in out.stderr
