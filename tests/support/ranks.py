"""Geometries of every rank of a layout, for tests that simulate a whole engine."""

from __future__ import annotations

from kvsidecar_contract.placement import Geometry, Layout


def rank_layout(layout: Layout, tp_rank: int, pcp_rank: int = 0, pp_rank: int = 0) -> Layout:
    """The same engine seen from another rank."""
    return layout.for_rank(tp_rank, pcp_rank, pp_rank)


def all_ranks(layout: Layout) -> list[tuple[tuple[int, int, int], Geometry]]:
    """((tp, pcp, pp), geometry) for every rank of the engine."""
    par = layout.parallel
    return [
        ((r, c, p), Geometry.of(layout.for_rank(r, c, p)))
        for r in range(par.tp_size)
        for c in range(par.pcp_size)
        for p in range(par.pp_size)
    ]
