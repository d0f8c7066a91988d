"""Fuzzing layouts end to end: every rank of a random engine saves a prompt, a lookup hits it, every rank loads it.

The bytes each rank writes come from the engine-side oracle (`kvsidecar_testing.oracle`: what a rank holds for its
heads, latent, state shard, sequence slice and stage), never from the placement rules; so a load that brings back a
block another replication set wrote is caught as foreign bytes, and any other wrong byte as corruption. The hit length
is checked against rule 9 stated from the outside (everything saved: the prompt's last U boundary, rounded down to
the hit alignment), and every write outside the loaded blocks' slices is caught by the guarded segments.
"""

from __future__ import annotations

import secrets

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_testing import oracle
from support.fuzzsessions import Guarded, check_memory, close_all
from support.fuzzstrategies import chain, valid_open_requests
from support.fuzzwire import check_clean, fuzz_settings
from support.guarded import Geometry, GuardedSegment, region

pytestmark = pytest.mark.integration

OK = grpc.StatusCode.OK
NUM_BLOCKS = 32  # ids [0, 16) hold the computed prompt, [16, 32) receive the load
SUB_SLICE = 8  # bytes per U tokens of an attention block


def rank_requests(req: pb.OpenSessionRequest) -> list[tuple[tuple[int, int, int], pb.OpenSessionRequest]]:
    """((tp, pcp, pp), request) for every rank of the engine."""
    p = req.parallel
    out = []
    for tp in range(p.tp_size):
        for pcp in range(p.pcp_size or 1):
            for pp in range(p.pp_size or 1):
                r = pb.OpenSessionRequest()
                r.CopyFrom(req)
                r.parallel.tp_rank, r.parallel.pcp_rank, r.parallel.pp_rank = tp, pcp, pp
                out.append(((tp, pcp, pp), r))
    return out


@fuzz_settings(80)
@given(req=valid_open_requests(max_ranks=4), data=st.data())
def test_fuzz_every_rank_of_any_layout_loads_its_replication_sets_bytes(fuzz_daemon, wire, good_client, req, data):
    req.engine.model = f"org/Engine-{secrets.token_hex(4)}"
    req.role = pb.ROLE_RANK
    # Short hashes collide (1 byte: 256 values), and colliding prefixes share keys by design: the oracle needs
    # every prefix of the prompt to have its own hash.
    req.hash_bytes = max(req.hash_bytes, 8)
    u = req.hash_block_size
    views = oracle.views(req)
    sizes = [max(1, v.span // u) * SUB_SLICE for v in views]
    k = data.draw(st.integers(1, 12))
    tokens = k * u + data.draw(st.integers(0, u - 1))
    hashes = chain(secrets.token_hex(4), k, req.hash_bytes)
    layout = oracle.layout_of(req)
    sessions: list[str] = []
    segments: list[GuardedSegment] = []
    ranks = []
    try:
        for rank, r in rank_requests(req):
            opened = wire.rpc("OpenSession", r)
            check_clean(opened, {OK}, what=r)
            sessions.append(opened.response.session_id)
            assert [g.span_tokens for g in opened.response.groups] == [v.span for v in views], opened.response
            stride = sum(sizes) + 16
            geos, offset = [], 32
            for size in sizes:  # one segment per rank, the groups' slices interleaved, canary gaps between blocks
                geos.append(Geometry(offset, stride, size, NUM_BLOCKS))
                offset += size
            segment = GuardedSegment(geos[-1].end + 16 + 32)
            segments.append(segment)
            sid = opened.response.session_id
            regs = [region(segment, geo, [g]) for g, geo in enumerate(geos)]
            check_clean(wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=regs)), {OK})
            idents = [oracle.identity(req.engine.model, layout, g, *rank) for g in range(len(views))]
            ranks.append((rank, sid, Guarded(sid, [[(segment, geo)] for geo in geos], [segment]), idents))
            for g, (view, geo) in enumerate(zip(views, geos, strict=True)):
                for i in range(tokens // view.span + 1):
                    data_ = oracle.computed_block(idents[g], view, u, hashes, i, tokens, geo.block_bytes)
                    segment.write(geo.slice_of(i)[0], data_)
            unit = opened.response.hit_alignment_tokens
        src = [pb.BlockIds(ids=list(range(tokens // v.span + 1))) for v in views]
        for _, sid, owner, _ in ranks:
            saved = wire.rpc(
                "Save", pb.SaveRequest(session_id=sid, block_hashes=hashes, block_ids=src, num_tokens=tokens)
            )
            check_clean(saved, {OK})
            assert saved.response.failed == 0, saved.response
            check_memory([owner], None, saved)
        looked = wire.rpc(
            "Lookup", pb.LookupRequest(session_id=ranks[0][1], block_hashes=hashes, num_tokens=tokens + 1)
        )
        check_clean(looked, {OK})
        hit = looked.response
        assert hit.hit_tokens == (k * u) // unit * unit, (hit, k, u, unit, tokens)
        event(f"hit {'>' if hit.hit_tokens else '='} 0")
        dst = [pb.BlockIds(ids=[16 + i for i in range(-(-hit.hit_tokens // v.span))]) for v in views]
        others = [idents for _, _, _, idents in ranks]
        for rank, sid, owner, idents in ranks:
            for seg in owner.segments:  # the blocks that receive the load start as poison
                for regions_ in owner.groups:
                    for _, geo in regions_:
                        for b in range(16, NUM_BLOCKS):
                            seg.write(geo.slice_of(b)[0], bytes([oracle.POISON]) * geo.block_bytes)
            load = pb.LoadRequest(
                session_id=sid,
                block_hashes=hashes,
                block_ids=dst,
                hit_tokens=hit.hit_tokens,
                tail_boundaries=hit.tail_boundaries,
            )
            loaded = wire.rpc("Load", load)
            check_clean(loaded, {OK})
            assert not loaded.response.failures, loaded.response
            check_memory([owner], owner, loaded, dst)
            verify_rank(rank, owner, idents, others, views, u, hashes, hit)
    finally:
        close_all(wire, sessions, segments)
        fuzz_daemon.check()
    good_client.check()


def expected(ident, view, u, hashes, index, hit: pb.LookupResponse, tail, n):
    return oracle.expected_loaded(ident, view, u, hashes, index, hit.hit_tokens, tail, n)


def verify_rank(rank, owner: Guarded, idents, others, views, u, hashes, hit: pb.LookupResponse) -> None:
    """Every block the engine needs holds this rank's bytes; every other receiving block is still poison."""
    for g, view in enumerate(views):
        segment, geo = owner.groups[g][0]
        needed = oracle.needed_blocks(view, hit.hit_tokens)
        tail = hit.tail_boundaries[g]
        for i in range(NUM_BLOCKS - 16):
            start, _ = geo.slice_of(16 + i)
            got = segment.read(start, geo.block_bytes)
            if i not in needed:
                assert got == bytes([oracle.POISON]) * geo.block_bytes, f"rank {rank} group {g}: block {i} written"
                continue
            for offset, want in oracle.expected_loaded(idents[g], view, u, hashes, i, hit.hit_tokens, tail, len(got)):
                if got[offset : offset + len(want)] == want:
                    continue
                foreign = [
                    o[g]
                    for o in others
                    if o[g] != idents[g]
                    and any(
                        got[off : off + len(w)] == w
                        for off, w in oracle.expected_loaded(o[g], view, u, hashes, i, hit.hit_tokens, tail, len(got))
                    )
                ]
                kind = "FOREIGN bytes (another replication set's)" if foreign else "CORRUPTED bytes"
                raise AssertionError(f"rank {rank} group {g} block {i} of hit {hit.hit_tokens}: {kind} at {offset}")
