"""The image the Dockerfile builds, built here and started as the manifests start it, checked from outside.

The CPU flavour is built by buildah on a Debian base made by debootstrap (image_build.py). The daemon then runs from
the image as the DaemonSet runs it: the image's entrypoint, command and user (10001), the socket directory a host
folder handed to 10001 (the init container's `install -d`) and mounted at the image's volume, in a network namespace
of its own (a pod's), where the image's fixed metrics port clashes with nothing on the machine. From outside: the
ready line, this checkout's `kvsidecar status` over the mounted socket, the metrics endpoint, the image's own
HEALTHCHECK, and a SIGTERM stop. scripts/test.sh runs this module beside the rest of the suite (it is mostly waiting
on the network and the disk). The CUDA flavour is not built here (deploy/README.md says what is checked of it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import image_build
import pytest

from kvsidecar import __version__

# The build is minutes (scripts/test.sh runs this module beside the suite): the timeout covers a cold one.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
# Attach a classic socket filter as the fence does (kvsidecar/fence/guard.py): exit 3 where the kernel refuses it.
ATTACH_PROBE = """
import ctypes, socket, struct
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
code = ctypes.create_string_buffer(bytes(8))  # one instruction: return 0
try:
    s.setsockopt(socket.SOL_SOCKET, 26, struct.pack("@HP", 1, ctypes.addressof(code)))
except PermissionError:
    raise SystemExit(3)
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Iterator[dict[str, Any]]:
    if os.environ.get("KVSIDECAR_SKIP_IMAGE") == "1" and not os.environ.get("CI"):
        pytest.skip("KVSIDECAR_SKIP_IMAGE=1")
    why = image_build.missing_tools()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"cannot build the image: {why} (scripts/test.sh installs buildah and debootstrap)")
        pytest.skip(f"cannot build the image: {why}")
    image_build.prune_stale()
    tag = "localhost/" + image_build.check_name()
    try:
        built = image_build.build("cpu", tag, tmp_path_factory.mktemp("image"))
        info = image_build.inspect(tag)
        yield {"tag": tag, **info}
    finally:
        image_build.remove_image(tag)
    layers = info["layers"]
    print(
        f"\nimage: {sum(layers) / 1e9:.2f} GB uncompressed ({layers[0] / 1e6:.0f} MB Debian base, "
        f"{sum(layers[1:]) / 1e9:.2f} GB kvsidecar); {image_build.phases(built.timings)}"
    )
    for step, seconds in built.steps:
        if seconds >= 1:
            print(f"  {seconds:6.1f} s  {step}")


class Running:
    """The daemon started from the image: `buildah run` in a network namespace of its own, and what it printed."""

    def __init__(self, image: dict[str, Any], socket_dir: Path) -> None:
        config = image["config"]
        (self.volume,) = config["Volumes"]
        self.socket_dir = socket_dir
        self.socket = socket_dir / "kvsidecar.sock"
        self.user = config["User"]
        self.container = subprocess.run(
            ["buildah", "from", "--pull=never", "--name", image_build.check_name(), image["tag"]],
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout.strip()  # fmt: skip
        probe = self.run_inside(["python", "-c", ATTACH_PROBE])
        assert probe.returncode in (0, 3), probe.stdout + probe.stderr
        self.granted = "NET_ADMIN" if probe.returncode == 3 else ""
        uid, gid = self.user.split(":")
        as_user: list[str] = []
        if self.granted:
            # This kernel refuses an unprivileged process a socket filter (mainline kernels do not): start as root
            # and drop to the image's user, keeping only CAP_NET_ADMIN, as `capabilities: add: [NET_ADMIN]` would.
            as_user = ["--user", "0:0", "--cap-add", "CAP_NET_ADMIN"]
            prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
            prefix += ["--inh-caps=+net_admin", "--ambient-caps=+net_admin", "--"]
        else:
            prefix = []
        command = [*prefix, *config["Entrypoint"], *config["Cmd"]]
        self.command = command
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
             "buildah", "run", "--isolation", "chroot", *as_user, "--volume", f"{socket_dir}:{self.volume}",
             self.container, "--", *command],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = ""
        self.pid = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines[-40:])

    def wait_ready(self) -> None:
        """Until the daemon prints its ready line; then its PID."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready = [line for line in self.lines if " ready: " in line]
            if ready:
                self.ready, self.pid = ready[0], self._daemon_pid()
                return
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"the daemon exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        raise AssertionError(f"no ready line within {START_TIMEOUT_S:.0f} s:\n{self.output()}")

    def _daemon_pid(self) -> int:
        """The daemon's PID, from the kernel's credentials of the socket's peer."""
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(self.socket))
            pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return int(pid)

    def run_inside(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        """A command in the container as the image's user (the host's network: a Unix socket needs none)."""
        return subprocess.run(
            ["buildah", "run", "--isolation", "chroot", "--volume", f"{self.socket_dir}:{self.volume}",
             self.container, "--", *argv],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    def stop(self) -> int | None:
        """SIGTERM to the daemon, as the kubelet sends it; the exit code `buildah run` passes on."""
        if self.proc.poll() is None and self.pid:
            os.kill(self.pid, signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
            return None

    def _kill(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait(10)

    def remove(self) -> None:
        if self.proc.poll() is None:
            self._kill()
        subprocess.run(["buildah", "rm", self.container], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def daemon(image, tmp_path_factory) -> Iterator[Running]:
    socket_dir = tmp_path_factory.mktemp("run")
    uid, gid = image["config"]["User"].split(":")
    os.chown(socket_dir, int(uid), int(gid))
    os.chmod(socket_dir, 0o750)
    running = Running(image, socket_dir)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()
        running.remove()


def test_the_image_is_the_cpu_flavour_run_as_10001(image):
    config = image["config"]
    assert config["Labels"]["io.kvsidecar.flavour"] == "cpu"
    assert config["Labels"]["org.opencontainers.image.version"] == __version__
    assert config["User"] == "10001:10001" and config["Entrypoint"] == ["kvsidecar"]
    assert config["Healthcheck"]["Test"][:3] == ["CMD", "kvsidecar", "status"], "docker format keeps the HEALTHCHECK"


def test_the_daemon_starts_from_the_image_as_its_user(daemon):
    assert f"kvsidecar {__version__} ready: grpc unix://{daemon.volume}/kvsidecar.sock" in daemon.ready
    assert "metrics http://0.0.0.0:9469/metrics" in daemon.ready and "(embedded)" in daemon.ready
    uids = [line.split()[1:] for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines()
            if line.startswith(("Uid:", "Gid:"))]  # fmt: skip
    assert uids == [["10001"] * 4] * 2, uids
    mode = daemon.socket.stat()
    assert stat.S_ISSOCK(mode.st_mode) and stat.S_IMODE(mode.st_mode) == 0o660, oct(mode.st_mode)
    assert (mode.st_uid, mode.st_gid) == (10001, 10001)
    if daemon.granted:
        print(f"\nthis kernel needs {daemon.granted} for the fence's socket filters: granted to the image's user")


def test_status_from_outside_over_the_mounted_socket(daemon):
    status = Path(sys.executable).with_name("kvsidecar")
    done = subprocess.run(
        [str(status), "status", "--json", "--socket", str(daemon.socket)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    info = json.loads(done.stdout)
    assert info["serving"] and info["store_healthy"] and info["daemon_version"] == __version__
    roles = {item["role"]: item["allowed"] for item in info["listeners"]}
    assert roles["mooncake-transfer"] == "nobody" and roles["mooncake-handshake"] == "nobody", roles


def test_metrics_endpoint_in_the_daemons_network(daemon):
    url = "http://127.0.0.1:9469/metrics"  # the image's own address (its CMD), in the daemon's network namespace
    fetch = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    done = subprocess.run(
        ["nsenter", f"--net=/proc/{daemon.pid}/ns/net", "--", sys.executable, "-c", fetch],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "kvsidecar_store_healthy 1.0" in done.stdout.splitlines()


def test_torch_in_the_image_is_the_cpu_build(daemon):
    done = daemon.run_inside(["python", "-c", "import importlib.metadata as m; print(m.version('torch'))"])
    assert done.stdout.strip().endswith("+cpu"), done.stdout + done.stderr


def test_the_images_healthcheck_passes(daemon, image):
    health = image["config"]["Healthcheck"]["Test"][1:]
    done = daemon.run_inside(health)
    assert done.returncode == 0, f"{shlex.join(health)}: {done.returncode}\n{done.stdout}{done.stderr}"


def test_sigterm_stops_the_daemon_cleanly(daemon):
    assert daemon.stop() == 0, daemon.output()
    # The lock that keeps a second daemon off the socket stays (removing it would race the next daemon's flock).
    left = sorted(p.name for p in daemon.socket_dir.iterdir())
    assert left == ["kvsidecar.sock.lock"], f"left in the socket directory: {left}"
