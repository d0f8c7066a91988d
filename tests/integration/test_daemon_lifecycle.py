"""The daemon's life: the no-flags embedded default, a master that dies and comes back, what it exports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.metric_names import metric_names_in_deploy, sample_names
from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_testing.processes import DaemonProcess, free_port, stop_pid
from kvsidecar_testing.waiting import wait_until
from support.rawrank import RawRank, group, open_request

pytestmark = pytest.mark.integration

H = [bytes([i]) * 32 for i in range(1, 9)]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_ready_line(proc: subprocess.Popen[bytes], log) -> None:
    """Until the daemon logs its ready line; it must not exit meanwhile."""

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        return "ready:" in log.read_text()

    wait_until(ready, timeout=60, what="the daemon's ready line", detail=log.read_text)


def test_no_flags_starts_an_embedded_master_and_stops_it(tmp_path):
    """`kvsidecar serve` as the README runs it (only the paths moved into a temp dir, the port off the default)."""
    sock = tmp_path / "kvsidecar.sock"
    port = free_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar", "serve", "--metrics-address", f"127.0.0.1:{port}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        default_sock = tmp_path / "kvsidecar" / "kvsidecar.sock"
        wait_ready_line(proc, log)
        ready = next(line for line in log.read_text().splitlines() if "ready:" in line)
        assert f"grpc unix://{default_sock}" in ready
        assert f"metrics http://127.0.0.1:{port}/metrics" in ready
        assert re.search(r"mooncake master 127\.0\.0\.1:\d+ \(embedded\)", ready)
        status = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "status"], capture_output=True, text=True, env=env, timeout=30
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert "store: healthy" in status.stdout
        masters = children(proc.pid)
        assert masters, "the embedded mooncake_master should be the daemon's child"
        assert not sock.exists()
    finally:
        code = stop_pid(proc, timeout=30)
    assert code == 0, log.read_text()
    wait_until(
        lambda: not any(alive(pid) for pid in masters), timeout=30, what="the embedded master gone with the daemon"
    )
    assert not default_sock.exists()


def test_master_killed_and_restarted(tmp_path):
    master = EmbeddedMaster(rpc_port=free_port(), metrics_port=free_port()).start()
    daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=master.address).start()
    rank = RawRank(daemon.target, open_request([group("mla", 16), group("mamba", 16)], model="org/Restart"), 16, 1024)
    try:
        rank.register()
        for g in range(2):
            for b in range(4):
                rank.fill_block(g, b, bytes([10 * g + b + 1]) * 1024)
        assert rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64).written == 8
        hit = rank.lookup(H[:4], 65)
        assert hit.hit_tokens == 64

        with rank.kept_alive():  # the rank waits with the test below; an engine's client keeps its lease meanwhile
            os.kill(master.pid, 9)
            started = time.monotonic()
            miss = rank.lookup(H[:4], 65)
            assert (miss.hit_tokens, miss.degraded) == (0, True)
            save = rank.save(H[:4] + H[4:6], [[0, 1, 2, 3, 4, 5]] * 2, 96)
            assert save.written == 0 and save.failed > 0
            load = rank.load(H[:4], [[8, 9, 10, 11], [12, 13, 14, 15]], hit)
            assert load.loaded == 0 and len(load.failures) == 5
            assert time.monotonic() - started < 30, "nothing may hang while the master is down"

            master.restart()
            wait_until(
                lambda: subprocess.run(
                    [sys.executable, "-m", "kvsidecar", "status", "--socket", daemon.socket, "--quiet"], timeout=30
                ).returncode
                == 0,
                timeout=30, what="kvsidecar status healthy again", detail=lambda: daemon.log()[-3000:],
            )  # fmt: skip
            # The restarted master kept nothing: a miss, then the rank's next save stores everything again.
            assert rank.lookup(H[:4], 65).hit_tokens == 0
            saved = []

            def stored_everything() -> bool:
                saved.append(again := rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64))
                return again.written + again.skipped == 8

            # -200 until the daemon's segment is mounted again
            wait_until(stored_everything, timeout=20, what="a save stores all 8 blocks", detail=lambda: str(saved[-1]))
            hit = rank.lookup(H[:4], 65)
            assert hit.hit_tokens == 64
            assert not rank.load(H[:4], [[8, 9, 10, 11], [12, 13, 14, 15]], hit).failures
            assert rank.block(0, 9) == bytes([2]) * 1024
            assert rank.block(1, 15) == bytes([14]) * 1024
    finally:
        rank.close()
        assert daemon.stop() == 0, daemon.log()[-3000:]
        master.stop()


def test_every_metric_the_deploy_tree_uses_is_exported(mooncake_master, tmp_path):
    # With every optional part on that exports metrics of its own (the KV-event publisher).
    events = f"ipc://{tmp_path}/events"
    daemon = DaemonProcess(tmp_path, master=mooncake_master.address, extra=("--kv-events-endpoint", events)).start()
    try:
        body = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    finally:
        assert daemon.stop() == 0
    exported = sample_names(text_string_to_metric_families(body))
    used = metric_names_in_deploy()
    assert used, "the deploy tree uses no metric?"
    assert used <= exported, sorted(used - exported)


def test_scheduler_sessions_show_in_the_sessions_gauge(mooncake_master, tmp_path):
    daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=mooncake_master.address).start()
    sched = RawRank(daemon.target, open_request([group("mla", 16)], role=pb.ROLE_SCHEDULER))
    try:
        body = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
        assert 'kvsidecar_sessions{role="scheduler"} 1.0' in body
    finally:
        sched.close()
        assert daemon.stop() == 0


def test_a_daemon_killed_outright_takes_its_embedded_master_along(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar", "serve", "--socket", str(tmp_path / "s.sock"),
             "--metrics-address", f"127.0.0.1:{port}", "--segment-size", "64MiB"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_ready_line(proc, log)
        masters = children(proc.pid)
        assert masters
    finally:
        proc.kill()
        proc.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in masters), timeout=10, what="an orphaned mooncake_master gone")


def test_the_embedded_master_is_restarted_when_it_dies(tmp_path):
    port = free_port()
    sock = tmp_path / "s.sock"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar", "serve", "--socket", str(sock), "--session-ttl", "30",
             "--metrics-address", f"127.0.0.1:{port}", "--segment-size", "64MiB", "--allow-shm-names"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    rank = None
    try:
        wait_ready_line(proc, log)
        (first,) = children(proc.pid)
        rank = RawRank(f"unix://{sock}", open_request([group("mla", 16)], model="org/Supervised"), 4, 1024)
        rank.register()
        with rank.kept_alive():  # the rank waits with the test, as an engine's client would, keeping its lease
            os.kill(first, 9)
            tail = lambda: log.read_text()[-3000:]  # noqa: E731
            wait_until(lambda: "restarted as PID" in log.read_text(), timeout=30, what="master restart", detail=tail)
            assert first not in children(proc.pid) and children(proc.pid)
            # The store reconnects by itself; the next saves land in the new master.
            rank.fill_block(0, 0, b"m" * 1024)
            wait_until(lambda: rank.save(H[:1], [[0]], 16).written == 1, timeout=30, what="a save", detail=tail)
            assert rank.lookup(H[:1], 17).hit_tokens == 16
    finally:
        if rank is not None:
            rank.close()
        assert stop_pid(proc, timeout=30) == 0, log.read_text()[-3000:]


def test_the_daemon_tells_systemd_when_it_is_ready_and_when_it_stops(mooncake_master, tmp_path):
    import socket

    notify_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(30)
    daemon = DaemonProcess(
        tmp_path, allow_shm_names=True, master=mooncake_master.address, env={"NOTIFY_SOCKET": str(notify_path)}
    )
    try:
        daemon.start()
        ready = listener.recv(4096).decode()
        assert ready.startswith("READY=1\nSTATUS=serving on unix://"), ready
        assert daemon.serving()  # READY=1 came once the socket answered
    finally:
        assert daemon.stop() == 0
    assert listener.recv(4096).decode() == "STOPPING=1"
    listener.close()
