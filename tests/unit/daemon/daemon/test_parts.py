"""The daemon's parts built from a Config as Daemon._start builds them, without a socket or a process: each part gets
its own settings and the parts reach one another (a save through the built data path lands in the store)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvsidecar.config import Config, settings_of
from kvsidecar.daemon.parts import build_data_path, build_service, build_sessions, open_tenancy
from kvsidecar.datapath.transfers import DataPath
from kvsidecar.errors import BadRequest, DaemonError, Exhausted
from kvsidecar.metrics import Metrics
from kvsidecar.movers.runtime import GpuRuntime
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.values import LookupArgs, Role, SaveArgs
from kvsidecar_contract.placement import Chunk, Geometry
from kvsidecar_testing.hashes import chained_hashes
from support.stateranks import Attention, Latent, Model, Rank


class Events:
    """A StoreEvents that counts the values each save wrote."""

    def __init__(self) -> None:
        self.writes: list[int] = []

    def stored(
        self,
        tenant: str,
        geometry: Geometry,
        hashes: Sequence[bytes],
        written: Sequence[Chunk],
        tokens: Sequence[int],
        tokens_start: int,
    ) -> None:
        self.writes.append(len(written))

    def cleared(self, tenant: str, key_prefix: str) -> None:
        return


@dataclass
class Parts:
    store: MemoryStore
    gpu: GpuRuntime
    sessions: SessionRegistry
    datapath: DataPath
    service: Dispatcher
    events: Events


def build(tmp_path: Path, **flags: object) -> Parts:
    """What Daemon._start builds between the store and the sockets, in its order, from one Config."""
    config = Config(socket=str(tmp_path / "k.sock"), gpu="off", **flags)  # type: ignore[arg-type]
    s = settings_of(config)
    store, metrics, events = MemoryStore(), Metrics(CollectorRegistry()), Events()
    tenancy = open_tenancy(s.tenancy, metrics)
    gpu = GpuRuntime(s.gpu, store, metrics)
    gpu.start()
    sessions = build_sessions(s.service, s.shares, store, metrics, gpu)
    datapath = build_data_path(s.service, store, metrics, tenancy, events)
    service = build_service(s.service, datapath, sessions, tenancy, metrics, gpu, master_address="127.0.0.1:1")
    return Parts(store, gpu, sessions, datapath, service, events)


@pytest.fixture
def parts(tmp_path):
    built = build(tmp_path, max_sessions=2, max_lookup_hashes=8)
    yield built
    built.service.shutdown()
    built.gpu.stop()


def test_a_save_through_the_built_data_path_reaches_the_store_and_the_events(parts):
    model = Model((Attention(), Latent()), kv_heads=2)
    rank = Rank(model, model.layout(1), parts.store)
    hashes = chained_hashes("prompt", 4)
    rank.fill(hashes, [0, 1, 2, 3])
    saved = parts.datapath.save(rank.session, SaveArgs(hashes, [[0, 1, 2, 3], [0, 1, 2, 3]], 64))
    assert not saved.failures and saved.written == len(parts.store.keys()) > 0
    assert sum(parts.events.writes) == saved.written  # the events given at construction heard of every value
    assert (
        parts.datapath.lookup(rank.session, LookupArgs(hashes, 65)).hit_tokens == 64
    )  # the last token is always computed


def test_each_part_runs_with_its_own_settings_from_the_config(parts):
    # --max-lookup-hashes reached the data path.
    model = Model((Attention(),), kv_heads=2)
    rank = Rank(model, model.layout(1), parts.store)
    with pytest.raises(BadRequest, match="at most 8 per call"):
        parts.datapath.lookup(rank.session, LookupArgs(chained_hashes("p", 9), 144))
    # --max-sessions reached the sessions' shares.
    for _ in range(2):
        parts.sessions.open(Role.RANK, model.layout(1), 32, "test")
    with pytest.raises(Exhausted, match="--max-sessions"):
        parts.sessions.open(Role.RANK, model.layout(1), 32, "test")
    # The service serves over the very parts built before it; without a GPU path it says so.
    handlers = parts.service.handlers
    assert handlers.datapath is parts.datapath and handlers.sessions is parts.sessions
    assert parts.gpu.describe().startswith("off")


def test_a_tenants_file_that_cannot_be_used_stops_the_daemon_with_the_reason(tmp_path):
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenants.a]\nuids = 'x'\n")
    with pytest.raises(DaemonError, match="tenants file"):
        build(tmp_path, tenants=str(bad))
