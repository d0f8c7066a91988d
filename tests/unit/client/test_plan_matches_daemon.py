"""Cross-check: what the vLLM connector thinks a Load writes and a Save reads is what the daemon's plans do.

Random layouts (every kind, uniform groups, windows, TP with DCP, U), random hits, start tokens and block tables
with vLLM null blocks. The daemon side is its own path: the client's OpenSession message parsed by kvsidecar.rpc.wire,
then the placement core's load and save plans. Runs without vLLM.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.rpc import wire
from kvsidecar_client import EngineLayout, GroupSpec, SessionSpec
from kvsidecar_client.vllm.plan import check_save, load_block_ids, saved_chunks, shape_of
from kvsidecar_contract.placement import Geometry, Kind, Layout, load_plan, save_plan

KINDS = [k.value for k in Kind if k is not Kind.UNIFORM]
NULL = 0  # vLLM's null block id; real blocks are numbered from 1
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sessions(draw) -> SessionSpec:
    u = draw(st.sampled_from([4, 8, 16]))
    tp = draw(st.sampled_from([1, 2, 4]))
    dcp = draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]))
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        uniform = draw(st.booleans())
        members = (
            draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3))
            if uniform
            else [draw(st.sampled_from(KINDS))]
        )
        recurrent = "mamba" in members
        sliding = any(k.startswith("sliding_window") for k in members)
        # A recurrent block spans block_size tokens, an attention block block_size * D: each must be a multiple of U.
        k = draw(st.integers(1, 4))
        block_size = u * k if recurrent or (u * k) % dcp else u * k // dcp
        window = draw(st.integers(1, 6 * u)) if sliding else 0
        if uniform:
            groups.append(GroupSpec("uniform", block_size, window, tuple(members)))
        else:
            groups.append(GroupSpec(members[0], block_size, window))
    return SessionSpec(
        model="org/Model",
        layout=EngineLayout(tp_size=tp, tp_rank=draw(st.integers(0, tp - 1)), dcp_size=dcp),
        num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
        hash_block_size=u,
        groups=tuple(groups),
    )


def daemon_layout(spec: SessionSpec) -> Layout:
    """The layout the daemon builds from this client's OpenSession message."""
    layout = wire.open_request(spec.to_proto())[1]
    assert spec.to_placement() == layout  # the client checked exactly the layout the daemon runs
    return layout


def tables(draw, geo: Geometry, tokens: int) -> list[list[int]]:
    """Per group a block table covering `tokens` and a little more, with distinct ids and some null blocks."""
    out = []
    for g, group in enumerate(geo.groups):
        n = tokens // group.span + 1 + draw(st.integers(0, 2))
        ids = [1 + 1000 * g + i for i in range(n)]
        for i in draw(st.sets(st.integers(0, n - 1), max_size=n)):
            ids[i] = NULL
        out.append(ids)
    return out


@given(spec=sessions(), data=st.data())
@SETTINGS
def test_a_load_writes_the_blocks_the_connector_reads(spec, data):
    draw = data.draw
    geo = Geometry.of(daemon_layout(spec))
    u = geo.layout.hash_block_size
    hit = geo.unit * draw(st.integers(0, 12))
    start = draw(st.integers(0, hit))
    tails = []
    for group in geo.groups:
        block_end = -(-hit // group.span) * group.span
        if hit == 0 or group.spec.recurrent or hit == block_end:
            tails.append(hit)
        else:  # a lookup reports the block holding the hit end under a U boundary up to that block's end
            tails.append(draw(st.integers(hit // u, block_end // u)) * u)
    num_hashes = max([hit, *tails]) // u
    ids = tables(draw, geo, max([hit, *tails]))
    hashes = [i.to_bytes(32, "big") for i in range(num_hashes)]

    chunks = load_plan(geo, hashes, ids, hit, tails, start)
    daemon = [[c.block_id for c in chunks if c.group == g] for g in range(len(geo.groups))]
    assert load_block_ids(shape_of(spec), ids, hit, start) == daemon


@given(spec=sessions(), data=st.data())
@SETTINGS
def test_a_save_stores_what_the_connector_reads(spec, data):
    draw = data.draw
    layout = daemon_layout(spec)
    geo = Geometry.of(layout)
    u = layout.hash_block_size
    num_tokens = draw(st.integers(0, 12 * geo.unit))
    saved = draw(st.integers(0, num_tokens))
    ids = tables(draw, geo, num_tokens)
    hashes = [i.to_bytes(32, "big") for i in range(num_tokens // u)]
    shape = shape_of(spec)

    ranks = [Geometry.of(layout.for_rank(r)) for r in range(layout.parallel.tp_size)]
    expected = {(g, i, b) for g, items in enumerate(saved_chunks(shape, num_tokens, saved)) for i, b in items}

    # Every value the connector expects a Save to store is written by exactly one rank of its replication set.
    for r in ranks:
        plan = save_plan(r, hashes, ids, num_tokens, saved)
        assert {(c.group, c.span_index, c.boundary) for c in plan.chunks} <= expected
        assert len(plan.chunks) + plan.others + plan.absent == len(expected)
    stored = [
        (c.group, c.span_index, c.boundary) for r in ranks for c in save_plan(r, hashes, ids, num_tokens, saved).chunks
    ]
    assert set(stored) == expected

    # The block ids the connector sends and fences are the blocks the daemon reads, over every rank; NO_BLOCK and
    # vLLM's null block never are.
    check = check_save(shape, ids, num_tokens, saved, NULL)
    if not check.ok:
        assert check.chunks == 0 and not check.reads
        return
    plans = [save_plan(r, hashes, check.block_ids, num_tokens, saved) for r in ranks]
    read = {c.block_id for plan in plans for c in plan.chunks}
    assert read == check.reads and NULL not in read
    assert check.chunks == len({(c.group, c.span_index) for plan in plans for c in plan.chunks})
