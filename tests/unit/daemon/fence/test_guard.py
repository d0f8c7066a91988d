"""The fence on real sockets of this process: sealing, late listeners, breaches, and the daemon's refusal."""

import socket

import pytest

from kvsidecar.fence import bpf, guard
from kvsidecar.fence.daemon import DaemonFence


def dual_stack_listener() -> socket.socket:
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", 0))
    s.listen()
    return s


def connects(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def test_sealed_listeners_refuse_everyone_and_count_it():
    fence = guard.ListenerFence(guard.Policy.nobody())
    before = guard.listening_inodes()
    with dual_stack_listener() as s:
        (listener,) = fence.seal_new(before)
        port = s.getsockname()[1]
        assert listener.role == "mooncake-transfer" and listener.allowed == "nobody"
        assert guard.attached_filter(s) == bpf.encode(bpf.allow_program([]))
        assert not connects(port) and not connects(port, "::1")
        assert fence.dropped()[listener] >= 2
        with pytest.raises(OSError):  # locked: nothing in the process can take it off
            guard.attach(s, bpf.allow_program(bpf.LOOPBACK))
    fence.release()


def test_a_late_wildcard_listener_is_fenced_by_the_sweep_and_loopback_ones_are_left_alone():
    fence = guard.ListenerFence(guard.Policy.peers([]))
    with socket.socket() as local, socket.socket() as late:
        local.bind(("127.0.0.1", 0))
        local.listen()
        late.bind(("0.0.0.0", 0))
        late.listen()
        found = {item.address for item in fence.sweep(own_ports=set())}
        # Other wildcard listeners this test process holds (Mooncake clients of earlier tests) are fenced too; the
        # loopback-bound one never is.
        assert f"0.0.0.0:{late.getsockname()[1]}" in found
        assert f"127.0.0.1:{local.getsockname()[1]}" not in found
        assert all(not address.startswith("127.") for address in found)
        assert connects(late.getsockname()[1])  # loopback is allowed with peers
        assert guard.attached_filter(local) == b""
        assert fence.sweep(own_ports=set()) == []  # once is enough
    fence.release()


def test_a_refused_peer_connected_before_the_fence_stops_the_daemon():
    held: list[socket.socket] = []
    closed: list[str] = []

    def connect_mooncake() -> str:
        # Mooncake's setup opens a listener, and a peer racing it connects before the fence is up.
        listener = dual_stack_listener()
        racer = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
        held.extend([listener, racer])
        return "store"

    fence = DaemonFence(guard.Policy.nobody())
    try:
        with pytest.raises(guard.FenceError, match="before its fence"):
            fence.open_store(connect_mooncake, closed.append)
        assert closed == ["store"]  # the store is closed again: the daemon refuses to run
    finally:
        fence.release()
        for s in held:
            s.close()


def test_an_allowed_peer_connected_before_the_fence_is_fine():
    held: list[socket.socket] = []

    def connect_mooncake() -> str:
        listener = dual_stack_listener()
        held.extend([listener, socket.create_connection(("127.0.0.1", listener.getsockname()[1]))])
        return "store"

    fence = DaemonFence(guard.Policy.peers([]))
    try:
        assert fence.open_store(connect_mooncake, lambda store: None) == "store"
        (listener,) = fence.listeners()
        assert listener.allowed == "127.0.0.0/8,::1/128"
    finally:
        fence.release()
        for s in held:
            s.close()


def test_the_kernel_runs_both_halves_of_the_program():
    """IPv4 and IPv6 sources reach one dual-stack listener; the kernel admits loopback of both and only that."""
    fence = guard.ListenerFence(guard.Policy.peers([]))
    before = guard.listening_inodes()
    with dual_stack_listener() as s:
        fence.seal_new(before)
        port = s.getsockname()[1]
        assert connects(port, "127.0.0.1") and connects(port, "::1")
    fence.release()
    only_v4 = guard.ListenerFence(guard.Policy((bpf.LOOPBACK[0],)))
    before = guard.listening_inodes()
    with dual_stack_listener() as s:
        only_v4.seal_new(before)
        port = s.getsockname()[1]
        assert connects(port, "127.0.0.1") and not connects(port, "::1")
    only_v4.release()
