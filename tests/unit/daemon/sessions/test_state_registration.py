"""Rule 12 at registration: ranks of any TP size fill a state piece's namespace with one shape, and regions that are
not whole layers of the rank's state are refused with the reason."""

from __future__ import annotations

from multiprocessing import shared_memory

import pytest
from prometheus_client import CollectorRegistry

from kvsidecar.errors import BadRequest
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.live import Grant
from kvsidecar.tenancy.table import SINGLE_TENANT
from kvsidecar.values import RegionRequest, Role, ShmHandle
from kvsidecar_contract.placement import GroupSpec, Kind, Layout, Parallel
from kvsidecar_testing.states import Mamba2

LAYER = Mamba2(8, 2, 1, 2)
LAYERS, BLOCKS, PADDING = 3, 4, 16


@pytest.fixture
def registry():
    store = MemoryStore()
    reg = SessionRegistry(60, Movers(store), metrics=Metrics(CollectorRegistry()))
    segments: list[shared_memory.SharedMemory] = []
    yield reg, segments
    reg.close_all()
    for s in segments:
        s.close()
        s.unlink()


def layout(tp: int, rank: int) -> Layout:
    groups = (GroupSpec(Kind.MAMBA, 16, state=LAYER.state()),)
    return Layout("org/Hybrid", groups, Parallel(tp_size=tp, tp_rank=rank), 1, 16, share_tp_size=8)


def regions(segments, tp: int, padded: bool = False) -> list[RegionRequest]:
    """One region per layer: the rank's page of state, pages PADDING bytes apart (vLLM's page_size_padded)."""
    page = LAYER.state().layer_bytes(tp)
    stride = page + PADDING
    segment = shared_memory.SharedMemory(create=True, size=LAYERS * BLOCKS * stride)
    segment.buf[:] = bytes(len(segment.buf))  # backed, as a client's segment is
    segments.append(segment)
    size = stride if padded else page
    return [
        RegionRequest(ShmHandle(segment.name), len(segment.buf), i * BLOCKS * stride, stride, size, BLOCKS, (0,))
        for i in range(LAYERS)
    ]


def test_ranks_of_every_tp_size_register_the_same_piece_shapes(registry):
    reg, segments = registry
    grant = Grant(SINGLE_TENANT, shm_names=True)
    shapes = {}
    for tp in (1, 2, 4):
        session = reg.open(Role.RANK, layout(tp, 0), 32, "rank", grant=grant)
        memory = reg.attach(session, regions(segments, tp))  # one live namespace shape per piece: no refusal
        for prefix, shape in zip(session.geometry.groups[0].own, memory.value_shapes[0], strict=True):
            assert shapes.setdefault(prefix, shape) == shape
    # Rank 0 of TP 4 holds heads 0-1 and the group: its head pieces have TP=1's shapes, 3 layers of them.
    assert memory.value_shapes[0][0] == (4, 4, 4, 16) * LAYERS


def test_regions_holding_a_pages_padding_are_refused_with_the_reason(registry):
    reg, segments = registry
    session = reg.open(Role.RANK, layout(2, 1), 32, "rank", grant=Grant(SINGLE_TENANT, shm_names=True))
    page = LAYER.state().layer_bytes(2)
    with pytest.raises(BadRequest, match=f"must hold whole layers of {page} bytes .* they hold {3 * (page + 16)}"):
        reg.attach(session, regions(segments, 2, padded=True))
