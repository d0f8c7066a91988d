"""Fuzzing the real daemon's requests field by field, over its real socket, against a real master.

Property of every case: success, or a contract error code with a reason; the daemon process lives and answers; no
byte of any guarded segment changes except inside the block slices a Load of the owning session named; a lookup's
answer, passed to Load unchanged, is never refused; and the well-behaved client beside the fuzzer keeps getting its
own bytes back.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.fuzzsessions import Guarded, check_memory, close_all, loaded_ids
from support.fuzzstrategies import (
    U32_MAX,
    U64_MAX,
    SessionShape,
    chain,
    load_requests,
    lookup_requests,
    open_requests,
    save_requests,
)
from support.fuzzwire import Wire, check_clean, fuzz_settings
from support.guarded import Geometry, GuardedSegment, region

pytestmark = pytest.mark.integration

OK = grpc.StatusCode.OK
BAD = grpc.StatusCode.INVALID_ARGUMENT
GONE = grpc.StatusCode.NOT_FOUND
ORDER = grpc.StatusCode.FAILED_PRECONDITION
DENIED = grpc.StatusCode.PERMISSION_DENIED

POOL = [chain(f"fuzz-pool-{i}", 40, 64) for i in range(3)]


def load_lookup_answer(wire: Wire, owner: Guarded, shape: SessionShape, hashes, hit: pb.LookupResponse, rng) -> None:
    """Rule 10 from the outside: a lookup's hit and tails, passed to Load unchanged, are never refused.

    The ids come from `rng` (seeded by a draw), not from hypothesis: what is drawn must not depend on the daemon's
    answers, which differ when a case is replayed."""
    ids = [
        pb.BlockIds(ids=[rng.randrange(shape.num_blocks) for _ in range(-(-hit.hit_tokens // s))]) for s in shape.spans
    ]
    req = pb.LoadRequest(
        session_id=owner.session,
        block_hashes=hashes,
        block_ids=ids,
        hit_tokens=hit.hit_tokens,
        tail_boundaries=hit.tail_boundaries,
    )
    loaded = wire.rpc("Load", req)
    event(f"Load of a lookup's answer: {loaded.code.name}{' with a hit' if hit.hit_tokens else ''}")
    check_clean(loaded, {OK}, what=(hit, len(hashes)))
    check_memory([owner], owner, loaded, ids)
    if hit.hit_tokens:
        assert loaded.response.loaded + len(loaded.response.failures) > 0, (hit, loaded.response)


# ---------------------------------------------------------------------------------------------------------------------
# 1. OpenSession with any fields; whatever opens is registered, saved into, looked up and loaded from.


@fuzz_settings(300)
@given(req=open_requests(), data=st.data())
def test_fuzz_open_session_then_use_it(fuzz_daemon, wire, good_client, req, data):
    opened = wire.rpc("OpenSession", req)
    event(f"OpenSession {opened.code.name}")
    check_clean(opened, {OK, BAD}, what=req)
    if not opened.ok:
        fuzz_daemon.check()
        return
    resp = opened.response
    n = len(req.groups)
    assert resp.session_id and resp.lease_ms > 0 and resp.hit_alignment_tokens > 0, resp
    assert len(resp.groups) == n and all(g.span_tokens > 0 for g in resp.groups), resp
    sid = resp.session_id
    segments: list[GuardedSegment] = []
    try:
        nb = data.draw(st.integers(1, 12))
        rng = random.Random(data.draw(st.integers(0, 2**32)))
        shape = SessionShape.of(req, resp, nb)
        looked = wire.rpc("Lookup", data.draw(lookup_requests(sid, shape, POOL)))
        check_clean(looked, {OK, BAD, GONE})
        if req.role != pb.ROLE_RANK:
            check_clean(wire.rpc("Save", data.draw(save_requests(sid, shape, POOL))), {DENIED, BAD, GONE})
            return
        bb = data.draw(st.integers(1, 64))
        geo = Geometry(data.draw(st.integers(0, 64)), bb + data.draw(st.integers(0, 16)), bb, nb)
        segment = GuardedSegment(geo.end + data.draw(st.integers(0, 64)))
        segments.append(segment)
        owner = Guarded(sid, [[(segment, geo)] for _ in range(n)], [segment])
        reg = wire.rpc(
            "RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, list(range(n)))])
        )
        check_clean(reg, {OK}, what=geo)
        assert list(reg.response.value_bytes) == [bb] * n, reg.response
        save = data.draw(save_requests(sid, shape, POOL))
        saved = wire.rpc("Save", save)
        event(f"Save {saved.code.name}")
        check_clean(saved, {OK, BAD} if save.session_id == sid else {GONE}, what=save)
        check_memory([owner], None, saved)
        if saved.ok:
            assert saved.response.failed == len(saved.response.failures), saved.response
        hashes = list(save.block_hashes) if all(len(h) == req.hash_bytes for h in save.block_hashes) else []
        looked = wire.rpc("Lookup", pb.LookupRequest(session_id=sid, block_hashes=hashes, num_tokens=save.num_tokens))
        check_clean(looked, {OK, BAD}, what=(len(hashes), save.num_tokens))
        if looked.ok:
            hit = looked.response
            assert len(hit.tail_boundaries) == n and hit.hit_tokens < max(1, save.num_tokens), hit
            assert hit.hit_tokens % resp.hit_alignment_tokens == 0, (hit, resp.hit_alignment_tokens)
            load_lookup_answer(wire, owner, shape, hashes, hit, rng)
        load = data.draw(load_requests(sid, shape, POOL))
        loaded = wire.rpc("Load", load)
        check_clean(loaded, {OK, BAD} if load.session_id == sid else {GONE}, what=load)
        check_memory([owner], owner, loaded, load.block_ids)
    finally:
        close_all(wire, [sid], segments)
        fuzz_daemon.check()
    good_client.check()


# ---------------------------------------------------------------------------------------------------------------------
# 2. Data requests with any field values, against an arena of long-lived sessions in every state.

NA, NB = 16, 40  # blocks of session A and of session B: B's ids past 15 are "another session's" ids for A
BB = 96


@dataclass
class Arena:
    wire: Wire
    a: Guarded
    b: Guarded
    sessions: dict[str, str]  # state name -> session id
    shapes: dict[str, SessionShape]


def _register(wire: Wire, sid: str, regions: list[pb.MemoryRegion]) -> None:
    out = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=regions))
    assert out.ok, out


@pytest.fixture(scope="module")
def arena(fuzz_daemon, wire) -> Iterator[Arena]:
    tag = secrets.token_hex(3)

    def open_(groups, *, hb=32, role=pb.ROLE_RANK, model="org/ArenaA") -> str:
        req = pb.OpenSessionRequest(
            engine=pb.EngineIdentity(model=f"{model}-{tag}", cache_prefix="arena"),
            parallel=pb.ParallelLayout(tp_size=1),
            num_kv_heads=1,
            hash_block_size=16,
            groups=groups,
            hash_bytes=hb,
            role=role,
            client_name="fuzz-arena",
        )
        out = wire.rpc("OpenSession", req)
        assert out.ok, out
        return out.response.session_id

    a_groups = [
        pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16),
        pb.KVCacheGroup(kind=pb.MAMBA, block_size=32),
        pb.KVCacheGroup(kind=pb.SLIDING_WINDOW, block_size=16, window=32),
    ]
    sid_a = open_(a_groups)
    # A: group 0 is two regions (K in an interleaved segment, V with canary gaps), group 2 shares K's segment
    # (its slices sit in the gaps between K's), group 1 (mamba) starts at byte 0 of its segment.
    k = Geometry(128, 2 * BB, BB, NA)
    swa = Geometry(128 + BB, 2 * BB, BB, NA)
    v = Geometry(64, BB + 32, BB, NA)
    state = Geometry(0, 2 * BB, 2 * BB, NA)
    s1, s2, s3 = GuardedSegment(k.end + BB + 77), GuardedSegment(v.end + 50), GuardedSegment(state.end + 100)
    _register(wire, sid_a, [region(s1, k, [0]), region(s2, v, [0]), region(s3, state, [1]), region(s1, swa, [2])])
    a = Guarded(sid_a, [[(s1, k), (s2, v)], [(s3, state)], [(s1, swa)]], [s1, s2, s3])

    b_groups = [
        pb.KVCacheGroup(kind=pb.MLA, block_size=32),
        pb.KVCacheGroup(kind=pb.UNIFORM, block_size=16, inner=[pb.MLA, pb.FULL_ATTENTION]),
    ]
    sid_b = open_(b_groups, hb=8, model="org/ArenaB")
    shared = Geometry(256, 3 * BB, 2 * BB, NB)  # one region serves both groups
    s4 = GuardedSegment(shared.end + 300)
    _register(wire, sid_b, [region(s4, shared, [0, 1])])
    b = Guarded(sid_b, [[(s4, shared)], [(s4, shared)]], [s4])

    scheduler = open_(a_groups, role=pb.ROLE_SCHEDULER)
    unregistered = open_(a_groups)
    closed = open_(b_groups, hb=8, model="org/ArenaB")
    assert wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=closed)).ok
    shape_a = SessionShape(16, 32, (16, 32, 16), (False, True, False), 16, NA, NB)
    shape_b = SessionShape(16, 8, (32, 16), (False, False), 32, NB, NA + 8)
    yield Arena(
        wire,
        a,
        b,
        sessions={"a": sid_a, "b": sid_b, "scheduler": scheduler, "unregistered": unregistered, "closed": closed},
        shapes={"a": shape_a, "b": shape_b, "scheduler": shape_a, "unregistered": shape_a, "closed": shape_b},
    )
    close_all(wire, [sid_a, sid_b, scheduler, unregistered], [s1, s2, s3, s4])


def expected(method: str, target: str) -> set[grpc.StatusCode]:
    """The codes a request may get from a session in this state (bad fields always may get INVALID_ARGUMENT)."""
    if target == "closed":
        return {GONE}
    if method in ("Lookup", "KeepAlive"):
        return {OK, BAD}
    if method in ("SaveBatch", "LoadBatch") and target in ("scheduler", "unregistered"):
        return {DENIED if target == "scheduler" else ORDER, BAD}
    if method == "RegisterMemory":
        return {DENIED} if target == "scheduler" else {ORDER, BAD}
    if target == "scheduler":
        return {DENIED, BAD}
    if target == "unregistered":
        return {ORDER, BAD}
    return {OK, BAD}


@st.composite
def arena_ops(draw, arena: Arena):
    target = draw(st.sampled_from(("a", "a", "a", "b", "b", "scheduler", "unregistered", "closed")))
    method = draw(
        st.sampled_from(
            ("Save", "Save", "Load", "Load", "Load", "Lookup", "Lookup", "KeepAlive", "Reg", "SaveBatch", "LoadBatch")
        )
    )
    sid, shape = arena.sessions[target], arena.shapes[target]
    if method in ("SaveBatch", "LoadBatch"):
        # Items are drawn (and mutated, their session ids too, which a batch ignores) like lone requests; the
        # first item's session id is the batch's. Names come from a small alphabet so that some repeat.
        single = save_requests if method == "SaveBatch" else load_requests
        items = draw(st.lists(single(sid, shape, POOL), min_size=1, max_size=4))
        names = draw(st.lists(st.sampled_from("abcdefgh"), min_size=len(items), max_size=len(items)))
        if method == "SaveBatch":
            req = pb.SaveBatchRequest(
                session_id=items[0].session_id,
                items=[pb.SaveItem(name=n, request=r) for n, r in zip(names, items, strict=True)],
            )
        else:
            req = pb.LoadBatchRequest(
                session_id=items[0].session_id,
                items=[pb.LoadItem(name=n, request=r) for n, r in zip(names, items, strict=True)],
            )
    elif method == "Save":
        req = draw(save_requests(sid, shape, POOL))
    elif method == "Load":
        req = draw(load_requests(sid, shape, POOL))
    elif method == "Lookup":
        req = draw(lookup_requests(sid, shape, POOL))
    elif method == "KeepAlive":
        req = pb.KeepAliveRequest(session_id=sid)
    else:
        method = "RegisterMemory"
        req = pb.RegisterMemoryRequest(
            session_id=sid,
            regions=[pb.MemoryRegion(shm=pb.SharedMemoryHandle(name=arena.a.segments[0].name), mapping_bytes=1)],
        )
    return target, method, req


@fuzz_settings(450)
@given(data=st.data())
def test_fuzz_data_requests_against_sessions_in_every_state(fuzz_daemon, arena, good_client, data):
    owners = {"a": arena.a, "b": arena.b}
    seed = data.draw(st.integers(0, 2**32))
    for _ in range(data.draw(st.integers(1, 6))):
        target, method, req = data.draw(arena_ops(arena))
        out = arena.wire.rpc(method, req)
        event(f"{method} on {target}: {out.code.name}")
        allowed = expected(method, target) if req.session_id == arena.sessions[target] else {GONE}
        check_clean(out, allowed, what=f"{target}: {str(req)[:1500]}")
        writer = owners.get(target) if req.session_id == arena.sessions[target] else None
        check_memory([arena.a, arena.b], writer, out, loaded_ids(method, req, out))
        if method in ("SaveBatch", "LoadBatch") and out.ok:
            check_items(req, out.response)
        if method == "Lookup" and out.ok and writer is not None and out.response.hit_tokens:
            hashes = list(req.block_hashes)
            rng = random.Random(seed)
            load_lookup_answer(arena.wire, writer, arena.shapes[target], hashes, out.response, rng)
        if method == "Save" and out.ok:
            assert out.response.failed == len(out.response.failures), out.response
            assert all(f.reason for f in out.response.failures), out.response
    fuzz_daemon.check()
    good_client.check()


def check_items(req, response) -> None:
    """Every item answered once, in order, by name; an item's error is a contract code with a reason."""
    assert [r.name for r in response.results] == [i.name for i in req.items], response
    for result in response.results:
        if result.WhichOneof("outcome") == "error":
            assert result.error.code == BAD.value[0] and result.error.reason, result
        elif isinstance(result, pb.SaveItemResult):
            assert result.response.failed == len(result.response.failures), result
            assert all(f.reason for f in result.response.failures), result
        else:
            assert result.WhichOneof("outcome") == "response", result


# ---------------------------------------------------------------------------------------------------------------------
# 3. Limits: messages over the size limit and counts over the contract's limits.


def test_fuzz_limits_are_refused_with_reasons(fuzz_daemon, wire, arena, good_client):
    sid_a, sid_b = arena.sessions["a"], arena.sessions["b"]
    over_size = pb.LookupRequest(session_id=sid_a, block_hashes=[b"h" * 32] * (65 * (1 << 20) // 34), num_tokens=1)
    check_clean(wire.rpc("Lookup", over_size, timeout=60), {grpc.StatusCode.RESOURCE_EXHAUSTED})
    too_many_hashes = pb.LookupRequest(session_id=sid_b, block_hashes=[b"h" * 8] * ((1 << 20) + 1))
    check_clean(wire.rpc("Lookup", too_many_hashes, timeout=60), {BAD})
    too_many_ids = pb.SaveRequest(session_id=sid_a, block_ids=[pb.BlockIds(ids=[0] * ((1 << 20) + 1))] * 3)
    check_clean(wire.rpc("Save", too_many_ids, timeout=60), {BAD})
    too_many_groups = pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model="org/Limits"),
        parallel=pb.ParallelLayout(tp_size=1),
        num_kv_heads=1,
        hash_block_size=16,
        groups=[pb.KVCacheGroup(kind=pb.MLA, block_size=16)] * 65,
        hash_bytes=32,
        role=pb.ROLE_RANK,
    )
    check_clean(wire.rpc("OpenSession", too_many_groups), {BAD})
    too_many_regions = pb.RegisterMemoryRequest(
        session_id=arena.sessions["unregistered"],
        regions=[pb.MemoryRegion(shm=pb.SharedMemoryHandle(name="nope"), mapping_bytes=1)] * 4097,
    )
    check_clean(wire.rpc("RegisterMemory", too_many_regions), {BAD})
    extremes = pb.LoadRequest(
        session_id=sid_a,
        block_hashes=[h[:32] for h in POOL[0][:2]],
        block_ids=[pb.BlockIds(ids=[U32_MAX])] * 3,
        hit_tokens=U64_MAX,
        tail_boundaries=[U64_MAX] * 3,
        start_tokens=U64_MAX,
    )
    check_clean(wire.rpc("Load", extremes), {BAD})
    check_memory([arena.a, arena.b], None, wire.rpc("Stats", pb.StatsRequest()))
    fuzz_daemon.check()
    good_client.check()
