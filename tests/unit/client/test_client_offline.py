"""The client with no daemon behind its socket: local refusals, fast failures and the degraded miss."""

import time

import pytest
import torch

from kvsidecar_client import (
    ClientClosed,
    DaemonUnavailable,
    Deadlines,
    EngineLayout,
    GroupSpec,
    Hit,
    InvalidRequest,
    PreconditionFailed,
    SessionSpec,
    SidecarClient,
    shared_tensor,
)
from kvsidecar_client._channel import make_channel

GROUPS = (GroupSpec("full_attention", 16), GroupSpec("mamba", 64))
HASHES = [bytes([i]) * 32 for i in range(4)]


def spec(role="rank"):
    return SessionSpec("org/Model", EngineLayout(tp_size=2, tp_rank=0), 1, 16, GROUPS, role=role)


@pytest.fixture
def absent(tmp_path):
    return f"unix://{tmp_path}/absent.sock"


@pytest.fixture
def offline(absent):
    client = SidecarClient(make_channel(absent), spec(), deadlines=Deadlines(connect=0.3, control=0.3))
    yield client
    client.close()


def test_connect_gives_up_after_its_deadline(absent):
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        SidecarClient.connect(
            absent,
            model="org/Model",
            layout=EngineLayout(),
            num_kv_heads=1,
            hash_block_size=16,
            groups=GROUPS,
            deadlines=Deadlines(connect=0.3),
        )
    assert time.monotonic() - started < 5


def test_connect_refuses_a_bad_layout_before_any_io(absent):
    with pytest.raises(InvalidRequest, match="must not contain '@'"):
        SidecarClient.connect(
            absent, model="org/a@b", layout=EngineLayout(), num_kv_heads=1, hash_block_size=16, groups=GROUPS
        )


def test_lookup_answers_a_degraded_miss_when_the_daemon_is_down(offline):
    started = time.monotonic()
    hit = offline.lookup(HASHES, 64)
    assert time.monotonic() - started < 5
    assert hit.hit_tokens == 0 and hit.tail_boundaries == (0, 0) and hit.degraded
    assert "daemon unavailable" in hit.detail
    with pytest.raises(DaemonUnavailable):
        offline.lookup(HASHES, 64, miss_on_unavailable=False)


def test_an_asynchronous_lookup_answers_in_its_future(offline):
    # The caller's thread only starts it; the degraded miss, or the refusal of bad input, comes in the future.
    hit = offline.lookup_async(HASHES, 64).result(timeout=30)
    assert hit.hit_tokens == 0 and hit.degraded and "daemon unavailable" in hit.detail
    with pytest.raises(InvalidRequest, match="bad Lookup request"):
        offline.lookup_async(["not bytes"], 64).result(timeout=30)  # type: ignore[list-item]


def test_save_and_load_need_registered_memory(offline):
    with pytest.raises(PreconditionFailed, match="register"):
        offline.save(HASHES, [[1, 2, 3, 4], [0]], 64)
    with pytest.raises(PreconditionFailed, match="register"):
        offline.load(HASHES, [[1, 2, 3, 4], [0]], Hit(48, (48, 48)))


def test_register_checks_tensors_before_any_io(offline):
    kv = shared_tensor((4, 16, 8), torch.float16)
    with pytest.raises(InvalidRequest, match="1 tensors but 2 entries"):
        offline.register([kv], [(0,), (1,)])
    with pytest.raises(InvalidRequest, match="must name one or more of the 2 groups"):
        offline.register([kv], [(2,)])
    with pytest.raises(InvalidRequest, match="shared_tensor"):
        offline.register([torch.zeros(4, 8)], [(0,)])
    with pytest.raises(DaemonUnavailable):
        offline.register([kv], [(0, 1)])  # a valid registration that finds no daemon
    assert offline.registration is None


def test_a_scheduler_has_no_memory(absent):
    client = SidecarClient(make_channel(absent), spec("scheduler"))
    try:
        with pytest.raises(PreconditionFailed, match="scheduler"):
            client.register([shared_tensor(4, torch.uint8)], [(0,)])
        with pytest.raises(PreconditionFailed, match="scheduler"):
            client.save(HASHES, [[1], [1]], 64)
    finally:
        client.close()


def test_a_closed_client_refuses_every_call(offline):
    offline.close()
    offline.close()  # idempotent
    with pytest.raises(ClientClosed):
        offline.lookup(HASHES, 64)
    with pytest.raises(ClientClosed):
        offline.lookup_async(HASHES, 64)
    with pytest.raises(ClientClosed):
        offline.stats()
    with pytest.raises(ClientClosed):
        offline.reset()
    with pytest.raises(ClientClosed):
        offline.register([shared_tensor(4, torch.uint8)], [(0,)])
    assert not offline.connected
