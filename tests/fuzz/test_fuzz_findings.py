"""Minimal repros of the daemon bugs the fuzz and soak suites found, one test each (they fail until fixed).

Each test names the property it pins; the module docstring of each section says what the daemon does today.
Daemon processes here are private to the test when the repro kills or hogs the daemon; races use the in-process
daemon with a store that is slow on purpose, so they are deterministic.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.store.base import StoreUnavailable
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_testing.waiting import wait_until
from support.fuzzdaemon import FuzzDaemon
from support.fuzzwire import Wire, check_clean
from support.guarded import Geometry, GuardedSegment, region
from support.inprocess import InProcessDaemon

pytestmark = pytest.mark.integration

OK = grpc.StatusCode.OK
BAD = grpc.StatusCode.INVALID_ARGUMENT
GONE = grpc.StatusCode.NOT_FOUND
H = [bytes([i]) * 32 for i in range(1, 9)]


def open_request(groups, *, model="org/Finding", prefix="", tp=1, rank=0, dcp=1, u=16, heads=1, role=pb.ROLE_RANK):
    return pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model=model, cache_prefix=prefix),
        parallel=pb.ParallelLayout(tp_size=tp, tp_rank=rank, dcp_size=dcp),
        num_kv_heads=heads,
        hash_block_size=u,
        groups=groups,
        hash_bytes=32,
        role=role,
        client_name="finding",
    )


ATTN = pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16)


def open_registered(wire: Wire, model: str, num_blocks: int = 4, block_bytes: int = 4096, **kw):
    """A rank session over one guarded segment; returns (session id, segment, geometry)."""
    sid = wire.rpc("OpenSession", open_request([ATTN], model=model, **kw)).response.session_id
    geo = Geometry(0, block_bytes, block_bytes, num_blocks)
    segment = GuardedSegment(geo.end)
    out = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, [0])]))
    assert out.ok, out
    return sid, segment, geo


def maps_of_self(name: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(name in line for line in maps)


# ---------------------------------------------------------------------------------------------------------------------
# Wire and validation


def test_fuzz_finding_span_past_uint32_is_invalid_argument(fuzz_daemon, wire):
    """Today: OpenSession answers INTERNAL "ValueError: Value out of range" building GroupPlacement.span_tokens or
    hit_alignment_tokens (uint32) when block_size x dcp_size, or the lcm of the spans, passes 2**32 - 1."""
    dcp_span = open_request([pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=2**31)], tp=2, dcp=2, u=1, heads=2)
    lcm = open_request(
        [pb.KVCacheGroup(kind=pb.MLA, block_size=2**32 - 1), pb.KVCacheGroup(kind=pb.MLA, block_size=2**32 - 2)], u=1
    )
    for req in (dcp_span, lcm):
        check_clean(wire.rpc("OpenSession", req), {BAD}, what=req)
    fuzz_daemon.check()


def test_fuzz_finding_undecodable_request_is_invalid_argument(fuzz_daemon, wire):
    """Today: bytes that are not a valid protobuf get UNKNOWN ("Unexpected DecodeError") from grpc's deserializer,
    logged at ERROR with a traceback, never reaching the servicer's error mapping."""
    for method, payload in (("OpenSession", b"\xff"), ("Save", b"\x12\x05ab"), ("OpenSession", b"\x42\x02\xc3\x28")):
        check_clean(wire.raw(method, payload), {BAD}, what=(method, payload))
    fuzz_daemon.check()


def test_fuzz_finding_refusal_reasons_reach_the_client(fuzz_daemon, wire):
    """Today: reasons echo client input unbounded (a model name, a shm name), so a 20 kB name makes the status
    details exceed the client's 16 KiB metadata limit: the client sees RESOURCE_EXHAUSTED "Stream removed (received
    metadata size exceeds hard limit)" instead of INVALID_ARGUMENT and the reason."""
    out = wire.rpc("OpenSession", open_request([ATTN], model="@" * 20_000))
    check_clean(out, {BAD})
    sid = wire.rpc("OpenSession", open_request([ATTN])).response.session_id
    long_name = pb.MemoryRegion(
        shm=pb.SharedMemoryHandle(name="n" * 20_000), mapping_bytes=1, block_bytes=1, num_blocks=1, groups=[0]
    )
    check_clean(wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[long_name])), {BAD})
    wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=sid))
    fuzz_daemon.check()


def test_fuzz_finding_reset_of_a_key_prefix_the_store_refuses_is_not_internal(fuzz_daemon, wire):
    """Today: a 100 000-character model name opens, saves and looks up fine, but Reset makes Mooncake's
    remove_by_regex return -600; the StoreError is not a RequestError, so the status table answered INTERNAL, with
    a 100 kB reason the client cannot even receive (RESOURCE_EXHAUSTED "Stream removed"). Either bound the model
    name (and cache_prefix) at OpenSession, or map store errors of Reset/RegisterMemory to a clean status."""
    opened = wire.rpc("OpenSession", open_request([ATTN], model="x" * 100_000))
    if not opened.ok:
        check_clean(opened, {BAD})
        return
    sid = opened.response.session_id
    out = wire.rpc("Reset", pb.ResetRequest(session_id=sid))
    wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=sid))
    # Not RESOURCE_EXHAUSTED: the request is tiny; that code is the client failing to receive an oversized reason.
    allowed = {OK, BAD, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE}
    assert out.code in allowed and (out.ok or 0 < len(out.details) < 4096), out


def test_fuzz_finding_huge_parallel_sizes_are_refused_promptly(fuzz_daemon, wire):
    """Today: OpenSession accepts tp_size = 2**22 with a mamba group and builds one key prefix per namespace (4 M
    strings, ~4 s and ~0.5 GB, held for the session's life; 2**32 - 1 exhausts memory). It runs on the 2-thread
    lookup pool, so two such requests stall every tenant's lookups. The contract sets no bound on the sizes."""
    req = open_request([pb.KVCacheGroup(kind=pb.MAMBA, block_size=16)], tp=2**22)
    start = time.monotonic()
    out = wire.rpc("OpenSession", req, timeout=60)
    elapsed = time.monotonic() - start
    if out.ok:
        wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=out.response.session_id))
    check_clean(out, {BAD})
    assert elapsed < 2.0, f"refusing an absurd tp_size took {elapsed:.1f} s"


# ---------------------------------------------------------------------------------------------------------------------
# Memory the daemon maps


@pytest.fixture
def own_daemon(tmp_path) -> Iterator[FuzzDaemon]:
    """A daemon process and master of this test alone (the repro may kill the daemon, whose segment would stay
    mounted on a shared master, failing other daemons' puts placed there until the master's client TTL)."""
    with EmbeddedMaster() as master:
        daemon = FuzzDaemon(tmp_path, master=master.address).start()
        yield daemon
        daemon.stop()


def test_fuzz_finding_segment_shrunk_after_register_does_not_kill_the_daemon(own_daemon):
    """Today: a rank registers its segment, then ftruncate()s it to 0 (any process owning the segment can): the
    daemon's next Save reads the now unbacked pages and dies of SIGBUS (exit -7), taking every tenant down.
    Mitigations: sealed memfds (F_SEAL_SHRINK) passed instead of /dev/shm names, or copying through the fd
    (pread/pwrite: EFAULT, not SIGBUS) for shm regions; at least posix_fallocate at registration for the sparse-file
    variant (a Load into never-touched pages of a sparse segment on a full /dev/shm also raises SIGBUS)."""
    wire = Wire(own_daemon.target)
    segment = None
    try:
        sid, segment, _ = open_registered(wire, "org/Shrunk", num_blocks=8, block_bytes=65536)
        ok = wire.rpc(
            "Save",
            pb.SaveRequest(session_id=sid, block_hashes=H[:2], block_ids=[pb.BlockIds(ids=[0, 1])], num_tokens=32),
        )
        assert ok.ok, ok
        segment.truncate(0)
        saved = wire.rpc(
            "Save",
            pb.SaveRequest(
                session_id=sid, block_hashes=H[:6], block_ids=[pb.BlockIds(ids=list(range(6)))], num_tokens=96
            ),
        )
        time.sleep(0.5)
        own_daemon.check()
        check_clean(saved, what="save from a shrunk segment")
    finally:
        wire.close()
        if segment is not None:
            segment.close()


def test_fuzz_finding_another_live_sessions_segment_is_refused(fuzz_daemon, wire):
    """Today: any client can name any segment in /dev/shm in RegisterMemory; the daemon (root, or the engines'
    user) opens it. Session B registers session A's live segment, Saves A's KV bytes under B's own keys (reads
    another tenant's cache) and Loads into it (poisons another tenant's cache). The daemon never checks that the
    caller owns the segment (SO_PEERCRED uid/pid against the file's owner), nor that no other live session maps it."""
    a_sid, a_segment, a_geo = open_registered(wire, f"org/TenantA-{secrets.token_hex(3)}", prefix="tenant-a")
    b_sid = wire.rpc("OpenSession", open_request([ATTN], model="org/TenantB", prefix="tenant-b")).response.session_id
    try:
        stolen = region(a_segment, a_geo, [0])
        out = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=b_sid, regions=[stolen]))
        if out.ok:
            wire.rpc(
                "Save",
                pb.SaveRequest(session_id=b_sid, block_hashes=H[:1], block_ids=[pb.BlockIds(ids=[0])], num_tokens=16),
            )
            hit = wire.rpc("Lookup", pb.LookupRequest(session_id=b_sid, block_hashes=H[:1], num_tokens=17)).response
            load = pb.LoadRequest(
                session_id=b_sid,
                block_hashes=H[:1],
                block_ids=[pb.BlockIds(ids=[1])],
                hit_tokens=hit.hit_tokens,
                tail_boundaries=hit.tail_boundaries,
            )
            wire.rpc("Load", load)
            changed = a_segment.changed()
            raise AssertionError(
                f"session B registered session A's live segment; B's load then changed A's memory at {changed[:3]}"
            )
        check_clean(out, {grpc.StatusCode.PERMISSION_DENIED, BAD})
    finally:
        wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=b_sid))
        wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=a_sid))
        a_segment.close()


# ---------------------------------------------------------------------------------------------------------------------
# Races between registration and the session's end (in-process daemon, a store slow to register buffers)


class SlowStore(MemoryStore):
    """A MemoryStore whose register_buffer takes `delay` seconds (like pinning tens of GiB for RDMA) and whose
    health check takes `health_delay` seconds (like a master that answers slowly)."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0
        self.health_delay = 0.0
        self.fail_register: Exception | None = None
        self.registering = threading.Event()  # set once a registration is in the store

    def register_buffer(self, address: int, size: int) -> None:
        self.registering.set()
        time.sleep(self.delay)
        if self.fail_register is not None:
            raise self.fail_register
        super().register_buffer(address, size)

    def health(self):
        time.sleep(self.health_delay)
        return super().health()


@pytest.fixture
def slow(tmp_path) -> Iterator[tuple[InProcessDaemon, SlowStore]]:
    store = SlowStore()
    daemon = InProcessDaemon(tmp_path, store, session_ttl=1.0, allow_shm_names=True).start()
    yield daemon, store
    daemon.stop()


def _mapped(daemon: InProcessDaemon) -> float:
    return daemon.sample("kvsidecar_registered_region_bytes")


def test_fuzz_finding_registration_outliving_its_lease_leaks_the_mapping(slow):
    """Today: RegisterMemory holds the session with sessions.get(), not use(), so the lease sweeper may expire the
    session while its memory is being mapped and registered; the handler then attaches the mapping to the dead
    session and answers OK. The mapping (and the store's buffer registration) is never released, and the client's
    next call gets NOT_FOUND, re-opens and registers the same memory again."""
    daemon, store = slow
    wire = Wire(daemon.target)
    segment = GuardedSegment(4 * 4096)
    try:
        sid = wire.rpc("OpenSession", open_request([ATTN])).response.session_id
        store.delay = 2.5  # longer than the 1 s lease (the sweeper runs every second)
        geo = Geometry(0, 4096, 4096, 4)
        reg = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, [0])]))
        store.delay = 0.0
        alive = wire.rpc("KeepAlive", pb.KeepAliveRequest(session_id=sid))
        if reg.ok:
            assert alive.ok, "RegisterMemory answered OK for a session that had already expired"
        else:
            check_clean(reg, {GONE})
            assert _mapped(daemon) == 0 and maps_of_self(segment.name) == 1, "an expired session's memory is mapped"
    finally:
        wire.close()
        segment.close()


def test_fuzz_finding_close_during_registration_leaks_the_mapping(slow):
    """Today: CloseSession while RegisterMemory is mapping releases a session with no memory yet; the registration
    then completes on the closed session and answers OK: the mapping and the store registration leak forever."""
    daemon, store = slow
    wire = Wire(daemon.target)
    segment = GuardedSegment(4 * 4096)
    try:
        sid = wire.rpc("OpenSession", open_request([ATTN])).response.session_id
        store.delay = 0.8
        geo = Geometry(0, 4096, 4096, 4)
        result = {}
        req = pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, [0])])
        t = threading.Thread(target=lambda: result.setdefault("reg", wire.rpc("RegisterMemory", req)))
        t.start()
        assert store.registering.wait(30), "RegisterMemory never reached the store"
        assert wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=sid)).ok
        t.join(30)
        store.delay = 0.0
        wait_until(
            lambda: _mapped(daemon) == 0,
            timeout=10,
            what="the closed session's mapping released",
            detail=lambda: f"{_mapped(daemon)} bytes still mapped for a closed session ({result.get('reg')})",
        )
        assert maps_of_self(segment.name) == 1, "the closed session's segment is still mapped by the daemon"
    finally:
        wire.close()
        segment.close()


def test_fuzz_finding_store_error_while_registering_is_not_internal(slow):
    """Today: a store that cannot register the buffer (StoreUnavailable: master down; any StoreError) makes
    RegisterMemory answer INTERNAL: the status table mapped only RequestError and PlacementError."""
    daemon, store = slow
    wire = Wire(daemon.target)
    segment = GuardedSegment(4096)
    try:
        sid = wire.rpc("OpenSession", open_request([ATTN])).response.session_id
        store.fail_register = StoreUnavailable("master unreachable")
        geo = Geometry(0, 4096, 4096, 1)
        out = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, [0])]))
        assert out.code is grpc.StatusCode.UNAVAILABLE and out.details, out
    finally:
        wire.close()
        segment.close()


def test_fuzz_finding_keepalive_does_not_stall_other_tenants(tmp_path):
    """Today: KeepAlive runs inline on the event loop (pool None) and calls store.health() there: Mooncake's
    health_check is a call to the master, so one client's keep-alive with a slow master stalls every other RPC of
    every tenant (here a 2 s health check delays another session's lookup by ~1.8 s)."""
    store = SlowStore()
    # The default lease: no session expires meanwhile.
    daemon = InProcessDaemon(tmp_path, store, allow_shm_names=True).start()
    wire = Wire(daemon.target)
    try:
        a = wire.rpc("OpenSession", open_request([ATTN], model="org/A")).response.session_id
        b = wire.rpc("OpenSession", open_request([ATTN], model="org/B")).response.session_id
        store.health_delay = 2.0
        t = threading.Thread(target=lambda: wire.rpc("KeepAlive", pb.KeepAliveRequest(session_id=a)))
        t.start()
        wait_until(
            lambda: daemon.sample("kvsidecar_requests_total", {"method": "KeepAlive"}) >= 1,
            timeout=30,
            what="the daemon received the keep-alive",
        )
        start = time.monotonic()
        out = wire.rpc("Lookup", pb.LookupRequest(session_id=b, block_hashes=H[:1], num_tokens=17))
        elapsed = time.monotonic() - start
        t.join(10)
        store.health_delay = 0.0
        assert out.ok, out
        assert elapsed < 0.5, f"a lookup waited {elapsed:.2f} s behind another session's keep-alive"
    finally:
        wire.close()
        daemon.stop()


# ---------------------------------------------------------------------------------------------------------------------
# Tenants


def test_fuzz_finding_unprefixed_reset_spares_other_tenants(fuzz_daemon, wire):
    """Today: Reset removes the regex prefix `<model_key>@tp_rank:`; tenant "a" with a model named "tp_rank:0" has
    keys "a@tp_rank:0@tp_rank:0@...", which start with the unprefixed model "a"'s reset prefix "a@tp_rank:". So a
    session of model "a" without a cache prefix wipes tenant "a"'s blocks. (':' is allowed in model names.)"""
    tag = secrets.token_hex(3)
    victim, segment, _ = open_registered(wire, f"org/tp_rank:{tag}", prefix=f"a{tag}", block_bytes=64)
    other = wire.rpc("OpenSession", open_request([ATTN], model=f"a{tag}")).response.session_id
    try:
        saved = wire.rpc(
            "Save",
            pb.SaveRequest(session_id=victim, block_hashes=H[:1], block_ids=[pb.BlockIds(ids=[0])], num_tokens=16),
        )
        assert saved.ok and saved.response.written == 1, saved
        removed = wire.rpc("Reset", pb.ResetRequest(session_id=other))
        assert removed.ok, removed
        hit = wire.rpc("Lookup", pb.LookupRequest(session_id=victim, block_hashes=H[:1], num_tokens=17)).response
        assert hit.hit_tokens == 16, f"another tenant's reset removed {removed.response.removed} of tenant a's blocks"
    finally:
        for sid in (victim, other):
            wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=sid))
        segment.close()
