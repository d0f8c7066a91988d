"""A start as an operator meets it: one daemon per socket however many are started at once, a master that is not
there fails the start within --master-timeout (or is waited for), and SIGTERM ends a start at any point."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient
from kvsidecar_testing.processes import free_port, stop_pid
from kvsidecar_testing.waiting import wait_until

pytestmark = pytest.mark.integration

KVSIDECAR = str(Path(sys.executable).with_name("kvsidecar"))
DAEMONS = 4


def serve(log: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [KVSIDECAR, "serve", "--metrics-address", "127.0.0.1:0", "--segment-size", "16MiB", *flags],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def test_of_daemons_started_together_on_one_socket_exactly_one_serves(tmp_path, mooncake_master):
    sock = tmp_path / "k.sock"
    logs = [tmp_path / f"serve{i}.log" for i in range(DAEMONS)]
    procs = [serve(log, "--socket", str(sock), "--master", mooncake_master.address) for log in logs]
    try:

        def ready() -> list[int]:
            return [i for i, log in enumerate(logs) if " ready: " in log.read_text()]

        def settled() -> bool:
            return len(ready()) > 1 or (len(ready()) == 1 and sum(p.poll() is not None for p in procs) == DAEMONS - 1)

        wait_until(settled, timeout=90, what="one daemon ready, the others gone", detail=lambda: logs[0].read_text())
        (winner,) = ready()
        for i, proc in enumerate(procs):
            if i == winner:
                assert proc.poll() is None
                continue
            # The existing refusal, in one line, before anything was started.
            said = logs[i].read_text()
            assert proc.returncode == 1 and said.count("\n") == 1, said
            assert said.endswith(
                f" ERROR kvsidecar: cannot start: another daemon is serving on {sock} (PID {procs[winner].pid}, which "
                f"holds {sock}.lock)\n"
            ), said
        # gRPC, the side socket and the data socket all reach the one daemon: a session opened over gRPC is known to
        # the data socket that carries its lookups.
        client = SidecarClient.connect(
            f"unix://{sock}", model="org/OneDaemon", layout=EngineLayout(), num_kv_heads=1, hash_block_size=16,
            groups=[GroupSpec("full_attention", 16)], role="scheduler",
        )  # fmt: skip
        try:
            assert client.lookup([bytes(32)], 17).hit_tokens == 0
        finally:
            client.close()
    finally:
        for proc in procs:
            stop_pid(proc, timeout=30)
    # The one that served removed its sockets at its stop; the lock file stays for the next daemon.
    assert sorted(p.name for p in tmp_path.glob("k.sock*")) == ["k.sock.lock"]


def _no_retries_env() -> dict[str, str]:
    """The environment without the tests' own MC_STORE_CLIENT_SETUP_RETRIES: the daemon's start as it ships."""
    return {k: v for k, v in os.environ.items() if k != "MC_STORE_CLIENT_SETUP_RETRIES"}


def test_a_master_that_is_not_there_fails_the_start_within_its_timeout(tmp_path):
    nobody = f"127.0.0.1:{free_port()}"
    out = subprocess.run(
        [KVSIDECAR, "serve", "--socket", str(tmp_path / "k.sock"), "--metrics-address", "127.0.0.1:0", "--master",
         nobody, "--master-timeout", "1"],
        capture_output=True, text=True, env=_no_retries_env(), timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert out.stderr.endswith(
        f" ERROR kvsidecar: cannot start: no Mooncake master answers at {nobody} (Connection refused) within 1 s: is a "
        f"mooncake_master listening at {nobody}? (--master-timeout waits longer)\n"
    ), out.stderr
    assert "Failed to create client" not in out.stderr  # Mooncake's setup, and its 20 tries, never ran


def test_a_start_waits_for_a_master_that_comes_late_and_sigterm_ends_a_waiting_start(tmp_path):
    port = free_port()
    late = tmp_path / "late.log"
    waiting = serve(late, "--socket", str(tmp_path / "late.sock"), "--master", f"127.0.0.1:{port}",
                    "--master-timeout", "120", env=_no_retries_env())  # fmt: skip
    stopped = tmp_path / "stopped.log"
    to_stop = serve(stopped, "--socket", str(tmp_path / "stopped.sock"), "--master", f"127.0.0.1:{free_port()}",
                    "--master-timeout", "120")  # fmt: skip
    master = None
    try:
        for log in (late, stopped):
            wait_until(lambda log=log: "waiting up to 120 s for the Mooncake master" in log.read_text(), timeout=60,
                       what="the daemon waiting for its master", detail=log.read_text)  # fmt: skip
        to_stop.send_signal(signal.SIGTERM)
        assert to_stop.wait(60) == 0, stopped.read_text()
        assert stopped.read_text().endswith(" INFO kvsidecar: kvsidecar stopping: SIGTERM while starting\n")
        master = EmbeddedMaster(rpc_port=port, metrics_port=free_port()).start()
        wait_until(lambda: " ready: " in late.read_text(), timeout=60, what="ready", detail=late.read_text)
        assert waiting.poll() is None
    finally:
        stop_pid(to_stop)
        assert stop_pid(waiting, timeout=30) == 0, late.read_text()
        if master is not None:
            master.stop()


def test_sigterm_ends_a_start_even_inside_mooncakes_setup(tmp_path):
    """A master that accepts connections and never answers: Mooncake's setup waits on it holding the GIL, so no
    Python signal handler can run; SIGTERM still ends the process at once, leaving no socket behind."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    log = tmp_path / "serve.log"
    proc = serve(log, "--socket", str(tmp_path / "k.sock"), "--master", f"127.0.0.1:{silent.getsockname()[1]}",
                 "--master-timeout", "120", env=_no_retries_env())  # fmt: skip
    try:
        # The daemon's own probe is the first connection; Mooncake's setup makes the next.
        wait_until(lambda: len(accepted) >= 2, timeout=60, what="Mooncake's setup connecting", detail=log.read_text)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM, log.read_text()
    finally:
        stop_pid(proc)
        silent.close()
        for conn in accepted:
            conn.close()
    assert sorted(p.name for p in tmp_path.glob("k.sock*")) == ["k.sock.lock"], log.read_text()
