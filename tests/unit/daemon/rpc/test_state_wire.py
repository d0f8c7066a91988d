"""Rule 12 on the wire: a recurrent state layout crosses it field for field, the daemon opens a session with it, and
a state that cannot be cut or described is refused at OpenSession with INVALID_ARGUMENT and the reason."""

from __future__ import annotations

import re
from typing import Any

import grpc
import pytest

from kvsidecar.rpc import wire
from kvsidecar_contract.placement import InvalidLayout, RecurrentState
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.state_wire import state_from_message, state_to_message
from kvsidecar_testing.states import GatedDeltaNet, Kda, Mamba2
from support.rawrank import group, open_request
from support.servicer import call, refused, service

STATES = [
    Mamba2(8, 4, 2, 16).state(),
    Mamba2(8, 4, 1, 16, dim_first=True).state(),
    GatedDeltaNet(2, 4, 8, 16).state(),
    Kda(4, 8, dim_first=True).state(),
]


def hybrid(state: RecurrentState | pb.RecurrentState, *, tp: int = 1, rank: int = 0, share: int = 8):
    """An OpenSession of a Mamba-and-attention hybrid whose recurrent group carries `state`."""
    message = state if isinstance(state, pb.RecurrentState) else state_to_message(state)
    recurrent = group("mamba", 16)
    recurrent.state.CopyFrom(message)
    req = open_request([group("full_attention", 16), recurrent], tp=tp, rank=rank, heads=8)
    req.share_tp_size = share
    return req


@pytest.mark.parametrize("state", STATES, ids=["mamba2", "mamba2-ds-repeat", "gdn", "kda-ds"])
def test_a_state_layout_crosses_the_wire_field_for_field(state):
    message = pb.RecurrentState.FromString(state_to_message(state).SerializeToString())
    assert state_from_message(message) == state
    _, layout, _ = wire.open_request(hybrid(state))
    assert layout.groups[1].state == state and layout.groups[0].state is None
    assert layout.shared(1)


def test_the_daemons_value_id_of_a_piece_is_one_at_every_tp_size_and_differs_with_the_conv_states_orientation():
    sd, ds = Mamba2(8, 4, 1, 16).state(), Mamba2(8, 4, 1, 16, dim_first=True).state()
    ids = {wire.open_request(hybrid(sd, tp=t, rank=t - 1))[1].group_value_id(1) for t in (1, 2, 4, 8)}
    assert len(ids) == 1
    assert wire.open_request(hybrid(ds))[1].group_value_id(1) not in ids
    # Per layout the state's layout still joins the session's id: SD and DS never share a key there either.
    per_layout = {wire.open_request(hybrid(s, share=0))[1].group_value_id(1) for s in (sd, ds)}
    assert len(per_layout) == 2


def _bad(**fields: Any) -> pb.RecurrentState:
    message = state_to_message(Mamba2(8, 4, 2, 16).state())
    for path, value in fields.items():
        target: Any = message
        *parents, name = path.split("__")
        for part in parents:
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        setattr(target, name, value)
    return message


@pytest.mark.parametrize(
    ("req", "reason"),
    [
        # Cannot be cut: vLLM cannot shard it over T, or a rank of T would hold part of a piece.
        (hybrid(Mamba2(8, 4, 2, 16).state(), tp=4), "group 1 .*state axis groups of 2 cannot be sharded over 4"),
        (hybrid(Mamba2(8, 4, 1, 16).state(), tp=4, share=2), "stores state axis heads in pieces of 4; a TP=4 rank"),
        (hybrid(Mamba2(6, 4, 1, 16).state(), share=4), "share_tp_size 4 would cut state axis heads of 6 into 4"),
        # Cannot be described: what the core refuses of any state, named with its group.
        (hybrid(_bad(axes__0__size=0)), "group 1: its recurrent state layout: state axis heads must have 1 to"),
        (hybrid(_bad(tensors__1__inner=0)), "group 1: its recurrent state layout: state tensor 1: outer and inner"),
        (hybrid(_bad(tensors__0__segments__1__axis=5)), "a segment names axis 5, the state has 2"),
        (hybrid(pb.RecurrentState()), "group 1: its recurrent state layout: a recurrent state needs 1 to 8 axes"),
    ],
    ids=["unshardable", "part-of-a-piece", "uneven-pieces", "empty-axis", "no-inner", "unknown-axis", "empty"],
)
def test_a_state_that_cannot_be_cut_or_described_is_refused_at_open_session_with_the_reason(req, reason):
    svc = service()
    err = refused(svc, "OpenSession", req)
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(reason, err.details), err.details
    assert not svc.handlers.sessions.snapshot()


def test_a_state_on_an_attention_group_is_refused_with_the_reason():
    req = hybrid(Mamba2(8, 4, 2, 16).state())
    req.groups[0].state.CopyFrom(req.groups[1].state)
    with pytest.raises(InvalidLayout, match="only a group whose members are all recurrent has one"):
        wire.open_request(req)


def test_an_oversized_state_message_is_refused_before_anything_is_built():
    message = pb.RecurrentState(axes=[pb.StateAxis(name="a", size=1)] * 1000)
    with pytest.raises(InvalidLayout, match="at most 8 axes and 16 tensors, got 1000 and 0"):
        wire.open_request(hybrid(message))


def test_a_session_with_a_cuttable_state_opens():
    svc = service()
    answer = call(svc, "OpenSession", hybrid(Mamba2(8, 4, 2, 16).state(), tp=2, rank=1))
    assert answer.session_id
    (session,) = svc.handlers.sessions.snapshot()
    # Rank 1 of TP 2 holds heads 4-7 and group 1: five pieces of the state group's block.
    assert session.layout.values_per_block(1) == 5
