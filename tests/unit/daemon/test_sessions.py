"""Session leases with a fake clock."""

import pytest

from kvsidecar.errors import UnknownSession
from kvsidecar.session import Role, SessionRegistry
from kvsidecar_contract.placement import GroupSpec, Kind, Layout

LAYOUT = Layout("m", (GroupSpec(Kind.MLA, 16),))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_renewal_and_expiry():
    clock, released = Clock(), []
    reg = SessionRegistry(10, released.append, clock)
    a = reg.open(Role.RANK, LAYOUT, 32, "a")
    b = reg.open(Role.SCHEDULER, LAYOUT, 32, "b")
    assert a.id != b.id and len(a.id) >= 32
    clock.now += 8
    reg.get(a.id)  # renews a only
    clock.now += 5
    assert reg.expire() == [b]
    assert released == [b]
    with pytest.raises(UnknownSession, match="lease expired"):
        reg.get(b.id)
    assert reg.get(a.id) is a


def test_expired_but_not_yet_swept_is_unknown():
    clock = Clock()
    reg = SessionRegistry(1, lambda s: None, clock)
    s = reg.open(Role.RANK, LAYOUT, 32, "")
    clock.now += 2
    with pytest.raises(UnknownSession):
        reg.get(s.id)


def test_close_twice_is_not_found():
    reg = SessionRegistry(1, lambda s: None)
    s = reg.open(Role.RANK, LAYOUT, 32, "")
    reg.close(s.id)
    with pytest.raises(UnknownSession):
        reg.close(s.id)


def test_a_session_in_use_does_not_expire_and_renews_when_done():
    clock, released = Clock(), []
    reg = SessionRegistry(2, released.append, clock)
    s = reg.open(Role.RANK, LAYOUT, 32, "")
    with reg.use(s.id) as held:
        clock.now += 10  # a store call slower than the lease
        assert reg.expire() == []
        assert held is s
    assert reg.expire() == []  # renewed at the end of the request
    clock.now += 3
    assert reg.expire() == [s]
