"""End-to-end fixtures: one real daemon and a pool of rank processes for the whole session, started on first use."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvsidecar_client import SidecarClient
from kvsidecar_contract.placement import Layout
from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.ranks import RankProcess
from support import e2e_rank
from support.e2e_engine import SimEngine, TensorSpec, scheduler

NUM_RANK_PROCESSES = 4  # the widest engine of the scenarios


@pytest.fixture(scope="session")
def e2e_daemon(mooncake_master, tmp_path_factory) -> Iterator[DaemonProcess]:
    """A real `kvsidecar serve` process on the session's master."""
    daemon = DaemonProcess(tmp_path_factory.mktemp("e2e-daemon"), master=mooncake_master.address).start()
    yield daemon
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="session")
def rank_procs(request, tmp_path_factory) -> Iterator[list[RankProcess]]:
    """Rank processes shared by every scenario (each opens its own sessions and tensors in them).

    Starting a process costs 1-3 s (torch), so scenarios reuse them; one scenario's rank i is process i.
    """
    # The daemon starts while the ranks import torch.
    meanwhile = lambda: request.getfixturevalue("e2e_daemon")  # noqa: E731
    with e2e_rank.started(tmp_path_factory.mktemp("e2e-ranks"), NUM_RANK_PROCESSES, meanwhile) as procs:
        yield procs


@pytest.fixture
def engines(rank_procs, e2e_daemon) -> Iterator[Callable[[Layout, list[TensorSpec]], SimEngine]]:
    """Open a simulated engine (every rank registered) on the shared rank processes; closed after the test."""
    opened: list[SimEngine] = []

    def make(layout: Layout, tensors: list[TensorSpec]) -> SimEngine:
        engine = SimEngine(rank_procs, e2e_daemon.target, layout, tensors).open()
        opened.append(engine)
        return engine

    yield make
    for engine in opened:
        engine.close()


@pytest.fixture
def schedulers(e2e_daemon) -> Iterator[Callable[[Layout], SidecarClient]]:
    """Open a scheduler session (lookups only) for an engine layout; closed after the test."""
    opened: list[SidecarClient] = []

    def make(layout: Layout) -> SidecarClient:
        client = scheduler(e2e_daemon.target, layout)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()
