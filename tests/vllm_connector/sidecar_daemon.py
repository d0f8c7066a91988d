"""A real kvsidecar daemon for these tests: `kvsidecar serve` from the main venv, embedded real mooncake_master."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0


def kvsidecar_bin() -> Path:
    """The daemon's console script from the main venv (vLLM's venv does not have the daemon)."""
    return Path(os.environ.get("KVSIDECAR_BIN", str(REPO / ".venv" / "bin" / "kvsidecar")))


class Daemon:
    """`kvsidecar serve` with an embedded mooncake_master, on a socket in a private temp dir; stopped by PID."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.socket = str(workdir / "kvsidecar.sock")
        self.log_path = workdir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """The gRPC target the connector's `socket` setting takes."""
        return f"unix://{self.socket}"

    def start(self) -> Daemon:
        binary = kvsidecar_bin()
        if not binary.exists():
            pytest.fail(f"no kvsidecar daemon at {binary}: run scripts/setup.sh, or set KVSIDECAR_BIN")
        args = [
            str(binary), "serve",
            "--socket", self.socket,
            "--metrics-address", "127.0.0.1:0",
            "--segment-size", "64MiB",
            "--session-ttl", "5",
        ]  # fmt: skip
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR", MC_STORE_CLIENT_SETUP_RETRIES="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsidecar exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket) and self.status(quiet=True).returncode == 0:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvsidecar not healthy after {READY_TIMEOUT_S} s:\n{self.log()}")

    def status(self, *, quiet: bool = False) -> subprocess.CompletedProcess[str]:
        """`kvsidecar status` against this daemon (exit 0: healthy)."""
        args = [str(kvsidecar_bin()), "status", "--socket", self.socket, "--quiet" if quiet else "--json"]
        return subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)

    def counters(self) -> dict[str, float]:
        """The daemon's Prometheus counters, as `kvsidecar status --json` prints them."""
        result = self.status()
        return dict(json.loads(result.stdout)["counters"])

    def remove_keys(self, keys: list[str]) -> None:
        """Remove values from the store behind the daemon's back (a Mooncake client of its own, in the daemon's
        venv): the way a store loses data to eviction or a failed node."""
        master = json.loads(self.status().stdout)["master_address"]
        script = (
            "import sys\n"
            "from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore\n"
            "settings = MooncakeSettings(local_hostname='127.0.0.1', master_server_addr=sys.argv[1], "
            "global_segment_size=0)\n"
            "store = MooncakeStore.connect(settings)\n"
            "codes = store.remove(sys.argv[2:])\n"
            "store.close()\n"
            "sys.exit(0 if all(c.name == 'OK' for c in codes) else f'remove: {codes}')\n"
        )
        python = kvsidecar_bin().parent / "python"
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR", MC_STORE_CLIENT_SETUP_RETRIES="1")
        subprocess.run([str(python), "-c", script, master, *keys], env=env, check=True, timeout=60, capture_output=True)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; always reaped."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
