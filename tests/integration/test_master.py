"""EmbeddedMaster starts a real mooncake_master on loopback, reports it ready, and stops it by PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from kvsidecar.daemon.master import EmbeddedMaster, find_master_binary, free_ports
from kvsidecar.errors import MasterError, NativeLibraryError
from kvsidecar.store.native import ensure_native_libs, native_dir, preload_from

pytestmark = pytest.mark.integration


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def health(master: EmbeddedMaster) -> dict[str, object]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(master.metrics_url + "/health", timeout=2) as response:
        return json.loads(response.read())


def script(tmp_path, name: str, body: str) -> str:
    """An executable Python script standing in for mooncake_master."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


def test_start_serves_health_on_loopback_and_stop_ends_the_process(tmp_path):
    log_path = tmp_path / "master.log"
    rpc_port = free_ports(1)[0]
    master = EmbeddedMaster(rpc_port=rpc_port, log_path=log_path, lease_ttl_ms=2000, client_ttl_s=5)
    assert master.address == f"127.0.0.1:{rpc_port}"  # known before start when given
    with pytest.raises(MasterError, match="not been started"):
        _ = EmbeddedMaster().address
    master.start()
    pid = master.pid
    try:
        assert pid is not None and master.alive() and pid_alive(pid)
        assert master.address == f"127.0.0.1:{rpc_port}"
        assert master.rpc_port != master.metrics_port
        assert health(master)["status"] == "ok"
        with socket.create_connection(("127.0.0.1", master.rpc_port), timeout=2):
            pass
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--rpc_address=127.0.0.1" in cmdline and b"--metrics_host=127.0.0.1" in cmdline
        assert b"--default_kv_lease_ttl=2000" in cmdline and b"--client_ttl=5" in cmdline
    finally:
        status = master.stop()
    assert status == 0
    assert not master.alive() and master.pid is None
    assert not pid_alive(pid)
    assert master.stop() is None  # idempotent
    assert log_path.exists()


def test_two_masters_get_distinct_free_ports_and_the_context_manager_stops_both():
    with EmbeddedMaster() as a, EmbeddedMaster() as b:
        pids = [a.pid, b.pid]
        assert len({a.rpc_port, a.metrics_port, b.rpc_port, b.metrics_port}) == 4
        assert health(a)["status"] == health(b)["status"] == "ok"
    assert not any(pid_alive(p) for p in pids if p is not None)


def test_restart_keeps_the_address_so_clients_find_it_again():
    master = EmbeddedMaster().start()
    try:
        address, first = master.address, master.pid
        master.restart()
        assert master.address == address and master.pid != first
        assert first is not None and not pid_alive(first)
        assert health(master)["status"] == "ok"
    finally:
        master.stop()


def test_a_missing_binary_is_a_typed_error():
    with pytest.raises(MasterError, match="/no/such/mooncake_master does not exist"):
        EmbeddedMaster(binary="/no/such/mooncake_master").start()


def test_a_file_that_cannot_be_executed_is_a_typed_error(tmp_path):
    not_a_program = tmp_path / "mooncake_master"
    not_a_program.write_text("this is not a program\n")
    not_a_program.chmod(0o755)
    with pytest.raises(MasterError, match="cannot run"):
        EmbeddedMaster(binary=not_a_program).start()


def test_ports_must_be_ports():
    with pytest.raises(ValueError, match="rpc_port"):
        EmbeddedMaster(rpc_port=70000)


def test_a_binary_that_exits_reports_its_last_output(tmp_path):
    bad = script(tmp_path, "crashing_master", "import sys\nprint('cannot bind: boom', flush=True)\nsys.exit(3)\n")
    with pytest.raises(MasterError, match="exited with status 3") as err:
        EmbeddedMaster(binary=bad, rpc_port=free_ports(1)[0], metrics_port=free_ports(1)[0]).start()
    assert "cannot bind: boom" in err.value.output_tail
    assert "cannot bind: boom" in str(err.value)


def test_the_master_gets_a_parent_death_signal_and_runs_none_of_the_daemons_fork_handlers(tmp_path):
    # Python code run in the forked child before exec (a preexec_fn) runs every os.register_at_fork handler, gRPC's
    # among them, in a copy of a process full of threads: they wrote into the master's output and can deadlock the
    # child. The master must start with no Python run in that child, and still die with the thread that started it.
    report = tmp_path / "report.json"
    marker = tmp_path / "a fork handler ran"
    rpc_port, metrics_port = free_ports(2)
    fake = script(
        tmp_path,
        "reporting_master",
        f"""
        import ctypes, json, sys
        sig = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        json.dump({{"pdeathsig": sig.value, "argv": sys.argv}}, open({str(report)!r}, "w"))
        sys.exit(3)
        """,
    )
    driver = textwrap.dedent(
        f"""
        import os
        from kvsidecar.daemon.master import EmbeddedMaster, MasterError
        os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, "w").close())
        try:
            EmbeddedMaster(binary={fake!r}, rpc_port={rpc_port}, metrics_port={metrics_port}).start()
        except MasterError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120)
    assert "exited with status 3" in out.stdout, out
    reported = json.loads(report.read_text())
    assert reported["pdeathsig"] == signal.SIGTERM
    assert reported["argv"][0] == fake and f"--rpc_port={rpc_port}" in reported["argv"]
    assert not marker.exists()


def test_a_master_that_never_gets_ready_times_out_and_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    silent = script(
        tmp_path,
        "silent_master",
        f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        print("starting", flush=True)
        time.sleep(60)
        """,
    )
    master = EmbeddedMaster(binary=silent, rpc_port=free_ports(1)[0], metrics_port=free_ports(1)[0], ready_timeout_s=1)
    with pytest.raises(MasterError, match="not ready within 1 s") as err:
        master.start()
    assert err.value.output_tail == ["starting"]
    assert not pid_alive(int(pid_file.read_text()))
    assert not master.alive()


def test_stop_kills_a_master_that_ignores_sigterm(tmp_path):
    # Serves /health like the real master but ignores SIGTERM, so stop() has to escalate.
    stubborn = script(
        tmp_path,
        "stubborn_master",
        """
        import http.server, signal, socket, sys
        args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rpc = socket.create_server(("127.0.0.1", int(args["rpc_port"])))

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"status": "ok"}')

            def log_message(self, *a):
                pass

        http.server.HTTPServer(("127.0.0.1", int(args["metrics_port"])), Health).serve_forever()
        """,
    )
    master = EmbeddedMaster(binary=stubborn).start()
    pid = master.pid
    assert pid is not None
    assert master.stop(timeout=0.5) == -9
    assert not pid_alive(pid)


def test_the_default_binary_is_the_one_beside_python():
    assert find_master_binary().parent == Path(sys.executable).parent


def test_native_libs_are_found_once_and_their_folder_goes_to_the_child(tmp_path):
    # libibverbs is installed system-wide here: nothing to add, whatever the prefix says.
    assert ensure_native_libs() == ensure_native_libs(prefix=tmp_path) == {}
    assert native_dir(tmp_path) == tmp_path / "lib" / "kvsidecar-native"
    # The fallback folder scripts/setup.sh fills, stood in for by links to the system's copies.
    folder = native_dir(tmp_path)
    folder.mkdir(parents=True)
    for name in ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1"):
        found = [
            d / name for d in (Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu")) if (d / name).exists()
        ]
        if not found:
            pytest.skip(f"{name} is not installed system-wide")
        (folder / name).symlink_to(found[0])
    env = preload_from(folder, environ={"LD_LIBRARY_PATH": "/opt/x"})
    assert env == {"LD_LIBRARY_PATH": f"{folder}:/opt/x"}
    assert preload_from(folder, environ={}) == {"LD_LIBRARY_PATH": str(folder)}


def test_a_native_folder_without_libibverbs_is_a_typed_error(tmp_path):
    folder = native_dir(tmp_path)
    folder.mkdir(parents=True)
    with pytest.raises(NativeLibraryError, match=r"libibverbs\.so\.1"):
        preload_from(folder, environ={})


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.create_server(("127.0.0.1", port)):
            pass
