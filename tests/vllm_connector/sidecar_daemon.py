"""The daemon these tests run against: `kvsidecar_testing`'s, run by the main venv's interpreter.

vLLM's venv has only the client and the contract, so the daemon process runs from the main venv (scripts/setup.sh)
and only `kvsidecar_testing`'s processes, which need nothing but the standard library, are imported here from the
checkout (testing/).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
for _folder in (REPO, REPO / "testing"):  # kvsidecar (for its version) and kvsidecar_testing, from the checkout
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from kvsidecar_testing import processes  # noqa: E402
from kvsidecar_testing.mooncake_env import MooncakeEnv  # noqa: E402

__all__ = ["SidecarDaemon", "daemon_python"]

STATUS_TRIES = 3


def daemon_python() -> Path:
    """The interpreter with the daemon installed: the main venv's, or $KVSIDECAR_PYTHON."""
    return Path(os.environ.get("KVSIDECAR_PYTHON", str(REPO / ".venv" / "bin" / "python")))


class SidecarDaemon(processes.DaemonProcess):
    """`kvsidecar serve` with an embedded mooncake_master, on a socket in workdir, run by the main venv."""

    def __init__(self, workdir: Path, extra: Sequence[str] = (), *, segment_size: str = "64MiB") -> None:
        python = daemon_python()
        if not python.exists():
            pytest.fail(f"no kvsidecar daemon at {python}: run scripts/setup.sh, or set KVSIDECAR_PYTHON")
        super().__init__(
            workdir,
            session_ttl=5,
            segment_size=segment_size,
            local_buffer_size=None,
            log_level="info",
            python=python,
            extra=extra,
        )

    def status(self, *, quiet: bool = False) -> subprocess.CompletedProcess[str]:
        """`kvsidecar status` against this daemon (exit 0: healthy)."""
        # A generous answer deadline: two vLLM CPU ranks can keep both cores busy while the test asks.
        args = [self.python, "-m", "kvsidecar", "status", "--socket", self.socket, "--timeout", "30"]
        args.append("--quiet" if quiet else "--json")
        return subprocess.run(args, capture_output=True, text=True, timeout=90, check=False)

    def counters(self) -> dict[str, float]:
        """The daemon's Prometheus counters, as `kvsidecar status --json` prints them."""
        # A new connection is what `status` makes each time; with two vLLM CPU ranks, the test and other work on two
        # cores, one connection attempt was seen to time out before the daemon's SETTINGS frame (grpc's 20 s connect
        # timeout) while the daemon served its sessions. Asked again, not forever: a daemon that never answers fails.
        tries = []
        for _ in range(STATUS_TRIES):
            out = self.status()
            tries.append(f"({out.returncode}) {out.stdout[-500:]} {out.stderr[-1000:]}")
            if out.stdout.startswith("{"):  # --json printed an answer (exit 0 or 1); else no daemon answered
                return dict(json.loads(out.stdout)["counters"])
        raise AssertionError(f"kvsidecar status answered no counters in {STATUS_TRIES} tries: {tries}")

    def remove_keys(self, keys: list[str]) -> None:
        """Remove values from the store behind the daemon's back (a Mooncake client of its own, in the daemon's
        venv): the way a store loses data to eviction or a failed node."""
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
        master = json.loads(self.status().stdout)["master_address"]
        # Behind the daemon's loopback guard its master is reachable only from the daemon's network namespace.
        ns = f"/proc/{self.pid}/ns/net"
        enter = ["nsenter", f"--net={ns}"] if os.readlink(ns) != os.readlink("/proc/self/ns/net") else []
        with MooncakeEnv(self.workdir) as env:
            subprocess.run(
                [*enter, self.python, "-c", script, master, *keys], env=env.child_env(native=False), check=True,
                timeout=60, capture_output=True,
            )  # fmt: skip


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarDaemon]:
    """One real daemon (embedded real mooncake_master) for the run; tests keep apart by their own cache_prefix."""
    proc = SidecarDaemon(tmp_path_factory.mktemp("kvsidecar")).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def cache_prefix() -> str:
    """A cache prefix (tenant namespace) no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"
