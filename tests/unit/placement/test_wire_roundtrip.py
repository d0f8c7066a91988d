"""The session's shape on the wire: every layout the contract accepts comes back from its message exactly.

The client sends `to_message`, the daemon reads `from_message`: a field one side forgets is a layout the daemon runs
that the client did not plan, so the round trip must be the identity on every field, group state included where the
wire carries it.
"""

from __future__ import annotations

import dataclasses
import pickle

from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from kvsidecar_client import EngineLayout, SessionSpec
from kvsidecar_client import GroupSpec as ClientGroupSpec
from kvsidecar_contract.mapping import from_message, to_message
from kvsidecar_contract.placement import (
    GroupSpec,
    InvalidLayout,
    Kind,
    Layout,
    Parallel,
    RecurrentState,
    gated_delta_net_state,
    mamba2_state,
)
from kvsidecar_contract.proto import sidecar_pb2 as pb

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIMPLE = [Kind.FULL_ATTENTION, Kind.SLIDING_WINDOW, Kind.MLA, Kind.SLIDING_WINDOW_MLA, Kind.MAMBA]


def states() -> st.SearchStrategy[RecurrentState]:
    # Sizes every TP size drawn below (1, 2, 4, 8) shards: the Layout checks the state against its own TP size.
    return st.one_of(
        st.builds(
            mamba2_state,
            num_heads=st.sampled_from([8, 16, 64]),
            head_dim=st.sampled_from([16, 64]),
            state_size=st.sampled_from([16, 128]),
            n_groups=st.sampled_from([1, 8]),
            conv_kernel=st.sampled_from([2, 4]),
            conv_bytes=st.sampled_from([2, 4]),
            ssm_bytes=st.sampled_from([2, 4]),
            conv_dim_first=st.booleans(),
        ),
        st.builds(
            gated_delta_net_state,
            num_k_heads=st.sampled_from([8, 16]),
            num_v_heads=st.sampled_from([16, 32]),
            head_k_dim=st.sampled_from([32, 128]),
            head_v_dim=st.sampled_from([32, 128]),
            conv_kernel=st.just(4),
            conv_bytes=st.just(2),
            ssm_bytes=st.sampled_from([2, 4]),
            num_spec=st.sampled_from([0, 1]),
        ),
    )


@st.composite
def groups(draw: st.DrawFn, u: int, with_state: bool) -> GroupSpec:
    block = u * draw(st.integers(1, 4))
    if draw(st.integers(0, 3)) == 0:
        inner = tuple(draw(st.lists(st.sampled_from(SIMPLE), min_size=1, max_size=3)))
        window = u * draw(st.integers(1, 64)) if any(k.sliding for k in inner) else 0
        return GroupSpec(Kind.UNIFORM, block, window, inner)
    kind = draw(st.sampled_from(SIMPLE))
    state = draw(st.none() | states()) if kind is Kind.MAMBA and with_state else None
    return GroupSpec(kind, block, u * draw(st.integers(1, 64)) if kind.sliding else 0, state=state)


@st.composite
def layouts(draw: st.DrawFn, with_state: bool = True) -> Layout:
    t = draw(st.sampled_from([1, 2, 4, 8]))
    c = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([x for x in (1, 2, 4) if t % x == 0] if c == 1 else sorted({1, c, t * c})))
    p = draw(st.sampled_from([1, 2, 4]))
    parallel = Parallel(
        tp_size=t,
        tp_rank=draw(st.integers(0, t - 1)),
        pp_size=p,
        pp_rank=draw(st.integers(0, p - 1)),
        pcp_size=c,
        pcp_rank=draw(st.integers(0, c - 1)),
        dcp_size=d,
    )
    u = draw(st.sampled_from([1, 4, 16]))
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    share = 0 if d > 1 or c > 1 else draw(st.sampled_from([0, 0, heads, max(t, heads)]))
    fine = draw(st.sampled_from([None, False, True]))
    fields = dict(
        model=draw(st.sampled_from(["org/Model", "Model", "a/b/c-7B"])),
        groups=tuple(draw(st.lists(groups(u, with_state), min_size=1, max_size=4))),
        parallel=parallel,
        num_kv_heads=heads,
        hash_block_size=u,
        cache_prefix=draw(st.sampled_from(["", "tenant-a"])),
        hit_alignment_tokens=u if fine else draw(st.sampled_from([0, 0, u * 64])),
        fine_grained_hits=fine,
        value_identity=draw(st.sampled_from(["", "sha256:abc"])),
        share_tp_size=share,
    )
    # Some draws break a rule the Layout states (heads and TP that do not divide, a share that cuts a state badly):
    # those are the Layout's own tests; here only layouts it accepts.
    try:
        return Layout(**fields)  # type: ignore[arg-type]
    except InvalidLayout:
        reject()


@SETTINGS
@given(layout=layouts(), role=st.sampled_from([pb.ROLE_RANK, pb.ROLE_SCHEDULER]), derive=st.booleans())
def test_every_layout_comes_back_from_its_message_exactly(layout: Layout, role: int, derive: bool) -> None:
    message = to_message(layout, role=role, hash_bytes=16, client_name="host", derive_dcp_rank=derive)
    assert from_message(message) == layout
    # Through bytes, as it travels, with the request's own fields beside the layout.
    parsed = pb.OpenSessionRequest.FromString(message.SerializeToString())
    assert from_message(parsed) == layout
    assert (parsed.role, parsed.hash_bytes, parsed.client_name) == (role, 16, "host")
    assert parsed.parallel.HasField("dcp_rank") is not derive


@SETTINGS
@given(layout=layouts())
def test_the_clients_session_sends_the_contracts_message(layout: Layout) -> None:
    """The client's classes are the contract's: a SessionSpec of the same shape sends to_message's message."""
    par = layout.parallel
    spec = SessionSpec(
        model=layout.model,
        layout=EngineLayout(
            par.tp_size, par.tp_rank, par.pp_size, par.pp_rank, par.pcp_size, par.pcp_rank, par.dcp_size
        ),
        num_kv_heads=layout.num_kv_heads,
        hash_block_size=layout.hash_block_size,
        groups=tuple(
            ClientGroupSpec(g.kind.value, g.block_size, g.window, [k.value for k in g.inner], g.state)
            for g in layout.groups
        ),
        cache_prefix=layout.cache_prefix,
        hit_alignment_tokens=layout.hit_alignment_tokens,
        fine_grained_hits=layout.fine_grained_hits,
        value_identity=layout.value_identity,
        share_across_tp=layout.share_tp_size or False,
    )
    assert spec.to_placement() == layout
    assert spec.to_proto() == to_message(layout, derive_dcp_rank=True)
    # The contract's own groups serve as well: they are what the client's are.
    assert SessionSpec(**{**vars_of(spec), "groups": layout.groups}).to_proto() == spec.to_proto()


def vars_of(spec: SessionSpec) -> dict[str, object]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}


def test_the_clients_values_are_the_contracts() -> None:
    client = ClientGroupSpec("uniform", 16, 32, ["sliding_window", "mamba"])
    assert isinstance(client, GroupSpec)
    assert client == GroupSpec(Kind.UNIFORM, 16, 32, (Kind.SLIDING_WINDOW, Kind.MAMBA))
    assert hash(client) == hash(GroupSpec(Kind.UNIFORM, 16, 32, (Kind.SLIDING_WINDOW, Kind.MAMBA)))
    assert f"{client.kind}/{client.inner[0]}" == "uniform/sliding_window"
    layout = EngineLayout(tp_size=4, tp_rank=3, dcp_size=2)
    assert isinstance(layout, Parallel)
    assert layout == Parallel(tp_size=4, tp_rank=3, dcp_size=2) and layout.dcp_rank == 1
    for value in (client, layout, EngineLayout(tp_size=4, tp_rank=3, dcp_size=2, dcp_rank=1)):
        copy = pickle.loads(pickle.dumps(value))
        assert copy == value and type(copy) is type(value)
    assert pickle.loads(pickle.dumps(layout)).derives_dcp_rank
    assert not pickle.loads(pickle.dumps(EngineLayout(tp_size=4, tp_rank=3, dcp_size=2, dcp_rank=1))).derives_dcp_rank
