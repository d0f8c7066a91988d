"""Sessions draw from their account's fair shares: open sessions, memfds held, registered host bytes."""

from __future__ import annotations

import fcntl
import os

import pytest

from kvsidecar.errors import Exhausted
from kvsidecar.movers.factory import Movers
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.live import Grant
from kvsidecar.tenancy.shares import SessionShares
from kvsidecar.tenancy.table import Caller
from kvsidecar.tenancy.tickets import PeerCred
from kvsidecar.values import MemfdHandle, RegionRequest, Role
from kvsidecar_contract.placement import GroupSpec, Kind, Layout

LAYOUT = Layout("m", (GroupSpec(Kind.MLA, 16),))
SIZE = 64 * 1024


def memfd() -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    os.posix_fallocate(fd, 0, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def registry(**caps: int) -> SessionRegistry:
    store = MemoryStore()
    return SessionRegistry(10, Movers(store), shares=SessionShares(**caps))


def register(reg: SessionRegistry, uid: int, grant: Grant | None = None):
    """Open a rank session as uid and register one memfd of SIZE bytes through it."""
    s = reg.open(Role.RANK, LAYOUT, 32, "", caller=Caller(uid=uid), grant=grant)
    fd = memfd()
    reg.accept_fds(s.id, s.side_secret.hex(), PeerCred(1, uid, uid, frozenset()), [os.dup(fd)])
    try:
        reg.attach(s, [RegionRequest(MemfdHandle(0), SIZE, 0, SIZE, SIZE, 1, (0,))])
    finally:
        os.close(fd)
    return s


def test_one_uid_at_its_session_share_leaves_the_rest_to_another():
    reg = registry(max_sessions=3, max_sessions_per_account=2)
    a = [reg.open(Role.SCHEDULER, LAYOUT, 32, "", caller=Caller(uid=1001)) for _ in range(2)]
    with pytest.raises(Exhausted, match=r"open sessions: uid 1001 holds 2 .* \(--max-sessions-per-account\)"):
        reg.open(Role.SCHEDULER, LAYOUT, 32, "", caller=Caller(uid=1001))
    reg.open(Role.SCHEDULER, LAYOUT, 32, "", caller=Caller(uid=1002))
    with pytest.raises(Exhausted, match=r"daemon-wide cap of 3 \(--max-sessions\)"):
        reg.open(Role.SCHEDULER, LAYOUT, 32, "", caller=Caller(uid=1003))
    reg.close(a[0].id)
    reg.open(Role.SCHEDULER, LAYOUT, 32, "", caller=Caller(uid=1003))
    reg.close_all()
    assert reg.shares.sessions.held() == 0


def test_registered_bytes_are_capped_per_uid_per_tenant_and_daemon_wide_and_given_back():
    reg = registry(max_registered_bytes=3 * SIZE, max_registered_bytes_per_account=2 * SIZE)
    first = register(reg, 1001)
    register(reg, 1001)
    with pytest.raises(Exhausted, match=r"registered host memory: uid 1001 holds 131072 bytes .* past its share"):
        register(reg, 1001)
    with pytest.raises(Exhausted, match=r"tenant small holds 0 bytes .* \(max_registered_bytes of tenant small"):
        register(reg, 1002, Grant("small", max_registered_bytes=SIZE // 2))
    register(reg, 1003)
    with pytest.raises(Exhausted, match=r"daemon-wide cap of 196608 bytes \(0.00 GiB\) \(--max-registered-bytes\)"):
        register(reg, 1004)
    reg.close(first.id)
    register(reg, 1004)
    assert reg.shares.memfds.held("uid 1001") == 1  # the refused registration gave its memfd back
    reg.close_all()
    assert reg.shares.registered_bytes.held() == 0 and reg.shares.memfds.held() == 0


def test_memfds_held_are_capped_per_uid():
    reg = registry(max_memfds_per_account=3)
    s = reg.open(Role.RANK, LAYOUT, 32, "", caller=Caller(uid=1001))
    peer = PeerCred(1, 1001, 1001, frozenset())
    fds = [memfd() for _ in range(4)]
    try:
        reg.accept_fds(s.id, s.side_secret.hex(), peer, [os.dup(fds[0]), os.dup(fds[1])])
        with pytest.raises(Exhausted, match=r"memfds held: uid 1001 holds 2 and asks for 2 more"):
            reg.accept_fds(s.id, s.side_secret.hex(), peer, fds[2:])
        other = reg.open(Role.RANK, LAYOUT, 32, "", caller=Caller(uid=1002))
        reg.accept_fds(other.id, other.side_secret.hex(), PeerCred(2, 1002, 1002, frozenset()), [os.dup(fds[2])])
    finally:
        for fd in fds:
            os.close(fd)
    reg.close_all()
    assert reg.shares.memfds.held() == 0
