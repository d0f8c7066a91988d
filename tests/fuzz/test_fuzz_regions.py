"""Fuzzing RegisterMemory: hostile geometry (overflowing offsets and strides, mapping_bytes past the segment, blocks
past the mapping) and hostile handles (path tricks, missing segments, CUDA handles on a CPU daemon, another live
session's segment). Whatever the daemon accepts is then saved from and loaded into with bytes that move, so any
write outside the accepted regions, or into someone else's memory, changes a guarded byte and fails the case."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.fuzzsessions import Guarded, check_memory, close_all
from support.fuzzstrategies import EDGE_U64, U32_MAX, U64_MAX, chain, mutated, u32, u64
from support.fuzzwire import Wire, check_clean, fuzz_settings
from support.guarded import Geometry, GuardedSegment, region

pytestmark = pytest.mark.integration

OK = grpc.StatusCode.OK
BAD = grpc.StatusCode.INVALID_ARGUMENT


def rank_request(model: str, groups: int = 1) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model=f"{model}-{secrets.token_hex(3)}"),
        parallel=pb.ParallelLayout(tp_size=1),
        num_kv_heads=1,
        hash_block_size=16,
        groups=[pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16)] * groups,
        hash_bytes=32,
        role=pb.ROLE_RANK,
    )


@dataclass
class Victim:
    session: str
    segment: GuardedSegment
    owner: Guarded


def open_victim(wire: Wire) -> Victim:
    """A live, registered session whose memory nobody else may touch (a fresh one per case, so a case that
    writes into it is the case that fails)."""
    sid = wire.rpc("OpenSession", rank_request("org/Victim")).response.session_id
    geo = Geometry(0, 256, 256, 8)
    segment = GuardedSegment(geo.end)
    out = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, [0])]))
    assert out.ok, out
    return Victim(sid, segment, Guarded(sid, [[(segment, geo)]], [segment]))


SHM_TRICKS = ("", "/", ".", "..", "...", "../x", "a/b", "/dev/shm/x", "x\x00y", "é", "-", "x" * 256, "no-such-0000")


def _m_name(draw, r):
    r.shm.name = draw(st.sampled_from(SHM_TRICKS))


def _m_cuda(draw, r):
    r.cuda.device = draw(u32)
    r.cuda.handle = draw(st.binary(max_size=80))
    r.cuda.storage_size = draw(u64)
    r.cuda.storage_offset = draw(u64)


def _m_no_handle(draw, r):
    r.ClearField("shm")


def _u64(*values: int) -> st.SearchStrategy[int]:
    return st.sampled_from(tuple(min(max(0, v), U64_MAX) for v in values))


def _edge(r) -> st.SearchStrategy[int]:
    size = r.mapping_bytes
    return st.one_of(_u64(0, 1, size - 1, size, size + 1, 2 * size, U32_MAX + 1), st.sampled_from(EDGE_U64))


def _m_mapping(draw, r):
    r.mapping_bytes = draw(_edge(r))


def _m_offset(draw, r):
    r.offset = draw(st.one_of(_edge(r), _u64(r.offset + 1, r.offset + 64)))


def _m_stride(draw, r):
    r.block_stride = draw(st.one_of(_u64(0, 1, r.block_bytes - 1, r.block_bytes + 1), u64))


def _m_block_bytes(draw, r):
    r.block_bytes = draw(st.one_of(_u64(0, r.block_stride, r.block_stride + 1), u64))


def _m_num_blocks(draw, r):
    r.num_blocks = draw(
        st.one_of(st.sampled_from(tuple(min(v, U32_MAX) for v in (0, r.num_blocks + 1, r.num_blocks * 2))), u32)
    )


def _m_groups(draw, r):
    del r.groups[:]
    r.groups.extend(draw(st.lists(st.sampled_from((0, 0, 1, 2, U32_MAX)), max_size=3)))


REGION_MUTATIONS = (
    _m_name,
    _m_cuda,
    _m_no_handle,
    _m_mapping,
    _m_offset,
    _m_offset,
    _m_stride,
    _m_stride,
    _m_block_bytes,
    _m_num_blocks,
    _m_num_blocks,
    _m_groups,
)


@st.composite
def regions(draw, own: list[GuardedSegment], victim: GuardedSegment) -> tuple[pb.MemoryRegion, GuardedSegment | None]:
    """A region that fits one of our segments (or, sometimes, the victim's), mutated; and the segment it names."""
    target = victim if draw(st.integers(0, 11)) == 0 else draw(st.sampled_from(own))
    bb = draw(st.integers(1, max(1, min(256, target.size))))
    stride = bb + draw(st.sampled_from((0, 0, 1, 7, 64)))
    room = target.size - bb
    nb = draw(st.integers(1, max(1, min(12, room // stride + 1)))) if room >= 0 else 1
    offset = draw(st.integers(0, max(0, target.size - ((nb - 1) * stride + bb))))
    name = target.name if draw(st.integers(0, 3)) else "/" + target.name
    reg = region(target, Geometry(offset, stride, bb, nb), [0])
    reg.shm.name = name
    reg = mutated(draw, reg, REGION_MUTATIONS)
    named = reg.shm.name.lstrip("/") if reg.WhichOneof("handle") == "shm" else ""
    return reg, next((s for s in [*own, victim] if s.name == named), None)


@fuzz_settings(300)
@given(data=st.data())
def test_fuzz_hostile_regions_never_reach_outside_them(fuzz_daemon, wire, good_client, data):
    own = [GuardedSegment(data.draw(st.integers(1, 4096))) for _ in range(2)]
    victim = open_victim(wire)
    sid = wire.rpc("OpenSession", rank_request("org/Hostile")).response.session_id
    try:
        drawn = data.draw(st.lists(regions(own, victim.segment), min_size=1, max_size=4))
        regs = [r for r, _ in drawn]
        out = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=regs))
        event(f"RegisterMemory {out.code.name}")
        # PERMISSION_DENIED: the regions name the victim's segment, which another live session owns.
        check_clean(out, {OK, BAD, grpc.StatusCode.PERMISSION_DENIED}, what=regs)
        if not out.ok:
            for segment in [*own, victim.segment]:
                assert not segment.changed(), f"a refused registration changed {segment.name}"
            return
        assert all(s is not None for _, s in drawn), f"accepted a region naming no segment of ours: {regs}"
        geos = [(s, Geometry(r.offset, r.block_stride, r.block_bytes, r.num_blocks)) for r, s in drawn]
        for segment, geo in geos:
            # The daemon checked the region against the segment's real size: it must lie inside it.
            assert geo.end <= segment.size, f"accepted a region ending at {geo.end} in a {segment.size}-byte segment"
        if any(segment is victim.segment for segment, _ in geos):
            event("RegisterMemory accepted another live session's segment")
        hostile = Guarded(sid, [geos], [s for s in own if any(s is g for g, _ in geos)])
        k = min(6, *(geo.num_blocks for _, geo in geos))
        hashes = chain(secrets.token_hex(4), k)
        src = [pb.BlockIds(ids=list(range(k)))]
        saved = wire.rpc("Save", pb.SaveRequest(session_id=sid, block_hashes=hashes, block_ids=src, num_tokens=16 * k))
        check_clean(saved, {OK})
        check_memory([hostile, victim.owner], None, saved)
        looked = wire.rpc("Lookup", pb.LookupRequest(session_id=sid, block_hashes=hashes, num_tokens=16 * k + 1))
        check_clean(looked, {OK})
        # Read block i back into block i + 1 (mod k): the bytes move, so a write anywhere shows.
        dst = [pb.BlockIds(ids=[(i + 1) % k for i in range(k)])]
        load = pb.LoadRequest(
            session_id=sid,
            block_hashes=hashes,
            block_ids=dst,
            hit_tokens=looked.response.hit_tokens,
            tail_boundaries=looked.response.tail_boundaries,
        )
        loaded = wire.rpc("Load", load)
        check_clean(loaded, {OK})
        check_memory([hostile, victim.owner], hostile, loaded, dst)
    finally:
        close_all(wire, [sid, victim.session], [*own, victim.segment])
        fuzz_daemon.check()
    good_client.check()
