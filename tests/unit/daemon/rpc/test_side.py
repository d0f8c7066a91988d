"""The side socket over a real Unix socket: tickets carry SO_PEERCRED, memfds reach only their own session."""

import json
import os
import socket

import pytest

from kvsidecar.errors import BadRequest, Forbidden
from kvsidecar.memory.mappings import Opener
from kvsidecar.movers.factory import Movers
from kvsidecar.rpc.side import SideChannel
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.table import Caller
from kvsidecar.tenancy.tickets import Tickets
from kvsidecar.values import MemfdHandle, RegionRequest, Role, ShmHandle
from kvsidecar_contract.limits import MAX_MEMFDS
from kvsidecar_contract.placement import GroupSpec, Kind, Layout

LAYOUT = Layout("m", (GroupSpec(Kind.MLA, 16),))
SIZE = 8 * 1024


@pytest.fixture
def side(tmp_path):
    store = MemoryStore()
    reg = SessionRegistry(10, Movers(store))
    tickets = Tickets()
    channel = SideChannel(str(tmp_path / "s.side"), tickets, reg.accept_fds)
    channel.bind(0o600, None)
    channel.start()
    yield channel, reg, tickets
    channel.stop()
    reg.close_all()


def ask(path, body, fds=()):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(path)
        socket.send_fds(s, [body if isinstance(body, bytes) else json.dumps(body).encode()], list(fds))
        return json.loads(s.recv(4096))


def memfd(seal=True, allow=True, backed=True):
    fd = os.memfd_create("t", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow else 0))
    os.ftruncate(fd, SIZE)
    if backed:
        os.posix_fallocate(fd, 0, SIZE)  # as the client's shared_tensor does before sealing
    if seal:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def region(handle):
    return RegionRequest(handle, SIZE, 0, 1024, 1024, 8, (0,))


def mine(reg):
    return reg.open(Role.RANK, LAYOUT, 32, "", caller=Caller(uid=os.getuid()))


def test_a_ticket_stands_for_the_peers_uid_once(side):
    channel, _, tickets = side
    answer = ask(channel.path, {"op": "ticket"})
    assert answer["ok"]
    cred = tickets.redeem(answer["ticket"])
    assert cred is not None and cred.uid == os.getuid() and cred.pid == os.getpid() and os.getgid() in cred.groups
    assert tickets.redeem(answer["ticket"]) is None


def test_memfds_reach_their_session_and_are_mapped_sealed(side):
    channel, reg, _ = side
    s = mine(reg)
    fd = memfd()
    try:
        assert ask(channel.path, {"op": "fds", "session": s.id, "secret": s.side_secret.hex()}, [fd])["count"] == 1
        memory = reg.attach(s, [region(MemfdHandle(0))])
        os.pwrite(fd, b"engine", 0)
        addresses, _ = memory.buffers(0, 0)
        import ctypes

        assert ctypes.string_at(addresses[0], 6) == b"engine"  # the daemon maps the engine's very pages
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def test_an_unsealed_memfd_is_sealed_by_the_daemon_and_an_unsealable_one_refused(side):
    channel, reg, _ = side
    for allow, outcome in ((True, None), (False, "not sealed against shrinking")):
        s = mine(reg)
        fd = memfd(seal=False, allow=allow)
        try:
            ask(channel.path, {"op": "fds", "session": s.id, "secret": s.side_secret.hex()}, [fd])
            if outcome is None:
                reg.attach(s, [region(MemfdHandle(0))])
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 0)  # sealed now, for the engine too
            else:
                with pytest.raises(BadRequest, match=outcome):
                    reg.attach(s, [region(MemfdHandle(0))])
        finally:
            os.close(fd)


def test_a_sparse_memfd_is_refused_with_the_fix_and_the_daemon_allocates_none_of_it(side):
    channel, reg, _ = side
    s = mine(reg)
    fd = memfd(seal=False, backed=False)
    try:
        ask(channel.path, {"op": "fds", "session": s.id, "secret": s.side_secret.hex()}, [fd])
        with pytest.raises(BadRequest, match=r"not fully backed: 0 of its 8192 bytes .*\(posix_fallocate"):
            reg.attach(s, [region(MemfdHandle(0))])
        assert os.fstat(fd).st_blocks == 0  # the daemon allocated no page of it
    finally:
        os.close(fd)


def test_hostile_side_requests_are_refused_with_reasons(side, tmp_path):
    channel, reg, _ = side
    s = mine(reg)
    other = reg.open(Role.RANK, LAYOUT, 32, "", caller=Caller(uid=os.getuid() + 1))
    tcp = reg.open(Role.RANK, LAYOUT, 32, "", caller=Caller(transport="tcp"))
    other2 = mine(reg)
    fd = memfd()
    pipe_r, pipe_w = os.pipe()
    try:
        cases = [
            (b"not json", [], "one JSON object"),
            ({"op": "nope"}, [], "unknown side-socket op"),
            ({"op": "ticket"}, [fd], "carries no file descriptors"),
            ({"op": "fds", "session": s.id, "secret": s.side_secret.hex()}, [], "one or more file descriptors"),
            ({"op": "fds", "session": s.id, "secret": "00" * 24}, [fd], "wrong side secret"),
            ({"op": "fds", "session": "forged", "secret": "00"}, [fd], "unknown session"),
            ({"op": "fds", "session": other.id, "secret": other.side_secret.hex()}, [fd], "another uid"),
            ({"op": "fds", "session": tcp.id, "secret": tcp.side_secret.hex()}, [fd], "another uid"),
            (b"{" + b" " * 5000 + b"}", [], "request too large"),  # (the kernel itself caps fds at MAX_MEMFDS)
        ]
        for body, fds, reason in cases:
            answer = ask(channel.path, body, fds)
            assert not answer["ok"] and reason in answer["error"], (body, answer)
        # More memfds than a session may hold, over several requests: the last one is refused whole.
        for n, ok in ((200, True), (MAX_MEMFDS - 199, False)):
            answer = ask(
                channel.path, {"op": "fds", "session": other2.id, "secret": other2.side_secret.hex()}, [fd] * n
            )
            assert answer["ok"] is ok and (ok or f"at most {MAX_MEMFDS} memfds per session" in answer["error"])
        reg.close(other2.id)
        # A pipe is no memfd: passed, but refused when a region names it; the session's other rights are unchanged.
        ask(channel.path, {"op": "fds", "session": s.id, "secret": s.side_secret.hex()}, [pipe_r])
        with pytest.raises(BadRequest, match="memfd #0 is not a"):
            reg.attach(s, [region(MemfdHandle(0))])
        with pytest.raises(BadRequest, match="memfd index 3, but the session passed 0 memfds"):
            Opener().key(0, MemfdHandle(3))
        with pytest.raises(Forbidden, match="/dev/shm names are for trusted ranks only"):
            Opener().key(0, ShmHandle("x"))
        assert ask(channel.path, {"op": "ticket"})["ok"]  # still serving
    finally:
        for x in (fd, pipe_r, pipe_w):
            os.close(x)


def test_descriptors_the_kernel_could_not_install_are_reported_as_such(side):
    """MSG_CTRUNC at the daemon's fd limit is named as what it is, not as a request too large."""
    import resource

    channel, reg, _ = side
    s = mine(reg)
    fds = [memfd() for _ in range(8)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(5)
            sock.connect(channel.path)
            # This process is the daemon here: leave room for the accepted connection and two of the eight fds.
            limit = max(*fds, sock.fileno()) + 1
            while limit - sum(int(fd) < limit for fd in os.listdir("/proc/self/fd")) < 3:
                limit += 1
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            body = {"op": "fds", "session": s.id, "secret": s.side_secret.hex()}
            socket.send_fds(sock, [json.dumps(body).encode()], fds)
            answer = json.loads(sock.recv(4096))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fds:
            os.close(fd)
    assert not answer["ok"] and answer["code"] == "RESOURCE_EXHAUSTED", answer
    assert "the kernel truncated the passed descriptors (MSG_CTRUNC)" in answer["error"], answer
    assert "open-file limit (RLIMIT_NOFILE)" in answer["error"], answer
    assert reg.shares.memfds.held() == 0  # nothing was accepted
