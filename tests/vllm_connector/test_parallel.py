"""(T, C, D, P) as vLLM 0.33 defines them: what its ParallelConfig accepts, and each rank's DCP and PP rank as its
parallel state computes them, for every combination up to T = 8, C = 2, P = 2.

vLLM's own `initialize_model_parallel` runs for every global rank of every accepted layout, in this process: only
torch.distributed is stood in for (it reports the world size and rank; a process group is a list of ranks), so the
group layouts are vLLM's real code. The connector then reads this rank's layout from that state, and the contract
must accept it and agree with it.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

import torch.distributed
import vllm.config
from vllm.config import ParallelConfig
from vllm.distributed import parallel_state as ps

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.layout import EngineLayout
from kvsidecar_client.vllm.specs import layout_of_this_rank
from kvsidecar_contract.placement import InvalidLayout, Parallel
from kvsidecar_contract.placement.layout import dcp_rank_of

SIZES = list(itertools.product(range(1, 9), (1, 2), range(1, 2 * 8 * 2 + 1), (1, 2)))  # (T, C, D, P)
GROUPS = ("_TP", "_ETP", "_ENGRAM_DP", "_DCP", "_PCP", "_PP", "_DP", "_EP", "_EPLB")


def vllm_accepts(t: int, c: int, d: int, p: int) -> ParallelConfig | None:
    try:
        return ParallelConfig(
            tensor_parallel_size=t,
            prefill_context_parallel_size=c,
            decode_context_parallel_size=d,
            pipeline_parallel_size=p,
        )
    except ValueError:  # pydantic's ValidationError is a ValueError
        return None


def kvsidecar_accepts(t: int, c: int, d: int, p: int) -> bool:
    try:
        Parallel(tp_size=t, pcp_size=c, dcp_size=d, pp_size=p)
        EngineLayout(tp_size=t, pcp_size=c, dcp_size=d, pp_size=p)
    except (InvalidLayout, InvalidRequest):
        return False
    return True


def test_kvsidecar_accepts_exactly_the_parallel_sizes_vllm_accepts():
    accepted = [s for s in SIZES if vllm_accepts(*s) is not None]
    assert (2, 2, 4, 1) in accepted and (1, 2, 2, 1) in accepted and (4, 2, 8, 2) in accepted  # the issue's
    assert [s for s in SIZES if kvsidecar_accepts(*s)] == accepted


class _Group(SimpleNamespace):
    """A process group as the layout code sees it: its ranks, and where this global rank sits in it."""

    def destroy(self) -> None:
        return


def run_vllm_layout(monkeypatch: pytest.MonkeyPatch, t: int, c: int, d: int, p: int, rank: int) -> None:
    """vLLM's initialize_model_parallel for global rank `rank` of a world of T * C * P ranks (DP 1)."""
    world = t * c * p
    for name in GROUPS:
        monkeypatch.setattr(ps, name, None, raising=False)

    def make_group(group_ranks: list[list[int]], *args: Any, group_name: str = "", **kwargs: Any) -> _Group:
        mine = next(g for g in group_ranks if rank in g)
        return _Group(ranks=mine, rank_in_group=mine.index(rank), world_size=len(mine), name=group_name)

    monkeypatch.setattr(ps, "init_model_parallel_group", make_group)
    monkeypatch.setattr(
        ps, "get_world_group", lambda: _Group(local_rank=0, rank=rank, world_size=world, device_group=None)
    )
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a, **k: "gloo")
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            data_parallel_size=1, enable_elastic_ep=False, enable_eplb=False, use_all2all=False
        ),
        engram_config=None,
        model_config=None,
    )
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: config)
    ps.initialize_model_parallel(t, p, c, d)


ACCEPTED = [s for s in SIZES if vllm_accepts(*s) is not None]


@pytest.mark.parametrize("sizes", ACCEPTED, ids=lambda s: "T{}C{}D{}P{}".format(*s))
def test_every_rank_reads_its_ranks_from_vllm_and_the_contract_agrees(monkeypatch, sizes):
    t, c, d, p = sizes
    parallel_config = vllm_accepts(*sizes)
    seen = set()
    for rank in range(t * c * p):
        with monkeypatch.context() as mp:
            run_vllm_layout(mp, t, c, d, p, rank)
            layout = layout_of_this_rank(parallel_config)
            dcp_group = ps.get_dcp_group()
        assert (layout.tp_size, layout.pcp_size, layout.dcp_size, layout.pp_size) == sizes
        # The connector took every rank from vLLM's groups...
        assert layout.dcp_rank == dcp_group.rank_in_group
        # ...and the contract, which places keys for every rank of the engine, computes the same DCP rank.
        assert dcp_rank_of(layout.tp_rank, layout.pcp_rank, t, c, d) == layout.dcp_rank
        contract = Parallel(
            tp_size=t,
            tp_rank=layout.tp_rank,
            pp_size=p,
            pp_rank=layout.pp_rank,
            pcp_size=c,
            pcp_rank=layout.pcp_rank,
            dcp_size=d,
            dcp_rank=layout.dcp_rank,
        )
        assert contract.dcp_rank == dcp_group.rank_in_group
        # A DCP group's members hold disjoint slices: one of each DCP rank, all on one pipeline stage.
        assert dcp_group.world_size == d
        seen.add((layout.tp_rank, layout.pcp_rank, layout.pp_rank))
    assert len(seen) == t * c * p  # every rank of the engine is a distinct (r, c, p)
