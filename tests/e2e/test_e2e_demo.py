"""`kvsidecar demo` as a newcomer runs it: a real process, against a running daemon or one it starts itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar_testing.processes import DaemonProcess

pytestmark = pytest.mark.integration

DEMO_TIMEOUT_S = 120


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", "demo", *args],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def open_sessions(daemon: DaemonProcess) -> float:
    with urllib.request.urlopen(daemon.metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "kvsidecar_sessions"
    )


def test_demo_against_a_running_daemon_with_tenants(mooncake_master, tmp_path):
    """A daemon with a tenants file grants the demo's uid a prefix: the demo runs under it when told to."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.team-a]\nuids = [{os.getuid()}]\nprefixes = ["team-a/*"]\n')
    daemon = DaemonProcess(tmp_path, master=mooncake_master.address, extra=("--tenants", str(tenants))).start()
    try:
        refused = demo("--socket", daemon.socket)  # its own random prefix: not the tenant's
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "the daemon refused the demo's session under cache prefix 'kvsidecar-demo-" in refused.stdout
        assert "--cache-prefix" in refused.stdout.splitlines()[-1]
        done = demo("--socket", daemon.socket, "--cache-prefix", "team-a/demo")
        assert done.returncode == 0, done.stdout + done.stderr
        out = done.stdout
        assert f"daemon: unix://{daemon.socket}" in out and "started one" not in out
        assert "cold pass: lookup hit 0 of 200 tokens" in out
        assert "warm pass: cache cleared; lookup hit 192 of 200 tokens" in out
        assert re.findall(r"rank (\d): saved 24 blocks .* 12 replicated ones left to the other rank\n", out) == [
            "0",
            "1",
        ]
        loaded = (
            r"rank (\d): loaded 15 blocks \(229.5 KiB: 12 mla, 2 sliding_window, 1 mamba\) .* 0 failed, 0 mismatched"
        )
        assert re.findall(loaded, out) == ["0", "1"]
        # Why 15 blocks are more bytes than 24: what a block of each group holds, as the daemon counts it.
        assert "blocks differ by group (mla 18.0 KiB, sliding_window 4.0 KiB, mamba 5.5 KiB)" in out
        assert "OK: every rank got its own bytes back, 0 mismatches" in out
        assert len(out.splitlines()) <= 12, out  # a few lines per pass
        assert open_sessions(daemon) == 0  # the demo closed every session it opened
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_demo_starts_and_stops_its_own_daemon_when_none_answers(tmp_path):
    done = demo("--socket", str(tmp_path / "nobody-listens.sock"), "--tp", "4", "--tokens", "100")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    started = re.search(r"started one for this demo \(pid (\d+)", out)
    assert started, out
    assert "daemon: stopped the one started for this demo (exit 0)" in out
    assert re.findall(r"rank (\d): loaded 9 blocks .* 0 failed, 0 mismatched", out) == ["0", "1", "2", "3"]
    assert "0 mismatches" in out
    with pytest.raises(ProcessLookupError):
        os.kill(int(started.group(1)), 0)  # reaped and gone: nothing left running
