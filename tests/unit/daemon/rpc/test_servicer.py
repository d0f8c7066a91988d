"""The servicer called directly, as grpc's own examples test servicers: unpack, ask tenancy or the data path, reply.

No socket and no daemon: each row's gRPC behaviour over a dispatcher and the in-memory store (support/servicer.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from kvsidecar.cli import status
from kvsidecar.errors import BadRequest, TooLate
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.rpc.handlers import Call
from kvsidecar.store import StoreHealth
from kvsidecar.tenancy.table import hash_token
from kvsidecar.tenancy.tickets import PeerCred
from kvsidecar_contract.methods import BY_NAME
from kvsidecar_contract.paths import TICKET_METADATA
from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.rawrank import group, open_request
from support.servicer import Context, call, refused, sample, service

TOKEN_A = "token-of-team-a"


def ticket(svc: Dispatcher, uid: int) -> Context:
    """A Unix caller whose side-socket ticket proves uid."""
    issued = svc.handlers.tenancy.tickets.issue(PeerCred(pid=os.getpid(), uid=uid, gid=uid, groups=frozenset({uid})))
    return Context(metadata=[(TICKET_METADATA, issued)])


def tenants_file(tmp_path: Path, a_prefixes: str = '["team-a"]') -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenants.a]\nuids = [4001]\ntokens = ["{hash_token(TOKEN_A)}"]\nprefixes = {a_prefixes}\n\n'
        '[tenants.b]\nuids = [4002]\nprefixes = ["team-b"]\nshm_names = true\n\n'
        '[tenants.ops]\nuids = [4003]\nprefixes = ["ops"]\nadmin = true\n'
    )
    return path


OPEN_A = open_request([group("full_attention", 16)], prefix="team-a")
OPEN_B = open_request([group("full_attention", 16)], prefix="team-b")


def test_a_single_tenant_session_opens_with_no_rights_beyond_the_defaults():
    svc = service()
    answer = call(svc, "OpenSession", OPEN_A)
    assert answer.session_id and answer.tenant == "" and answer.lease_ms == 30_000
    (session,) = svc.handlers.sessions.snapshot()
    assert session.id == answer.session_id and not session.shm_names
    assert sample(svc, "kvsidecar_requests_total", {"method": "OpenSession"}) == 1


def test_tenancy_grants_sessions_with_each_tenants_own_rights(tmp_path):
    svc = service(tenants_file(tmp_path))
    a = call(svc, "OpenSession", OPEN_A, ticket(svc, 4001))
    b = call(svc, "OpenSession", OPEN_B, ticket(svc, 4002))
    assert (a.tenant, b.tenant) == ("a", "b")
    rights = {s.tenant: s.shm_names for s in svc.handlers.sessions.snapshot()}
    assert rights == {"a": False, "b": True}
    # A side secret only for callers the side socket can prove (a ticket's uid).
    assert a.side_secret == b"" or len(a.side_secret) == 24


def test_a_refused_open_names_the_reason_and_is_counted_by_tenancy(tmp_path):
    svc = service(tenants_file(tmp_path))
    err = refused(svc, "OpenSession", OPEN_B, ticket(svc, 4001))
    assert err.code is grpc.StatusCode.PERMISSION_DENIED and "tenant a may not open sessions" in err.details
    err = refused(svc, "OpenSession", OPEN_A)  # no ticket: no credential
    assert err.code is grpc.StatusCode.PERMISSION_DENIED and "no tenant's credential" in err.details
    assert sample(svc, "kvsidecar_tenant_refused_total", {"tenant": "a", "reason": "permission"}) == 1
    assert sample(svc, "kvsidecar_tenant_refused_total", {"tenant": "none", "reason": "permission"}) == 1
    assert sample(svc, "kvsidecar_requests_rejected_total", {"method": "OpenSession", "code": "PERMISSION_DENIED"}) == 2
    assert not svc.handlers.sessions.snapshot()


def test_a_token_sent_twice_is_refused_not_read_two_ways(tmp_path):
    svc = service(tenants_file(tmp_path))
    tcp = [("authorization", f"Bearer {TOKEN_A}")]
    assert call(svc, "OpenSession", OPEN_A, Context(peer="ipv4:127.0.0.1:5", metadata=tcp)).tenant == "a"
    twice = Context(peer="ipv4:127.0.0.1:5", metadata=[*tcp, ("authorization", "Bearer someone-else")])
    err = refused(svc, "OpenSession", OPEN_A, twice)
    assert err.code is grpc.StatusCode.UNAUTHENTICATED and "2 'authorization' headers" in err.details


def test_reset_asks_tenancy_again_after_a_reload(tmp_path):
    path = tenants_file(tmp_path)
    svc = service(path)
    a = call(svc, "OpenSession", OPEN_A, ticket(svc, 4001))
    assert call(svc, "Reset", pb.ResetRequest(session_id=a.session_id)).removed == 0
    path.write_text(path.read_text().replace('prefixes = ["team-a"]', 'prefixes = ["team-a2"]'))
    svc.handlers.tenancy.reload()
    err = refused(svc, "Reset", pb.ResetRequest(session_id=a.session_id))
    assert err.code is grpc.StatusCode.PERMISSION_DENIED and err.details.startswith("Reset refused: ")
    assert sample(svc, "kvsidecar_tenant_refused_total", {"tenant": "a", "reason": "permission"}) == 1


def test_stats_shows_a_tenant_its_own_and_an_admin_everything(tmp_path):
    svc = service(tenants_file(tmp_path))
    call(svc, "OpenSession", OPEN_A, ticket(svc, 4001))
    call(svc, "OpenSession", OPEN_B, ticket(svc, 4002))
    mine = call(svc, "Stats", pb.StatsRequest(), ticket(svc, 4001))
    assert [s.tenant for s in mine.sessions] == ["a"] and mine.caller_tenant == "a"
    everything = call(svc, "Stats", pb.StatsRequest(), ticket(svc, 4003))
    assert sorted(s.tenant for s in everything.sessions) == ["a", "b"]
    err = refused(svc, "Stats", pb.StatsRequest(), ticket(svc, 4999))
    assert err.code is grpc.StatusCode.PERMISSION_DENIED and "uid 4999 is no tenant's credential" in err.details


def test_a_failed_gpu_path_reaches_stats_and_makes_status_exit_1():
    failure = "cuda:0: an illegal memory access was encountered"
    for svc, healthy in ((service(), True), (service(gpu_failure=failure), False)):
        svc.handlers.health = StoreHealth(True, "master reachable")
        stats = call(svc, "Stats", pb.StatsRequest())
        assert stats.gpu_failure == ("" if healthy else failure)
        info = {"serving": True, "store_serving": True, **MessageToDict(stats, preserving_proto_field_name=True)}
        assert status.exit_code(info) == (status.EXIT_HEALTHY if healthy else status.EXIT_STORE_DOWN)
        assert status.exit_code(info, live_only=True) == status.EXIT_HEALTHY


def test_stats_counts_the_disk_tier_only_on_a_daemon_that_has_one():
    svc = service()
    counters = call(svc, "Stats", pb.StatsRequest()).counters
    assert "kvsidecar_saved_bytes_total" in counters
    assert not [name for name in counters if name.startswith("kvsidecar_disk_tier_")], sorted(counters)
    svc.metrics.tier_capacity_bytes.labels("disk").set(256 << 20)  # what a disk tier sets at start (tiers/node.py)
    assert "kvsidecar_disk_tier_written_bytes_total" in call(svc, "Stats", pb.StatsRequest()).counters
    svc.shutdown()


def test_the_boundary_answers_garbage_unknown_sessions_and_shutdown_with_their_statuses():
    svc = service()
    err = refused(svc, "Lookup", b"\xff\xff\xff")
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT and "not a valid kvsidecar.v1.LookupRequest" in err.details
    err = refused(svc, "KeepAlive", pb.KeepAliveRequest(session_id="nope"))
    assert err.code is grpc.StatusCode.NOT_FOUND and "unknown session" in err.details
    session = call(svc, "OpenSession", OPEN_A).session_id
    save = pb.SaveRequest(session_id=session, block_hashes=[b"\x01" * 32], block_ids=[pb.BlockIds(ids=[0])])
    err = refused(svc, "Save", save)
    assert err.code is grpc.StatusCode.FAILED_PRECONDITION and "RegisterMemory" in err.details
    svc.stop_accepting()
    err = refused(svc, "KeepAlive", pb.KeepAliveRequest(session_id=session))
    assert err.code is grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details
    assert sample(svc, "kvsidecar_requests_rejected_total", {"method": "KeepAlive", "code": "UNAVAILABLE"}) == 1
    svc.shutdown()


def test_a_lookup_is_answered_from_the_data_path():
    svc = service()
    scheduler = call(svc, "OpenSession", open_request([group("full_attention", 16)], role=pb.ROLE_SCHEDULER))
    request = pb.LookupRequest(session_id=scheduler.session_id, block_hashes=[b"\x01" * 32], num_tokens=17)
    answer = call(svc, "Lookup", request)
    assert (answer.hit_tokens, answer.degraded) == (0, False)
    assert sample(svc, "kvsidecar_lookup_requests_total", {"outcome": "miss"}) == 1
    packed = pb.LookupRequest(session_id=scheduler.session_id, packed_block_hashes=b"\x01" * 32, num_tokens=17)
    assert call(svc, "Lookup", packed).hit_tokens == 0
    packed.block_hashes.append(b"\x01" * 32)
    err = refused(svc, "Lookup", packed)
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT and "both set" in err.details


def test_a_data_socket_lookup_answers_as_grpc_draws_on_the_same_slots_and_is_bounded_in_size():
    svc = service()
    scheduler = call(svc, "OpenSession", open_request([group("full_attention", 16)], role=pb.ROLE_SCHEDULER))
    sid = scheduler.session_id
    request = pb.LookupRequest(session_id=sid, packed_block_hashes=b"\x01" * 64, num_tokens=33)
    lookup = BY_NAME["Lookup"]

    def frame(request: Any, time_left: float | None = None) -> Any:
        """The call as the data socket runs it, on this thread."""
        return svc.run_here(lookup, request.SerializeToString(), Call.of_peer(None, time_left), bound_to=sid)

    assert frame(request) == call(svc, "Lookup", request)
    assert sample(svc, "kvsidecar_requests_total", {"method": "Lookup"}) == 2  # counted once each, either way in
    # The account's one lookup slot is held (by a gRPC lookup, say): past the call's deadline the frame is refused.
    with svc.gates.hold_blocking(svc.handlers.sessions.account_of(sid), None), pytest.raises(TooLate) as held:
        frame(request, 0.05)
    code, reason = svc.refused("Lookup", held.value)
    # DEADLINE_EXCEEDED, as over gRPC: the client's lookup answers a degraded miss either way.
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED and "--lookups-per-account" in reason
    # A frame too big for --max-lookup-hashes is refused before it is parsed, as over gRPC.
    svc.handlers.datapath.max_lookup_hashes = 4
    big = pb.LookupRequest(session_id=sid, block_hashes=[b"\x02" * 32] * 5000, num_tokens=80_001)
    with pytest.raises(BadRequest, match="--max-lookup-hashes 4 hashes"):
        frame(big)
    svc.shutdown()


def test_a_lookup_past_the_per_call_limit_is_refused_naming_it():
    svc = service()
    svc.handlers.datapath.max_lookup_hashes = 4
    scheduler = call(svc, "OpenSession", open_request([group("full_attention", 16)], role=pb.ROLE_SCHEDULER))
    hashes = [bytes([i]) * 32 for i in range(1, 6)]
    err = refused(svc, "Lookup", pb.LookupRequest(session_id=scheduler.session_id, block_hashes=hashes, num_tokens=81))
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "a Lookup of 5 block hashes: at most 4 per call (--max-lookup-hashes)" in err.details
    answer = call(
        svc, "Lookup", pb.LookupRequest(session_id=scheduler.session_id, block_hashes=hashes[:4], num_tokens=65)
    )
    assert answer.hit_tokens == 0
    svc.shutdown()
