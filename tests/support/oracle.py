"""An independent model of which engine ranks hold byte-identical KV bytes.

Written from the engine's point of view (which heads, which sequence slice, which layers a rank holds), not
from the placement rules, so the placement core can be checked against it.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvsidecar_contract.placement import GroupSpec, Kind, Layout


def dcp_slice(tp_rank: int, pcp_rank: int, tp_size: int, pcp_size: int, dcp_size: int) -> int | None:
    """Which slice of the sequence a rank holds under DCP (None: all of it).

    vLLM numbers ranks PP x PCP x TP and cuts DCP groups out of the (TP, PCP) plane with PCP varying fastest; the
    slot mapping then stores token i on the group member of rank (i // interleave) mod D.
    """
    if dcp_size == 1:
        return None
    plane = [(t, c) for t in range(tp_size) for c in range(pcp_size)]  # PCP fastest
    return plane.index((tp_rank, pcp_rank)) % dcp_size


def member_bytes(
    kind: Kind, tp_rank: int, tp_size: int, num_kv_heads: int, dcp_size: int, pcp_rank: int = 0, pcp_size: int = 1
) -> Hashable:
    """What one member kind of a group holds on a TP rank."""
    seq = dcp_slice(tp_rank, pcp_rank, tp_size, pcp_size, dcp_size)  # DCP: each rank holds its slice
    if kind is Kind.MAMBA:
        return ("state-shard", tp_rank)  # head/dim-sharded state: never the same on two ranks
    if kind in (Kind.MLA, Kind.SLIDING_WINDOW_MLA):
        return ("latent", seq)  # the latent is replicated on every rank
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        heads = tuple(range(tp_rank * per, (tp_rank + 1) * per))
    else:
        heads = (tp_rank * num_kv_heads // tp_size,)  # T/H ranks replicate each KV head
    return ("heads", heads, seq)


def group_bytes(layout: Layout, group: GroupSpec, tp_rank: int, pcp_rank: int, pp_rank: int) -> Hashable:
    """What a rank holds for a whole group: every member, on its own PCP rank and pipeline stage."""
    par = layout.parallel
    members = tuple(
        member_bytes(k, tp_rank, par.tp_size, layout.num_kv_heads, par.dcp_size, pcp_rank, par.pcp_size)
        for k in group.members
    )
    # PCP ranks stay apart even where they hold the same prompt KV (D = 1): decode then runs on one PCP owner only,
    # so the blocks it writes are on that rank alone.
    return (members, pcp_rank, pp_rank)
