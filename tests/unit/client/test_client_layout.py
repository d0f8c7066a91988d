"""Engine layout, groups and session spec: validation of obvious mistakes, and the exact proto messages."""

import pytest

from kvsidecar_client import EngineLayout, GroupSpec, InvalidRequest, SessionSpec
from kvsidecar_client.layout import KINDS
from kvsidecar_contract import placement
from kvsidecar_contract.mapping import group_to_message
from kvsidecar_contract.placement import InvalidLayout, Kind
from kvsidecar_contract.proto import sidecar_pb2 as pb

GROUPS = (
    GroupSpec("mla", block_size=16),
    GroupSpec("mamba", block_size=64),
    GroupSpec("sliding_window", block_size=16, window=128),
    GroupSpec("uniform", block_size=16, inner=("mla", "full_attention")),
)


def spec(**overrides):
    fields = dict(
        model="org/Model",
        layout=EngineLayout(tp_size=2, tp_rank=1),
        num_kv_heads=1,
        hash_block_size=16,
        groups=GROUPS,
    )
    fields.update(overrides)
    return SessionSpec(**fields)


def test_layout_to_proto():
    # (T, C, D) = (8, 2, 16): DCP over all of TP x PCP, which vLLM accepts (D = 4 with C = 2 it refuses).
    layout = EngineLayout(tp_size=8, tp_rank=5, pp_size=2, pp_rank=1, pcp_size=2, pcp_rank=1, dcp_size=16, dcp_rank=11)
    assert layout.to_proto() == pb.ParallelLayout(
        tp_size=8, tp_rank=5, pp_size=2, pp_rank=1, pcp_size=2, pcp_rank=1, dcp_size=16, dcp_rank=11
    )
    assert not EngineLayout(tp_size=4, dcp_size=2).to_proto().HasField("dcp_rank")  # unset: the daemon derives it
    assert EngineLayout().to_proto() == pb.ParallelLayout(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (dict(tp_size=0), "tp_size must be in"),
        (dict(tp_size=2, tp_rank=2), "tp_rank must be in [0, 2)"),
        (dict(tp_rank=-1), "tp_rank must be in"),
        (dict(pp_size=2, pp_rank=3), "pp_rank must be in [0, 2)"),
        (dict(pcp_size=0), "pcp_size"),
        (dict(tp_size=4, dcp_size=3), "dcp_size 3 must divide tp_size 4"),
        (dict(dcp_size=0), "dcp_size"),
        (dict(tp_size=2, pcp_size=2, dcp_size=3), "dcp_size must be 1, pcp_size or tp_size"),
        (dict(tp_size=4, tp_rank=3, dcp_size=2, dcp_rank=0), "dcp_rank 0 is not the DCP rank of tp_rank 3"),
        (dict(tp_size=2, tp_rank=1, pcp_size=2, dcp_size=2, dcp_rank=1), "vLLM's parallel state gives 0"),
        (dict(tp_size=True), "tp_size must be an int"),
        (dict(tp_size=2.0), "tp_size must be an int"),
    ],
)
def test_layout_refuses(fields, reason):
    with pytest.raises(InvalidRequest, match=reason.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        EngineLayout(**fields)


def test_groups_to_proto():
    assert [group_to_message(g) for g in GROUPS] == [
        pb.KVCacheGroup(kind=pb.MLA, block_size=16),
        pb.KVCacheGroup(kind=pb.MAMBA, block_size=64),
        pb.KVCacheGroup(kind=pb.SLIDING_WINDOW, block_size=16, window=128),
        pb.KVCacheGroup(kind=pb.UNIFORM, block_size=16, inner=[pb.MLA, pb.FULL_ATTENTION]),
    ]
    swa = GroupSpec("uniform", block_size=32, window=4096, inner=["sliding_window_mla", "mamba"])
    assert swa.inner == ("sliding_window_mla", "mamba")
    assert group_to_message(swa) == pb.KVCacheGroup(
        kind=pb.UNIFORM, block_size=32, window=4096, inner=[pb.SLIDING_WINDOW_MLA, pb.MAMBA]
    )
    assert group_to_message(GroupSpec("full_attention", 16)) == pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16)


@pytest.mark.parametrize(
    ("args", "kwargs", "reason"),
    [
        (("gqa", 16), {}, "unknown group kind 'gqa'"),
        (("mla", 0), {}, "block_size must be in"),
        (("sliding_window", 16), {}, "needs window >= 1"),
        (("sliding_window_mla", 16), {}, "needs window >= 1"),
        (("mla", 16), {"window": 128}, "window is only for sliding-window kinds"),
        (("uniform", 16), {}, "needs at least one member"),
        (("uniform", 16), {"inner": ("mla", "uniform")}, "nest one level only"),
        (("uniform", 16), {"inner": ("mla", "lstm")}, "unknown member kind 'lstm'"),
        (("uniform", 16), {"inner": ("sliding_window",)}, "needs window >= 1"),
        (("mla", 16), {"inner": ("mla",)}, "only uniform groups have members"),
        (("mamba", -16), {}, "block_size must be in"),
    ],
)
def test_group_refuses(args, kwargs, reason):
    # The client's GroupSpec is the contract's: the same refusals, in the same words, as the daemon's.
    assert GroupSpec is placement.GroupSpec
    with pytest.raises(InvalidLayout, match=reason):
        GroupSpec(*args, **kwargs)


def test_session_to_proto():
    request = spec(cache_prefix="tenant-a", hash_bytes=16, client_name="host pid=1").to_proto()
    assert request == pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model="org/Model", cache_prefix="tenant-a"),
        parallel=pb.ParallelLayout(tp_size=2, tp_rank=1, pp_size=1, pcp_size=1, dcp_size=1),
        num_kv_heads=1,
        hash_block_size=16,
        groups=[group_to_message(g) for g in GROUPS],
        hash_bytes=16,
        role=pb.ROLE_RANK,
        client_name="host pid=1",
    )
    assert spec(role="scheduler").to_proto().role == pb.ROLE_SCHEDULER
    assert spec(role="scheduler").is_scheduler
    assert spec(groups=list(GROUPS)).groups == GROUPS


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(model="///"), "no last path component"),
        (dict(model=""), "no last path component"),
        (dict(model="org/a@b"), "must not contain '@'"),
        (dict(cache_prefix="x@y"), "cache_prefix must not contain '@'"),
        (dict(role="worker"), "role must be one of"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(hash_block_size=0), "hash_block_size"),
        (dict(hash_bytes=0), "hash_bytes"),
        (dict(groups=()), "at least one KV-cache group"),
        (dict(groups=(GroupSpec("mla", 16),) * 65), "at most 64"),
        (dict(groups=("mla",)), "group 0 must be a GroupSpec"),
        (dict(layout=(2, 0)), "layout must be an EngineLayout"),
    ],
)
def test_session_refuses(overrides, reason):
    with pytest.raises(InvalidRequest, match=reason):
        spec(**overrides)


def test_model_key_is_the_last_path_component():
    assert spec(model="org@x/Model").model == "org@x/Model"  # only the key's part must be free of '@'


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(groups=(GroupSpec("full_attention", 24),)), "not a multiple of hash_block_size 16"),
        (dict(groups=(GroupSpec("mamba", 8),), parallel=dict(tp_size=2, dcp_size=2)), "a block spans 8 tokens"),
        (dict(groups=(GroupSpec("full_attention", 16),), num_kv_heads=3), "must divide one another"),
        (dict(parallel=dict(tp_size=2048)), "tp_size must be in [1, 1024]"),
        (dict(parallel=dict(tp_size=4, dcp_size=3)), "dcp_size 3 must divide tp_size 4"),
        (dict(parallel=dict(tp_size=2, tp_rank=5)), "tp_rank must be in [0, 2)"),
        (dict(model="org/a@b"), "must not contain '@'"),
        (dict(model="///"), "has no last path component"),
        (dict(hash_block_size=1 << 25), "hash_block_size must be in"),
    ],
)
def test_the_client_refuses_a_layout_with_the_daemons_own_message(overrides, reason):
    """What the client refuses before connecting, the daemon refuses in the same words (one implementation)."""
    from kvsidecar.rpc import wire
    from kvsidecar_contract.placement import PlacementError

    fields = dict(model="org/Model", parallel=dict(tp_size=2), num_kv_heads=2, hash_block_size=16, groups=GROUPS)
    fields.update(overrides)
    parallel = fields.pop("parallel")
    with pytest.raises(InvalidRequest) as refused:
        SessionSpec(layout=EngineLayout(**parallel), **fields)
    assert reason in refused.value.reason
    # The same layout as the wire carries it, built field by field since the client will not build it.
    request = pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model=fields["model"]),
        parallel=pb.ParallelLayout(**{"pp_size": 1, "pcp_size": 1, "dcp_size": 1, **parallel}),
        num_kv_heads=fields["num_kv_heads"],
        hash_block_size=fields["hash_block_size"],
        groups=[group_to_message(g) for g in fields["groups"]],
        hash_bytes=32,
        role=pb.ROLE_RANK,
    )
    with pytest.raises(PlacementError) as daemon:
        wire.open_request(request)
    assert str(daemon.value) == refused.value.reason


def test_group_kinds_are_the_contracts_under_their_proto_names():
    assert {KINDS[k.value]: k.name for k in Kind} == {
        v.number: v.name for v in pb.GroupKind.DESCRIPTOR.values if v.number != pb.GROUP_KIND_UNSPECIFIED
    }


def test_a_recurrent_groups_state_layout_goes_to_the_daemon_and_its_regions_declare_no_heads():
    from kvsidecar_contract.placement import mamba2_state
    from kvsidecar_contract.state_wire import state_from_message

    state = mamba2_state(num_heads=8, head_dim=4, n_groups=1, state_size=16, conv_kernel=4, conv_bytes=2, ssm_bytes=4)
    groups = [GroupSpec("full_attention", 16), GroupSpec("mamba", 16, state=state)]
    spec = SessionSpec("org/M", EngineLayout(tp_size=2, tp_rank=1), 8, 16, groups, share_across_tp=True)
    message = spec.to_proto()
    assert not message.groups[0].HasField("state")
    assert state_from_message(message.groups[1].state) == state
    # Attention is cut by KV head (rule 11); the state is cut by the daemon from its layout (rule 12): whole layers.
    assert spec.cuts() == [(4, 4), (1, 1)]
    assert spec.to_placement().values_per_block(1) == 5  # heads 4-7 and the one group
    with pytest.raises(InvalidLayout, match="state must be a RecurrentState, got dict"):
        GroupSpec("mamba", 16, state={"heads": 8})  # type: ignore[arg-type]
    with pytest.raises(InvalidLayout, match="only a group whose members are all recurrent has one"):
        GroupSpec("full_attention", 16, state=state)
    with pytest.raises(InvalidRequest, match="state axis heads of 8 cannot be sharded over 16 TP ranks"):
        SessionSpec("org/M", EngineLayout(tp_size=16), 16, 16, groups, share_across_tp=True)
