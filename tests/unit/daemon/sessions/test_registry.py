"""Session leases with a fake clock, and the memory a session attaches and releases."""

from multiprocessing import shared_memory

import pytest

from kvsidecar.errors import BadRequest, Forbidden, OutOfOrder, StoreError, UnknownSession
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store import StoreCode
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.live import Grant
from kvsidecar.values import RegionRequest, Role, ShmHandle
from kvsidecar_contract.placement import GroupSpec, Kind, Layout

LAYOUT = Layout("m", (GroupSpec(Kind.MLA, 16),))
# These ranks register named /dev/shm segments: a right granted explicitly, as to a trusted rank.
TRUSTED = Grant("", shm_names=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def registry(ttl, clock=None, store=None):
    store = store if store is not None else MemoryStore()
    return SessionRegistry(ttl, Movers(store), clock=clock or Clock())


def test_lease_renewal_and_expiry():
    clock = Clock()
    reg = registry(10, clock)
    a = reg.open(Role.RANK, LAYOUT, 32, "a", grant=TRUSTED)
    b = reg.open(Role.SCHEDULER, LAYOUT, 32, "b")
    assert a.id != b.id and len(a.id) >= 32
    clock.now += 8
    reg.get(a.id)  # renews a only
    clock.now += 5
    assert reg.expire() == [b]
    assert b.closed and not a.closed  # released: nothing may attach to it any more
    with pytest.raises(UnknownSession, match="lease expired"):
        reg.get(b.id)
    assert reg.get(a.id) is a


def test_expired_but_not_yet_swept_is_unknown():
    clock = Clock()
    reg = registry(1, clock)
    s = reg.open(Role.RANK, LAYOUT, 32, "", grant=TRUSTED)
    clock.now += 2
    with pytest.raises(UnknownSession):
        reg.get(s.id)


def test_close_twice_is_not_found():
    reg = registry(1)
    s = reg.open(Role.RANK, LAYOUT, 32, "", grant=TRUSTED)
    reg.close(s.id)
    with pytest.raises(UnknownSession):
        reg.close(s.id)


def test_a_session_in_use_does_not_expire_and_renews_when_done():
    clock = Clock()
    reg = registry(2, clock)
    s = reg.open(Role.RANK, LAYOUT, 32, "", grant=TRUSTED)
    with reg.use(s.id) as held:
        clock.now += 10  # a store call slower than the lease
        assert reg.expire() == []
        assert held is s
    assert reg.expire() == []  # renewed at the end of the request
    clock.now += 3
    assert reg.expire() == [s]


def test_a_session_held_by_its_liveness_connection_never_expires_and_ends_when_it_closes():
    clock = Clock()
    reg = registry(2, clock)
    s = reg.open(Role.RANK, LAYOUT, 32, "busy", grant=TRUSTED)
    reg.hold(s)
    clock.now += 1000  # no KeepAlive for far longer than the lease: a busy engine, a stopped process
    assert reg.expire() == []
    assert reg.get(s.id) is s
    reg.let_go(s)  # the process exited or was killed: the kernel closed the connection
    assert s.closed and reg.snapshot() == []
    with pytest.raises(UnknownSession):
        reg.get(s.id)


def test_a_gone_session_with_a_call_in_flight_is_released_when_the_call_ends():
    clock = Clock()
    reg = registry(10, clock)
    s = reg.open(Role.RANK, LAYOUT, 32, "", grant=TRUSTED)
    reg.hold(s)
    with reg.use(s.id):
        reg.let_go(s)
        assert not s.closed  # its memory may still be read by the call
    assert reg.expire() == [s]  # at the next sweep, not a lease later
    assert s.closed


def test_a_session_ends_with_its_last_liveness_connection_and_one_closed_before_is_left_alone():
    clock = Clock()
    reg = registry(2, clock)
    s = reg.open(Role.RANK, LAYOUT, 32, "", grant=TRUSTED)
    reg.hold(s)
    reg.hold(s)
    reg.let_go(s)  # one of two closed: still held
    clock.now += 100
    assert reg.expire() == []
    reg.close(s.id)
    reg.let_go(s)  # closed first (CloseSession), then its connection: nothing left to end
    assert reg.expire() == []


# Attaching and releasing memory: the registry claims, registers with the store, and rolls back on failure.


@pytest.fixture
def segment():
    shm = shared_memory.SharedMemory(create=True, size=8192)
    shm.buf[:] = bytes(8192)  # backed by its owner, as the client's segments are (the daemon backs none)
    yield shm
    shm.close()
    shm.unlink()


def shm_region(name, *, size=8192, blocks=8, groups=(0,)) -> RegionRequest:
    return RegionRequest(ShmHandle(name), size, 0, 1024, 1024, blocks, groups)


def test_attach_registers_every_mapping_and_release_unregisters_it(segment):
    store, metrics = MemoryStore(require_registration=True), Metrics()
    reg = SessionRegistry(10, Movers(store), metrics=metrics, clock=Clock())
    s = reg.open(Role.RANK, LAYOUT, 32, "a", grant=TRUSTED)
    memory = reg.attach(s, [shm_region(segment.name)])
    assert s.memory is memory and memory.mapped_bytes == 8192
    address = next(iter(memory.mappings.values())).address
    addresses, sizes = memory.buffers(0, 3)
    assert store.put_from(["k"], [addresses], [sizes]) == [StoreCode.OK]  # registered: the store accepts it
    assert metrics.registry.get_sample_value("kvsidecar_registered_region_bytes") == 8192
    assert metrics.registry.get_sample_value("kvsidecar_sessions", {"role": "rank"}) == 1
    reg.close(s.id)
    assert s.closed and s.memory is None
    with pytest.raises(StoreError, match="no buffer registered"):
        store.unregister_buffer(address)  # the session's mover already unregistered it
    assert metrics.registry.get_sample_value("kvsidecar_registered_region_bytes") == 0
    assert metrics.registry.get_sample_value("kvsidecar_sessions", {"role": "rank"}) == 0


def test_attach_refuses_schedulers_second_attaches_and_other_sessions_memory(segment):
    store = MemoryStore()
    reg = registry(10, store=store)
    scheduler = reg.open(Role.SCHEDULER, LAYOUT, 32, "")
    with pytest.raises(Forbidden, match="scheduler session cannot register memory"):
        reg.attach(scheduler, [RegionRequest(None, 0, 0, 0, 0, 0, ())])  # the role is checked before the regions
    a, b = reg.open(Role.RANK, LAYOUT, 32, "a", grant=TRUSTED), reg.open(Role.RANK, LAYOUT, 32, "b", grant=TRUSTED)
    reg.attach(a, [shm_region(segment.name)])
    with pytest.raises(OutOfOrder, match="already registered"):
        reg.attach(a, [shm_region(segment.name)])
    with pytest.raises(Forbidden, match="registered by another session"):
        reg.attach(b, [shm_region(segment.name)])
    assert b.memory is None
    reg.close(a.id)
    assert reg.attach(b, [shm_region(segment.name)]) is b.memory  # a's claim went with its release


class RefusingStore(MemoryStore):
    """The in-memory store, refusing to register memory while `refuse` is set."""

    refuse = True

    def register_buffer(self, address: int, size: int) -> None:
        if self.refuse:
            raise StoreError(StoreCode.NO_SPACE, "cannot register more memory")
        super().register_buffer(address, size)


def test_a_store_refusal_rolls_the_attach_back(segment):
    store, metrics = RefusingStore(require_registration=True), Metrics()
    reg = SessionRegistry(10, Movers(store), metrics=metrics, clock=Clock())
    a, b = reg.open(Role.RANK, LAYOUT, 32, "a", grant=TRUSTED), reg.open(Role.RANK, LAYOUT, 32, "b", grant=TRUSTED)
    with pytest.raises(StoreError, match="cannot register more memory"):
        reg.attach(a, [shm_region(segment.name)])
    assert a.memory is None and not a.closed
    assert metrics.registry.get_sample_value("kvsidecar_registered_region_bytes") == 0
    # The claim was rolled back too: another session may now register the same segment.
    store.refuse = False
    assert reg.attach(b, [shm_region(segment.name)]) is b.memory
    assert metrics.registry.get_sample_value("kvsidecar_registered_region_bytes") == 8192


def test_region_handles_are_checked_before_the_memory_is_mapped():
    reg = registry(10)
    s = reg.open(Role.RANK, LAYOUT, 32, "", grant=TRUSTED)
    with pytest.raises(BadRequest, match="region 0: shared-memory name is empty"):
        reg.attach(s, [shm_region("")])
    with pytest.raises(BadRequest, match="region 1: needs a shm or cuda handle"):
        reg.attach(s, [shm_region("x"), RegionRequest(None, 8192, 0, 1024, 1024, 8, (0,))])
    assert s.memory is None


def test_named_segments_need_the_right_granted():
    reg = registry(10)
    s = reg.open(Role.RANK, LAYOUT, 32, "")  # no grant: no rights beyond the defaults
    with pytest.raises(Forbidden, match="/dev/shm names are for trusted ranks only"):
        reg.attach(s, [shm_region("x")])
    assert s.memory is None and not s.shm_names


def test_memory_of_a_session_whose_lease_ran_out_can_be_registered_again_before_housekeeping(segment):
    clock = Clock()
    reg = registry(10, clock)
    seg = segment
    try:
        old = reg.open(Role.RANK, LAYOUT, 32, "old", grant=TRUSTED)
        reg.attach(old, [shm_region(seg.name)])
        clock.now += 11  # the old rank's lease ran out; housekeeping has not run yet
        new = reg.open(Role.RANK, LAYOUT, 32, "new", grant=TRUSTED)
        assert reg.attach(new, [shm_region(seg.name)]).mapped_bytes == 8192
        assert old.closed and old.memory is None
        # A live owner still keeps its memory its own.
        other = reg.open(Role.RANK, LAYOUT, 32, "other", grant=TRUSTED)
        with pytest.raises(Forbidden, match="registered by another session"):
            reg.attach(other, [shm_region(seg.name)])
    finally:
        reg.close_all()
