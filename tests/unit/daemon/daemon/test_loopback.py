"""The loopback guard: a private network namespace for the calling thread, host sockets on request, or nothing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvsidecar.daemon.loopback import LoopbackGuard

NS = "/proc/thread-self/ns/net"


def in_thread(body: Callable[[], Any]) -> Any:
    """Run body in a fresh thread (whose namespace dies with it) and return what it returned or raise what it raised."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = body()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.skipif(os.geteuid() != 0, reason="a private network namespace needs CAP_SYS_ADMIN (CI runs as root)")
def test_a_private_namespace_hides_its_loopback_and_host_makes_sockets_outside():
    host_ns = os.readlink(NS)
    with socket.create_server(("127.0.0.1", 0)) as outside:
        outside_port = outside.getsockname()[1]

        def body() -> dict[str, Any]:
            guard = LoopbackGuard.enter_private()
            seen: dict[str, Any] = {"private": guard.private, "description": guard.description}
            seen["inside_ns"] = os.readlink(NS)
            # Loopback is up in there, and the host's listener is not on it.
            with socket.create_server(("127.0.0.1", 0)) as inside:
                seen["inside_port"] = inside.getsockname()[1]
                with socket.create_connection(("127.0.0.1", seen["inside_port"]), timeout=5):
                    seen["own_loopback"] = "connected"
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", outside_port), timeout=5)
                # A thread started now lives in the private namespace too.
                seen["child_ns"] = in_thread(lambda: os.readlink(NS))
                with guard.host():
                    seen["host_ns"] = os.readlink(NS)
                    with socket.create_connection(("127.0.0.1", outside_port), timeout=5):
                        seen["host_loopback"] = "connected"
                seen["back_ns"] = os.readlink(NS)
                # A thread started in the host's namespace runs a wrapped call in the private one.
                with guard.host():
                    seen["wrapped_ns"] = in_thread(guard.inside(lambda: os.readlink(NS)))
                # The test's own thread, in the host's namespace, cannot reach the private listener.
                seen["from_host"] = in_host_thread(host_ns, seen["inside_port"])
            guard.leave()
            seen["left_ns"] = os.readlink(NS)
            return seen

        seen = in_thread(body)
    assert seen["private"] and "private network namespace" in seen["description"], seen
    assert seen["inside_ns"] != host_ns and seen["child_ns"] == seen["inside_ns"] == seen["back_ns"], seen
    assert seen["wrapped_ns"] == seen["inside_ns"], seen
    assert seen["host_ns"] == host_ns and seen["left_ns"] == host_ns, seen
    assert seen["own_loopback"] == seen["host_loopback"] == "connected", seen
    assert seen["from_host"] == "refused", seen
    assert os.readlink(NS) == host_ns  # the test's thread never moved


def in_host_thread(host_ns: str, port: int) -> str:
    """From a thread moved back to the host's namespace: can it reach a private listener's port?"""

    def body() -> str:
        import ctypes

        fd = os.open(f"/proc/{os.getpid()}/task/{threading.main_thread().native_id}/ns/net", os.O_RDONLY)
        try:
            assert ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) == 0
        finally:
            os.close(fd)
        assert os.readlink(NS) == host_ns
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return "refused"
        return "connected"

    return str(in_thread(body))


@pytest.mark.skipif(not shutil.which("setpriv") or os.geteuid() != 0, reason="needs root and setpriv to drop a cap")
def test_without_cap_sys_admin_the_guard_is_nothing_and_says_why():
    code = "from kvsidecar.daemon.loopback import LoopbackGuard as G; g = G.enter_private(); print(g.private)\n"
    code += "print(g.description)"
    out = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_admin", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    private, description = out.stdout.splitlines()
    assert private == "False"
    assert description == (
        "nothing (unshare(CLONE_NEWNET): Operation not permitted; a private network namespace needs CAP_SYS_ADMIN)"
    )


def test_no_guard_runs_host_bodies_in_place_and_leaves_nothing():
    guard = LoopbackGuard.none("external master")
    assert guard.description == "nothing (external master)" and not guard.private
    before = os.readlink(NS)
    with guard.host():
        assert os.readlink(NS) == before
    assert guard.inside(os.readlink)(NS) == before
    guard.leave()
    assert os.readlink(NS) == before
