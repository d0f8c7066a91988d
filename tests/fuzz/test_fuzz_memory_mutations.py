"""Fuzz: a rank mutates its registered memory (punches holes, truncates, grows, rewrites) between Saves and Loads.

Whatever it does, the daemon answers each call with success or INVALID_ARGUMENT naming what happened to the memory
("lost pages after registration", "shrank"), never touches a page that is gone, and serves on; a call after
mutations that removed no page succeeds. The well-behaved client of the fuzz suite runs beside it throughout.
"""

from __future__ import annotations

import ctypes
import os
import secrets

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.fuzzwire import Wire, check_clean, fuzz_settings
from support.guarded import Geometry, GuardedSegment, region

pytestmark = pytest.mark.integration

PAGE = 4096
BLOCKS, BLOCK_BYTES = 8, 4 * PAGE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE

MUTATION = st.one_of(
    st.tuples(st.just("punch"), st.integers(0, BLOCKS * 4 - 1), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, BLOCKS * 4 - 1), st.just(0)),
    st.tuples(st.just("grow"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("write"), st.integers(0, BLOCKS * 4 - 1), st.integers(1, 255)),
)


def mutate(segment: GuardedSegment, op: str, a: int, b: int) -> None:
    """Apply one mutation as the owning rank would."""
    fd = os.open(segment.path, os.O_RDWR)
    try:
        if op == "punch":
            assert _libc.fallocate(fd, PUNCH, a * PAGE, b * PAGE) == 0
            return
        if op == "truncate":
            segment.truncated = True  # the test stops reading its own mapping
            os.ftruncate(fd, a * PAGE)
            return
        if op == "grow":
            segment.truncated = True
            os.ftruncate(fd, os.fstat(fd).st_size + a * PAGE)  # a sparse tail: unbacked pages
            return
        os.pwrite(fd, bytes([b]) * 64, a * PAGE)
    finally:
        os.close(fd)


def open_request() -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model="org/Mutations", cache_prefix="mutations"),
        parallel=pb.ParallelLayout(tp_size=1, tp_rank=0, dcp_size=1),
        num_kv_heads=1, hash_block_size=16, hash_bytes=32, role=pb.ROLE_RANK, client_name="mutations",
        groups=[pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16)],
    )  # fmt: skip


@fuzz_settings(25)
@given(mutations=st.lists(MUTATION, max_size=4))
def test_fuzz_memory_mutated_after_registration(fuzz_daemon, mutations):
    wire = Wire(fuzz_daemon.target)
    geo = Geometry(0, BLOCK_BYTES, BLOCK_BYTES, BLOCKS)
    segment = GuardedSegment(geo.end)
    try:
        sid = wire.rpc("OpenSession", open_request()).response.session_id
        out = wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, [0])]))
        assert out.ok, out
        for op, a, b in mutations:
            mutate(segment, op, a, b)
        st_now = os.stat(segment.path)
        # Pages gone (a write may have backed a punched page again), or the file shrank or grew a sparse tail.
        harmed = st_now.st_blocks * 512 < st_now.st_size or st_now.st_size < geo.end
        hashes = [secrets.token_bytes(32) for _ in range(4)]
        ids = [pb.BlockIds(ids=[0, 1, 2, 3])]
        calls = [
            ("Save", pb.SaveRequest(session_id=sid, block_hashes=hashes, block_ids=ids, num_tokens=64)),
            ("Load", pb.LoadRequest(session_id=sid, block_hashes=hashes, block_ids=ids, hit_tokens=64)),
        ]
        for method, request in calls:
            answer = wire.rpc(method, request)
            check_clean(answer, what=f"{method} after {mutations}")
            if not harmed:
                assert answer.ok or method == "Load", (method, answer)
            elif not answer.ok and answer.code is grpc.StatusCode.INVALID_ARGUMENT:
                assert "after registration" in answer.details or "shrank" in answer.details, answer
            if harmed and method == "Save":
                assert not answer.ok, f"Save from memory that lost pages succeeded: {mutations}"
        fuzz_daemon.check()
        wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=sid))
    finally:
        wire.close()
        segment.close()
