"""The daemon these tests run against: `kvsidecar.testing`'s, run by the main venv's interpreter.

vLLM's venv has only the client and the contract, so the daemon process runs from the main venv (scripts/setup.sh)
and only `kvsidecar.testing`, which needs nothing but the standard library, is imported here from the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvsidecar.testing.mooncake_env import MooncakeEnv  # noqa: E402
from kvsidecar.testing.processes import Daemon  # noqa: E402

__all__ = ["Daemon", "counters", "daemon_python", "remove_keys", "start_daemon"]


def daemon_python() -> Path:
    """The interpreter with the daemon installed: the main venv's, or $KVSIDECAR_PYTHON."""
    return Path(os.environ.get("KVSIDECAR_PYTHON", str(REPO / ".venv" / "bin" / "python")))


def start_daemon(workdir: Path) -> Daemon:
    """`kvsidecar serve` with an embedded mooncake_master, on a socket in workdir."""
    python = daemon_python()
    if not python.exists():
        pytest.fail(f"no kvsidecar daemon at {python}: run scripts/setup.sh, or set KVSIDECAR_PYTHON")
    return Daemon(workdir, session_ttl=5, local_buffer_size=None, log_level="info", python=python).start()


def _status(daemon: Daemon) -> dict:
    result = subprocess.run(
        [daemon.python, "-m", "kvsidecar", "status", "--socket", daemon.socket, "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return dict(json.loads(result.stdout))


def counters(daemon: Daemon) -> dict[str, float]:
    """The daemon's Prometheus counters, as `kvsidecar status --json` prints them."""
    return dict(_status(daemon)["counters"])


def remove_keys(daemon: Daemon, keys: list[str]) -> None:
    """Remove values from the store behind the daemon's back (a Mooncake client of its own, in the daemon's venv):
    the way a store loses data to eviction or a failed node."""
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
    master = _status(daemon)["master_address"]
    with MooncakeEnv(daemon.workdir) as env:
        subprocess.run(
            [daemon.python, "-c", script, master, *keys], env=env.child_env(native=False), check=True, timeout=60,
            capture_output=True,
        )  # fmt: skip
