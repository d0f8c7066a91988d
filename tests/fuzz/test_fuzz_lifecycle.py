"""Fuzzing call order: a state machine opens, registers, uses, closes and re-closes sessions in any order.

Each step's answer must be the one the session's state dictates (NOT_FOUND once closed, FAILED_PRECONDITION for a
save or load before RegisterMemory or for a second RegisterMemory, PERMISSION_DENIED for a scheduler's memory
calls), memory of every session, closed ones included, changes only under its own successful loads, and the daemon
stays up.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.fuzzsessions import Guarded, check_memory
from support.fuzzstrategies import SessionShape, chain, load_requests, lookup_requests, save_requests
from support.fuzzwire import Wire, check_clean, fuzz_settings
from support.guarded import Geometry, GuardedSegment, region

pytestmark = pytest.mark.integration

OK = grpc.StatusCode.OK
BAD = grpc.StatusCode.INVALID_ARGUMENT
GONE = grpc.StatusCode.NOT_FOUND
ORDER = grpc.StatusCode.FAILED_PRECONDITION
DENIED = grpc.StatusCode.PERMISSION_DENIED

POOL = [chain(f"fuzz-life-{i}", 24) for i in range(2)]
TAG = secrets.token_hex(3)


@dataclass(frozen=True)
class LayoutCase:
    name: str
    groups: tuple[pb.KVCacheGroup, ...]
    tp: int
    rank: int
    shape: SessionShape
    num_blocks: int


def _case(name, groups, tp, rank, spans, recurrent, unit, nb, foreign) -> LayoutCase:
    return LayoutCase(name, tuple(groups), tp, rank, SessionShape(16, 32, spans, recurrent, unit, nb, foreign), nb)


LAYOUTS = (
    _case(
        "attn+mamba",
        [pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16), pb.KVCacheGroup(kind=pb.MAMBA, block_size=32)],
        1,
        0,
        (16, 32),
        (False, True),
        16,
        8,
        20,
    ),
    _case("mla tp2 r1", [pb.KVCacheGroup(kind=pb.MLA, block_size=32)], 2, 1, (32,), (False,), 32, 20, 8),
)


@dataclass
class Tracked:
    sid: str
    role: int
    layout: LayoutCase
    closed: bool = False
    guarded: Guarded | None = None


class Lifecycle(RuleBasedStateMachine):
    wire: Wire  # set by the test before running

    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        self.tracked: list[Tracked] = []
        self.segments: list[GuardedSegment] = []

    def owners(self) -> list[Guarded]:
        return [t.guarded for t in self.tracked if t.guarded is not None]

    @rule(
        target=sessions,
        role=st.sampled_from((pb.ROLE_RANK, pb.ROLE_RANK, pb.ROLE_SCHEDULER)),
        layout=st.sampled_from(LAYOUTS),
    )
    def open(self, role, layout):
        req = pb.OpenSessionRequest(
            engine=pb.EngineIdentity(model=f"org/Life-{layout.name}-{TAG}"),
            parallel=pb.ParallelLayout(tp_size=layout.tp, tp_rank=layout.rank),
            num_kv_heads=1,
            hash_block_size=16,
            groups=layout.groups,
            hash_bytes=32,
            role=role,
        )
        out = self.wire.rpc("OpenSession", req)
        check_clean(out, {OK})
        t = Tracked(out.response.session_id, role, layout)
        self.tracked.append(t)
        return t

    @rule(t=sessions, hostile=st.booleans(), data=st.data())
    def register(self, t, hostile, data):
        n = len(t.layout.groups)
        geo = Geometry(24, 80, 64, t.layout.num_blocks)
        segment = GuardedSegment(geo.end + 24)
        self.segments.append(segment)
        reg = region(segment, geo, list(range(n)))
        if hostile:
            reg.num_blocks = data.draw(st.sampled_from((t.layout.num_blocks + 1, 2**32 - 1)))
        out = self.wire.rpc("RegisterMemory", pb.RegisterMemoryRequest(session_id=t.sid, regions=[reg]))
        if t.closed:
            allowed = {GONE}
        elif t.role == pb.ROLE_SCHEDULER:
            allowed = {DENIED}
        elif t.guarded is not None:
            allowed = {ORDER, BAD} if hostile else {ORDER}
        else:
            allowed = {BAD} if hostile else {OK}
        check_clean(out, allowed)
        if out.ok:
            t.guarded = Guarded(t.sid, [[(segment, geo)] for _ in range(n)], [segment])

    def _data_codes(self, t: Tracked, method: str) -> set[grpc.StatusCode]:
        if t.closed:
            return {GONE}
        if method == "Lookup":
            return {OK, BAD}
        if t.role == pb.ROLE_SCHEDULER:
            return {DENIED, BAD}
        if t.guarded is None:
            return {ORDER, BAD}
        return {OK, BAD}

    @rule(t=sessions, other=sessions, method=st.sampled_from(("Save", "Load", "Load", "Lookup")), data=st.data())
    def data_call(self, t, other, method, data):
        # `other`'s geometry: its block ids (and block counts) are another session's range for `t`.
        shape = SessionShape(
            16, 32, t.layout.shape.spans, t.layout.shape.recurrent, t.layout.shape.unit, t.layout.num_blocks,
            other.layout.num_blocks,
        )  # fmt: skip
        strategy = {"Save": save_requests, "Load": load_requests, "Lookup": lookup_requests}[method]
        req = data.draw(strategy(t.sid, shape, POOL))
        out = self.wire.rpc(method, req)
        check_clean(out, self._data_codes(t, method) if req.session_id == t.sid else {GONE}, what=req)
        writer = t.guarded if method == "Load" and req.session_id == t.sid else None
        check_memory(self.owners(), writer, out, req.block_ids if writer is not None else ())

    @rule(t=sessions)
    def keep_alive(self, t):
        check_clean(self.wire.rpc("KeepAlive", pb.KeepAliveRequest(session_id=t.sid)), {GONE} if t.closed else {OK})

    @rule(t=sessions)
    def close(self, t):
        out = self.wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=t.sid))
        check_clean(out, {GONE} if t.closed else {OK})
        t.closed = True

    @rule()
    def stats(self):
        check_clean(self.wire.rpc("Stats", pb.StatsRequest()), {OK})

    @invariant()
    def memory_untouched(self):
        # Every rule that may write has already accepted its allowed writes: anything else changed is a stray write
        # (into a closed session's memory too).
        for owner in self.owners():
            for segment in owner.segments:
                assert not segment.changed(), f"bytes of {segment.name} changed between steps"

    def teardown(self):
        for t in self.tracked:
            if not t.closed:
                self.wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=t.sid))
        for segment in self.segments:
            segment.close()


def test_fuzz_calls_in_any_order(fuzz_daemon, wire, good_client):
    class Machine(Lifecycle):
        pass

    Machine.wire = wire
    run_state_machine_as_test(Machine, settings=fuzz_settings(60, stateful_step_count=30))
    fuzz_daemon.check()
    good_client.check()
