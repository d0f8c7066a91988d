"""The embedded mooncake_master: a child process on loopback that this daemon starts, watches and stops."""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from kvsidecar.errors import MasterError, NativeLibraryError
from kvsidecar.store.native import ensure_native_libs

__all__ = [
    "DEFAULT_CLIENT_TTL_S",
    "DEFAULT_EVICTION_HIGH_WATERMARK_RATIO",
    "DEFAULT_KV_LEASE_TTL_MS",
    "DEFAULT_MAX_SOFT_PIN_MS",
    "DEFAULT_READY_TIMEOUT_S",
    "DEFAULT_STOP_TIMEOUT_S",
    "LOOPBACK",
    "EmbeddedMaster",
    "MasterError",
    "find_master_binary",
    "free_ports",
]

LOOPBACK = "127.0.0.1"
DEFAULT_KV_LEASE_TTL_MS = 10_000
DEFAULT_EVICTION_HIGH_WATERMARK_RATIO = 0.9
DEFAULT_CLIENT_TTL_S = 10
DEFAULT_MAX_SOFT_PIN_MS = 86_400_000  # Mooncake's own default --max_kv_soft_pin_ttl (24 h)
DEFAULT_KV_SOFT_PIN_TTL_MS = 1_800_000  # Mooncake's own default --default_kv_soft_pin_ttl (30 min)
DEFAULT_READY_TIMEOUT_S = 15.0
DEFAULT_STOP_TIMEOUT_S = 5.0  # a graceful SIGTERM stop takes 1-3 s
_TAIL_LINES = 40
_POLL_INTERVAL_S = 0.05
# Picked ports can be taken by someone else before the child binds them; try fresh ones a few times.
_START_ATTEMPTS = 3

log = logging.getLogger(__name__)


def find_master_binary() -> Path:
    """mooncake_master next to the running interpreter (a virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mooncake_master")
    if found is None:
        raise MasterError(f"mooncake_master is neither in {beside.parent} nor on PATH; install Mooncake")
    return Path(found)


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """count distinct ports the kernel says are free on host right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class _OutputTail:
    """Drains the child's output so it can never block on a full pipe, keeping the last lines."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._drain, args=(stream,), name="mooncake-master-output", daemon=True)
        self._thread.start()

    def _drain(self, stream: IO[bytes]) -> None:
        with stream:
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip()
                log.debug("mooncake_master: %s", line)
                with self._lock:
                    self._lines.append(line)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _file_tail(path: Path) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return f.read().decode("utf-8", "replace").splitlines()[-_TAIL_LINES:]
    except OSError:
        return []


# Run in a fresh interpreter between the daemon and mooncake_master, so that nothing runs in the daemon's forked child
# before exec: a preexec_fn would, and in a process with gRPC and Mooncake threads that child runs gRPC's fork
# handlers (they wrote into the master's output) and can deadlock on a lock another thread held at the fork (dlopen's,
# malloc's). It asks the kernel for SIGTERM when the thread that started it exits (Linux's PR_SET_PDEATHSIG, kept
# across exec; elsewhere the daemon's own stop() is the only way the master ends), gives up if that thread's process
# is already gone, then becomes the master. An exec that fails is written to the pipe, closed on a successful exec.
_EXEC_WITH_PARENT = """
import ctypes, os, signal, sys
report, parent, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit(0)
os.set_inheritable(report, False)
try:
    os.execv(argv[0], argv)
except OSError as exc:
    os.write(report, str(exc).encode())
    sys.exit(127)
"""


def _exec_failure(fd: int, timeout: float) -> str:
    """What the launcher wrote to its report pipe before it closed: empty when the master's exec succeeded."""
    chunks = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


class EmbeddedMaster:
    """A mooncake_master child bound to loopback, started on free ports unless ports are given."""

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        rpc_port: int = 0,
        metrics_port: int = 0,
        lease_ttl_ms: int = DEFAULT_KV_LEASE_TTL_MS,
        eviction_high_watermark_ratio: float = DEFAULT_EVICTION_HIGH_WATERMARK_RATIO,
        client_ttl_s: int = DEFAULT_CLIENT_TTL_S,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: tuple[str, ...] = (),
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        max_soft_pin_ms: int = DEFAULT_MAX_SOFT_PIN_MS,
    ) -> None:
        """Describe the master; nothing starts before start().

        lease_ttl_ms is Mooncake's default_kv_lease_ttl; max_soft_pin_ms its max_kv_soft_pin_ttl (the longest
        retention a put may ask); env is added to this process's environment for the child; log_path None keeps only
        the child's last output lines in memory.
        """
        if not 0 < eviction_high_watermark_ratio <= 1:
            raise ValueError(f"eviction_high_watermark_ratio must be in (0, 1], got {eviction_high_watermark_ratio}")
        if max_soft_pin_ms <= 0:
            raise ValueError(f"max_soft_pin_ms must be positive, got {max_soft_pin_ms}")
        if lease_ttl_ms <= 0 or client_ttl_s <= 0:
            raise ValueError(f"lease_ttl_ms and client_ttl_s must be positive, got {lease_ttl_ms}, {client_ttl_s}")
        for name, port in (("rpc_port", rpc_port), ("metrics_port", metrics_port)):
            if not 0 <= port < 65536:
                raise ValueError(f"{name} must be a TCP port or 0 (pick a free one), got {port}")
        self._binary = None if binary is None else Path(binary)
        # Requested ports (0: pick a free one at each start) and the ports in use.
        self._wanted_ports = (rpc_port, metrics_port)
        self._rpc_port = rpc_port
        self._metrics_port = metrics_port
        self._flags = [
            f"--default_kv_lease_ttl={lease_ttl_ms}",
            f"--eviction_high_watermark_ratio={eviction_high_watermark_ratio}",
            f"--client_ttl={client_ttl_s}",
            f"--max_kv_soft_pin_ttl={max_soft_pin_ms}",
            # Mooncake refuses to start with a default longer than the maximum; every pinned put names its time.
            f"--default_kv_soft_pin_ttl={min(DEFAULT_KV_SOFT_PIN_TTL_MS, max_soft_pin_ms)}",
            *extra_args,
        ]
        self._env = dict(env or {})
        self._log_path = None if log_path is None else Path(log_path)
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._output: _OutputTail | None = None
        self._log_file: IO[bytes] | None = None

    # Where it is.

    @property
    def rpc_port(self) -> int:
        """The RPC port clients connect to (known once started, or when given)."""
        if self._rpc_port == 0:
            raise MasterError("the embedded master has not been started, so it has no port yet")
        return self._rpc_port

    @property
    def metrics_port(self) -> int:
        """The admin HTTP port (/health, /metrics)."""
        if self._metrics_port == 0:
            raise MasterError("the embedded master has not been started, so it has no port yet")
        return self._metrics_port

    @property
    def address(self) -> str:
        """host:port for a client's master_server_addr."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        """Base URL of the admin HTTP server."""
        return f"http://{LOOPBACK}:{self.metrics_port}"

    @property
    def pid(self) -> int | None:
        """The child's PID (the server itself: the console script execs it), or None before start."""
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        """Whether the child process is running."""
        return self._proc is not None and self._proc.poll() is None

    def output_tail(self) -> list[str]:
        """The last lines the child wrote to stdout/stderr."""
        if self._log_path is not None:
            return _file_tail(self._log_path)
        return [] if self._output is None else self._output.lines()

    # Lifecycle.

    def start(self) -> EmbeddedMaster:
        """Spawn the master and wait until /health answers; raise MasterError with its output if it does not."""
        if self.alive():
            raise MasterError(f"the embedded master is already running as PID {self.pid}")
        binary = self._binary if self._binary is not None else find_master_binary()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise MasterError(f"mooncake_master binary {binary} does not exist or is not executable")
        try:
            env = {**os.environ, **ensure_native_libs(), **self._env}
        except NativeLibraryError as exc:
            raise MasterError(str(exc)) from exc
        attempts = _START_ATTEMPTS if 0 in self._wanted_ports else 1
        for attempt in range(1, attempts + 1):
            picked = free_ports(2)
            self._rpc_port = self._wanted_ports[0] or picked[0]
            self._metrics_port = self._wanted_ports[1] or picked[1]
            self._spawn(binary, env)
            try:
                self._wait_ready()
                # A program that exits without stop() (an uncaught exception) must not leave the master behind:
                # it runs in its own session, so nothing else would stop it. Undone by stop().
                atexit.register(self._stop_at_exit, os.getpid())
                return self
            except MasterError:
                exited = not self.alive()
                self._terminate(DEFAULT_STOP_TIMEOUT_S)
                # A child that exited at once with picked ports most likely lost a port race: pick again.
                if not (exited and attempt < attempts):
                    raise
                log.warning("mooncake_master exited at start (attempt %d); retrying on other ports", attempt)
        raise AssertionError("unreachable")  # the loop either returns or raises

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after timeout seconds; reap the child and return its exit status."""
        return self._terminate(timeout)

    def restart(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> EmbeddedMaster:
        """Stop (if running) and start again on the same ports, so connected clients find it again."""
        self._terminate(timeout)
        if self._rpc_port and self._metrics_port:
            self._wanted_ports = (self._rpc_port, self._metrics_port)
        return self.start()

    def __enter__(self) -> EmbeddedMaster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # Helpers.

    def _command(self, binary: Path) -> list[str]:
        return [
            str(binary),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self._rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self._metrics_port}",
            "--enable_metric_reporting=false",  # else a large log line every 10 s
            "--minloglevel=1",
            *self._flags,
        ]

    def _spawn(self, binary: Path, env: dict[str, str]) -> None:
        output: int | IO[bytes]
        report, report_w = os.pipe()
        try:
            if self._log_path is not None:
                self._log_file = self._log_path.open("ab")
                output = self._log_file
            else:
                output = subprocess.PIPE
            launcher = [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PARENT, str(report_w), str(os.getpid())]
            self._proc = subprocess.Popen(
                [*launcher, *self._command(binary)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(report_w,),
                # Its own session: a Ctrl-C meant for the daemon must not stop the master before the daemon has
                # closed its store (closing with the master gone takes 10-15 s); the daemon stops it last. A daemon
                # killed outright still takes it along (the launcher's parent-death signal).
                start_new_session=True,
            )
        except OSError as exc:
            os.close(report)
            self._terminate(0)
            raise MasterError(f"cannot run {binary}: {exc}") from exc
        finally:
            os.close(report_w)
        try:
            failure = _exec_failure(report, self._ready_timeout_s)
        finally:
            os.close(report)
        if self._proc.stdout is not None:
            self._output = _OutputTail(self._proc.stdout)
        if failure:
            self._terminate(DEFAULT_STOP_TIMEOUT_S)
            raise MasterError(f"cannot run {binary}: {failure}")
        log.info("started mooncake_master PID %d on %s", self._proc.pid, self.address)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        # No proxy: an http_proxy in the environment must not intercept a loopback health probe.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + self._ready_timeout_s
        last_problem = "no answer yet"
        while time.monotonic() < deadline:
            status = self._proc.poll()
            if status is not None:
                if self._output is not None:
                    self._output.join(timeout=1.0)  # let the drain thread catch the child's last words
                raise MasterError(f"mooncake_master exited with status {status} during start", self.output_tail())
            try:
                with opener.open(self.metrics_url + "/health", timeout=1.0) as response:
                    health = json.loads(response.read())
                if health.get("status") == "ok" and health.get("service_ready", True) and self._rpc_accepts():
                    return
                last_problem = f"/health said {health}"
            except (OSError, ValueError) as exc:  # URLError and connection errors are OSErrors
                last_problem = str(exc)
            time.sleep(_POLL_INTERVAL_S)
        raise MasterError(
            f"mooncake_master PID {self._proc.pid} not ready within {self._ready_timeout_s} s "
            f"at {self.metrics_url}/health: {last_problem}",
            self.output_tail(),
        )

    def _rpc_accepts(self) -> bool:
        try:
            with socket.create_connection((LOOPBACK, self._rpc_port), timeout=1.0):
                return True
        except OSError:
            return False

    def _stop_at_exit(self, owner_pid: int) -> None:
        # A forked child inherits atexit handlers; only the process that started the master may stop it.
        if os.getpid() == owner_pid:
            self._terminate(DEFAULT_STOP_TIMEOUT_S)

    def _terminate(self, timeout: float) -> int | None:
        atexit.unregister(self._stop_at_exit)
        proc, self._proc = self._proc, None
        status = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("mooncake_master PID %d ignored SIGTERM for %.1f s; killing it", proc.pid, timeout)
                    proc.kill()
            status = proc.wait()
            log.info("mooncake_master PID %d exited with status %s", proc.pid, status)
        if self._output is not None:
            self._output.join(timeout=1.0)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return status
