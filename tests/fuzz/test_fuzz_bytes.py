"""Fuzzing the wire itself: valid requests of every method, truncated, bit-flipped, spliced and padded, sent as raw
bytes through a generic channel with identity serializers, so the daemon sees exactly the bytes meant.

Bytes that still parse as the request type must get a clean answer (and a Load among them may write only its own
session's named slices); bytes that do not parse must be refused as INVALID_ARGUMENT with a reason.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st

from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.fuzzsessions import Guarded, check_memory, close_all, loaded_ids
from support.fuzzstrategies import SessionShape, chain, load_requests, lookup_requests, save_requests
from support.fuzzwire import METHODS, Wire, check_clean, fuzz_settings
from support.guarded import Geometry, GuardedSegment, region

pytestmark = pytest.mark.integration

POOL = [chain(f"fuzz-bytes-{i}", 24) for i in range(2)]
NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def target(wire: Wire) -> Iterator[tuple[Guarded, SessionShape]]:
    """A registered rank session [full_attention/16, mamba/32] whose memory is guarded."""
    req = pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model=f"org/Bytes-{secrets.token_hex(3)}"),
        parallel=pb.ParallelLayout(tp_size=1),
        num_kv_heads=1,
        hash_block_size=16,
        groups=[pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16), pb.KVCacheGroup(kind=pb.MAMBA, block_size=32)],
        hash_bytes=32,
        role=pb.ROLE_RANK,
    )
    opened = wire.rpc("OpenSession", req)
    sid = opened.response.session_id
    geos = [Geometry(40, 80, 64, NUM_BLOCKS), Geometry(40 + 64, 80, 16, NUM_BLOCKS)]
    segment = GuardedSegment(geos[0].end + 64)
    regs = [region(segment, geos[0], [0]), region(segment, geos[1], [1])]
    assert wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=regs)).ok
    yield (
        Guarded(sid, [[(segment, geos[0])], [(segment, geos[1])]], [segment]),
        SessionShape.of(req, opened.response, NUM_BLOCKS),
    )
    close_all(wire, [sid], [segment])


@st.composite
def valid_message(draw, guarded: Guarded, shape: SessionShape) -> tuple[str, bytes]:
    """A method and a valid serialized request for it (on the guarded session where it takes one)."""
    sid = guarded.session
    method = draw(st.sampled_from(sorted(METHODS)))
    if method == "Save":
        msg = draw(save_requests(sid, shape, POOL))
    elif method == "Load":
        msg = draw(load_requests(sid, shape, POOL))
    elif method == "Lookup":
        msg = draw(lookup_requests(sid, shape, POOL))
    elif method in ("SaveBatch", "LoadBatch"):
        single, item, batch = (
            (save_requests, pb.SaveItem, pb.SaveBatchRequest)
            if method == "SaveBatch"
            else (load_requests, pb.LoadItem, pb.LoadBatchRequest)
        )
        requests = draw(st.lists(single(sid, shape, POOL), min_size=1, max_size=3))
        msg = batch(session_id=sid, items=[item(name=str(i), request=r) for i, r in enumerate(requests)])
    elif method == "OpenSession":
        msg = pb.OpenSessionRequest(
            engine=pb.EngineIdentity(model="org/Bytes-open"),
            parallel=pb.ParallelLayout(tp_size=2, tp_rank=1),
            num_kv_heads=2,
            hash_block_size=16,
            groups=[pb.KVCacheGroup(kind=pb.SLIDING_WINDOW, block_size=32, window=64)],
            hash_bytes=16,
            role=pb.ROLE_SCHEDULER,
        )
    elif method == "RegisterMemory":
        msg = pb.RegisterMemoryRequest(
            session_id=sid, regions=[region(guarded.segments[0], guarded.groups[0][0][1], [0])]
        )
    elif method == "Stats":
        msg = pb.StatsRequest()
    elif method == "Reset":
        msg = pb.ResetRequest(session_id="not-a-session")  # resetting the target would only slow the suite
    else:
        msg = METHODS[method][0](session_id=draw(st.sampled_from((sid, "not-a-session"))))
    return method, msg.SerializeToString()


@st.composite
def mangled(draw, payload: bytes) -> bytes:
    """The payload cut, flipped, spliced or padded (one to three times)."""
    for _ in range(draw(st.integers(1, 3))):
        n = len(payload)
        how = draw(st.integers(0, 8))
        at = draw(st.integers(0, n))
        if how == 0:
            payload = payload[:at]  # truncated
        elif how == 1 and n:
            i = draw(st.integers(0, n - 1))
            payload = payload[:i] + bytes([payload[i] ^ (1 << draw(st.integers(0, 7)))]) + payload[i + 1 :]
        elif how == 2:
            payload = payload[:at] + draw(st.binary(min_size=1, max_size=16)) + payload[at:]
        elif how == 3:
            payload = payload + draw(st.binary(min_size=1, max_size=32))
        elif how == 4:
            payload = payload + payload  # a repeated message merges: last scalar wins, lists concatenate
        elif how == 5:
            # a field header with a length far past the end (or a varint that never ends)
            payload = payload[:at] + draw(st.sampled_from((b"\x12\xff\xff\xff\xff\x0f", b"\x0a\x80", b"\xff" * 11)))
        elif how == 6:
            payload = draw(st.binary(max_size=64))
        elif how == 7:
            # a known field number with another wire type (field 2 as a fixed64, field 1 as a varint)
            payload = draw(st.sampled_from((b"\x11", b"\x08", b"\x15", b"\x13"))) + payload
        else:
            payload = payload[at:]
    return payload


def decoded(method: str, payload: bytes):
    try:
        return METHODS[method][0].FromString(payload)
    except DecodeError:
        return None


@fuzz_settings(500)
@given(data=st.data())
def test_fuzz_mangled_bytes_that_still_parse_get_clean_answers(fuzz_daemon, wire, target, good_client, data):
    guarded, shape = target
    method, payload = data.draw(valid_message(guarded, shape))
    payload = data.draw(mangled(payload))
    msg = decoded(method, payload)
    if msg is None:
        event("undecodable (left to the next test)")
        return
    out = wire.raw(method, payload)
    event(f"{method} {out.code.name}")
    check_clean(out, what=f"{method} {payload!r}")
    writes = method in ("Load", "LoadBatch") and msg.session_id == guarded.session
    check_memory([guarded], guarded if writes else None, out, loaded_ids(method, msg, out) if writes else ())
    fuzz_daemon.check()
    good_client.check()


@fuzz_settings(150)
@given(data=st.data())
def test_fuzz_bytes_that_do_not_parse_are_invalid_argument(fuzz_daemon, wire, target, good_client, data):
    guarded, shape = target
    method, payload = data.draw(valid_message(guarded, shape))
    payload = data.draw(mangled(payload))
    if decoded(method, payload) is not None:
        event("parses (left to the previous test)")
        return
    out = wire.raw(method, payload)
    event(f"{method} {out.code.name}")
    check_clean(out, {grpc.StatusCode.INVALID_ARGUMENT}, what=f"{method} {payload!r}")
    check_memory([guarded], None, out)
    fuzz_daemon.check()
    good_client.check()
