"""The daemon as a real process over its real socket, against a real mooncake_master."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import urllib.request

import grpc
import pytest

from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.waiting import wait_until
from support.rawrank import RawRank, group, open_request

pytestmark = pytest.mark.integration

BLOCK = 4096


def hashes(n: int, salt: str = "") -> list[bytes]:
    return chained_hashes(salt, n)


def pattern(tag: str, block: int = BLOCK) -> bytes:
    import hashlib

    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (block // len(seed) + 1))[:block]


@pytest.fixture
def daemon(mooncake_master, tmp_path, request):
    # A DaemonProcess's lease is long; a test about expiry asks for a short one (indirect parametrize).
    ttl = getattr(request, "param", None)
    d = (
        DaemonProcess(tmp_path, allow_shm_names=True, master=mooncake_master.address, session_ttl=ttl)
        if ttl
        else DaemonProcess(tmp_path, allow_shm_names=True, master=mooncake_master.address)
    ).start()
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def ranks(daemon):
    opened: list[RawRank] = []

    def make(request: pb.OpenSessionRequest, register: bool = True) -> RawRank:
        r = RawRank(daemon.target, request, block_bytes=BLOCK)
        opened.append(r)
        if register:
            r.register()
        return r

    yield make
    for r in opened:
        r.close()


def test_save_lookup_load_round_trip(ranks):
    groups = [group("full_attention", 16), group("mamba", 16)]
    rank = ranks(open_request(groups, model="org/RoundTrip"))
    h = hashes(4, "round-trip")
    for g in range(2):
        for b in range(4):
            rank.fill_block(g, b, pattern(f"{g}/{b}"))
    saved = rank.save(h, [[0, 1, 2, 3], [0, 1, 2, 3]], 64)
    assert (saved.written, saved.skipped, saved.failed) == (8, 0, 0)
    assert saved.bytes_written == 8 * BLOCK
    again = rank.save(h, [[0, 1, 2, 3], [0, 1, 2, 3]], 64)
    assert (again.written, again.skipped) == (0, 8)

    hit = rank.lookup(h, 65)
    assert (hit.hit_tokens, list(hit.tail_boundaries), hit.degraded) == (64, [64, 64], False)
    assert rank.lookup(h, 64).hit_tokens == 48  # the last prompt token is always recomputed
    loaded = rank.load(h, [[8, 9, 10, 11], [12, 13, 14, 15]], hit)
    assert (loaded.loaded, list(loaded.failures)) == (5, [])  # 4 attention blocks + the state at 64
    assert [rank.block(0, 8 + b) for b in range(4)] == [pattern(f"0/{b}") for b in range(4)]
    assert rank.block(1, 15) == pattern("1/3")


def test_seed_000_tp2_mla_mamba_each_rank_gets_its_own_state(ranks):
    groups = [group("mla", 16), group("mamba", 16)]
    r0, r1 = (ranks(open_request(groups, tp=2, rank=r, model="org/Kimi-Linear")) for r in (0, 1))
    h = hashes(4, "seed000")
    for r, rank in enumerate((r0, r1)):
        for b in range(4):
            rank.fill_block(0, b, pattern(f"latent/{b}"))
            rank.fill_block(1, b, pattern(f"state/rank{r}/{b}"))
    s0 = r0.save(h, [[0, 1, 2, 3]] * 2, 64)
    s1 = r1.save(h, [[0, 1, 2, 3]] * 2, 64)
    # MLA chunks are striped across the two ranks; every Mamba chunk is written by both, into its own namespace.
    assert (s0.written, s0.striped_to_others, s1.written, s1.striped_to_others) == (6, 2, 6, 2)
    scheduler = ranks(open_request(groups, tp=2, role=pb.ROLE_SCHEDULER, model="org/Kimi-Linear"), register=False)
    hit = scheduler.lookup(h, 65)
    assert hit.hit_tokens == 64
    for r, rank in enumerate((r0, r1)):
        loaded = rank.load(h, [[4, 5, 6, 7], [8, 9, 10, 11]], hit)
        assert not loaded.failures
        assert [rank.block(0, 4 + b) for b in range(4)] == [pattern(f"latent/{b}") for b in range(4)]
        assert rank.block(1, 11) == pattern(f"state/rank{r}/3")


def test_bad_input_gets_precise_errors_and_others_keep_working(daemon, ranks):
    groups = [group("full_attention", 16)]
    good = ranks(open_request(groups, model="org/Good"))
    h = hashes(2, "good")
    good.fill_block(0, 0, pattern("g0"))
    bad = ranks(open_request(groups, model="org/Bad"))
    stub = bad.stub

    def expect(code: grpc.StatusCode, fragment: str, call, request) -> None:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == code, err.value.details()
        assert fragment in err.value.details()

    sid = bad.session

    def register_request(name: str, size: int, *, num_blocks: int, group: int) -> pb.RegisterMemoryRequest:
        """One region on a fresh session (registration happens once per session)."""
        region = pb.MemoryRegion(
            shm=pb.SharedMemoryHandle(name=name),
            mapping_bytes=size,
            block_stride=BLOCK,
            block_bytes=BLOCK,
            num_blocks=num_blocks,
            groups=[group],
        )
        session = ranks(open_request(groups), register=False).session
        return pb.RegisterMemoryRequest(session_id=session, regions=[region])

    expect(grpc.StatusCode.NOT_FOUND, "unknown session", stub.Lookup, pb.LookupRequest(session_id="nope"))
    ids = [pb.BlockIds(ids=[0, 99])]
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "block id 99 is outside region 0",
        stub.Save,
        pb.SaveRequest(session_id=sid, block_hashes=h, block_ids=ids, num_tokens=32),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "block hash 1 has 3 bytes",
        stub.Lookup,
        pb.LookupRequest(session_id=sid, block_hashes=[h[0], b"abc"], num_tokens=32),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected block ids for 1 groups, got 2",
        stub.Save,
        pb.SaveRequest(session_id=sid, block_hashes=h, block_ids=ids * 2, num_tokens=32),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "group index 3 out of range",
        stub.RegisterMemory,
        register_request(bad.segments[0].name, bad.segments[0].size, num_blocks=2, group=3),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "past the mapping",
        stub.RegisterMemory,
        register_request(bad.segments[0].name, bad.segments[0].size, num_blocks=10_000, group=0),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a plain segment name",
        stub.RegisterMemory,
        register_request("../../etc/passwd", 4096, num_blocks=1, group=0),
    )
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "call RegisterMemory once",
        stub.Save,
        pb.SaveRequest(
            session_id=ranks(open_request(groups), register=False).session, block_hashes=h, block_ids=ids, num_tokens=32
        ),
    )
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "already registered",
        stub.RegisterMemory,
        pb.RegisterMemoryRequest(session_id=sid, regions=[]),
    )
    scheduler = ranks(open_request(groups, role=pb.ROLE_SCHEDULER), register=False)
    expect(
        grpc.StatusCode.PERMISSION_DENIED,
        "scheduler session",
        stub.Save,
        pb.SaveRequest(session_id=scheduler.session, block_hashes=h, block_ids=ids, num_tokens=32),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "dcp_size 3 must divide tp_size 4",
        stub.OpenSession,
        open_request(groups, tp=4, dcp=3),
    )
    # vLLM's own (T, C, D) rules and DCP ranks, and its hit alignment: refused with the reason when inconsistent.
    pcp = open_request(groups, tp=4, dcp=4)
    pcp.parallel.pcp_size = 2
    expect(grpc.StatusCode.INVALID_ARGUMENT, "([1, 2, 8]), got 4", stub.OpenSession, pcp)
    wrong_rank = open_request(groups, tp=4, rank=3, dcp=2)
    wrong_rank.parallel.dcp_rank = 0
    expect(grpc.StatusCode.INVALID_ARGUMENT, "vLLM's parallel state gives 1", stub.OpenSession, wrong_rank)
    wrong_rank.parallel.dcp_rank = 2
    expect(grpc.StatusCode.INVALID_ARGUMENT, "dcp_rank must be in [0, dcp_size=2), got 2", stub.OpenSession, wrong_rank)
    unaligned = open_request(groups)
    unaligned.hit_alignment_tokens = 24
    expect(grpc.StatusCode.INVALID_ARGUMENT, "multiple of hash_block_size 16", stub.OpenSession, unaligned)
    unaligned.hit_alignment_tokens, unaligned.fine_grained_hits = 32, True
    expect(grpc.StatusCode.INVALID_ARGUMENT, "must be hash_block_size 16 or 0, got 32", stub.OpenSession, unaligned)
    splits = open_request([group("sliding_window", 32, window=64), group("mamba", 64)])
    splits.hit_alignment_tokens = 32
    expect(grpc.StatusCode.INVALID_ARGUMENT, "not a multiple of every group's span", stub.OpenSession, splits)
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "tail boundary",
        stub.Load,
        pb.LoadRequest(
            session_id=sid, block_hashes=h, block_ids=[pb.BlockIds(ids=[0, 1])], hit_tokens=16, tail_boundaries=[32]
        ),
    )
    huge = pb.LookupRequest(session_id=sid, block_hashes=[b"x" * 32] * (70 * 1024 * 1024 // 34), num_tokens=1 << 40)
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "", stub.Lookup, huge)

    # The well-behaved session never noticed.
    assert good.save(h, [[0, 1]], 32).failed == 0
    assert good.lookup(h, 33).hit_tokens == 32
    assert daemon.serving()


def test_many_sessions_at_once(ranks):
    groups = [group("full_attention", 16), group("mamba", 16)]
    ranks_ = [ranks(open_request(groups, tp=8, rank=r, heads=8, model="org/Parallel")) for r in range(8)]
    scheduler = ranks(open_request(groups, tp=8, heads=8, role=pb.ROLE_SCHEDULER, model="org/Parallel"), register=False)
    h = hashes(8, "parallel")

    def work(r: int) -> None:
        rank = ranks_[r]
        for g in range(2):
            for b in range(8):
                rank.fill_block(g, b, pattern(f"{r}/{g}/{b}"))
        assert rank.save(h, [list(range(8))] * 2, 128).failed == 0

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        list(pool.map(work, range(8)))
        lookups = [pool.submit(scheduler.lookup, h, 129) for _ in range(20)]
        assert {f.result().hit_tokens for f in lookups} == {128}
    hit = scheduler.lookup(h, 129)

    def check(r: int) -> None:
        rank = ranks_[r]
        assert not rank.load(h, [list(range(8, 16))] * 2, hit).failures
        assert [rank.block(0, 8 + b) for b in range(8)] == [pattern(f"{r}/0/{b}") for b in range(8)]
        assert rank.block(1, 15) == pattern(f"{r}/1/7")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(check, range(8)))


def test_reset_removes_only_its_own_cache_prefix(ranks):
    groups = [group("full_attention", 16)]
    a = ranks(open_request(groups, model="org/Shared", prefix="tenant-a"))
    b = ranks(open_request(groups, model="org/Shared", prefix="tenant-b"))
    plain = ranks(open_request(groups, model="org/Shared"))
    h = hashes(2, "same prompt for everyone")
    for r in (a, b, plain):
        assert r.save(h, [[0, 1]], 32).written == 2
    assert a.stub.Reset(pb.ResetRequest(session_id=a.session), timeout=10).removed == 2
    assert a.lookup(h, 33).hit_tokens == 0
    assert b.lookup(h, 33).hit_tokens == 32
    assert plain.lookup(h, 33).hit_tokens == 32


def test_metrics_are_scraped(daemon, ranks):
    rank = ranks(open_request([group("mla", 16)], model="org/Metrics"))
    h = hashes(3, "metrics")
    rank.save(h, [[0, 1, 2]], 48)
    hit = rank.lookup(h, 49)
    rank.load(h, [[3, 4, 5]], hit)
    rank.load(h[:1] + hashes(2, "missing"), [[6, 7, 8]], pb.LookupResponse(hit_tokens=48, tail_boundaries=[48]))
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['kvsidecar_saved_blocks_total{group_kind="mla"}'] == 3
    assert samples["kvsidecar_saved_bytes_total"] == 3 * BLOCK
    assert samples['kvsidecar_loaded_blocks_total{group_kind="mla"}'] == 4
    assert samples['kvsidecar_load_failed_blocks_total{group_kind="mla",reason="not_found"}'] == 2
    assert samples["kvsidecar_lookup_hit_tokens_total"] == 48
    assert samples["kvsidecar_lookup_tokens_total"] == 49
    assert samples['kvsidecar_lookup_requests_total{outcome="hit"}'] == 1
    assert samples['kvsidecar_sessions{role="rank"}'] == 1
    assert samples["kvsidecar_store_healthy"] == 1
    assert samples['kvsidecar_store_operation_seconds_count{operation="get"}'] == 2


def test_status_command(daemon, ranks):
    ranks(open_request([group("mla", 16)], model="org/Status"))
    cmd = [sys.executable, "-m", "kvsidecar", "status", "--socket", daemon.socket]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "serving" in out.stdout and "store: healthy" in out.stdout and "Status" in out.stdout
    lines = out.stdout.splitlines()
    (store,) = [line for line in lines if line.startswith("store:")]
    assert store.count(daemon.master) == 1, store  # the master once, however the store's health names it
    # Columns hold whatever the socket's path: every listener's "allowed:" starts at one offset.
    listeners = lines[lines.index("listeners:") + 1 : lines.index("counters:")]
    assert len({line.index("  allowed: ") for line in listeners}) == 1, "\n".join(listeners)
    assert "kvsidecar_disk_tier_" not in out.stdout  # no disk tier, no disk-tier counters
    # A node without a GPU never starts CUDA, and says so.
    assert "gpu: off (no NVIDIA GPU on this node)" in out.stdout
    quiet = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, timeout=30)
    assert (quiet.returncode, quiet.stdout) == (0, "")
    gone = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "status", "--socket", daemon.socket + ".none"],
        capture_output=True,
        timeout=30,
    )
    assert gone.returncode == 2


@pytest.mark.parametrize("daemon", [3], indirect=True, ids=["session-ttl-3"])
def test_session_of_a_silent_rank_expires(daemon, ranks):
    rank = ranks(open_request([group("mla", 16)], model="org/Expire"))

    def sessions_gone() -> bool:  # read from the metrics: a request of the rank's would renew its lease
        text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
        return 'kvsidecar_sessions{role="rank"} 0.0' in text

    wait_until(sessions_gone, timeout=15, what="the silent rank's session expired")  # --session-ttl 3
    with pytest.raises(grpc.RpcError) as err:
        rank.lookup(hashes(1), 17)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert 'kvsidecar_sessions{role="rank"} 0.0' in text
    assert "kvsidecar_registered_region_bytes 0.0" in text


def test_stale_socket_is_taken_over_and_a_live_one_is_not(mooncake_master, tmp_path):
    path = tmp_path / "kvsidecar.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # a crashed daemon leaves its socket file behind
    d = DaemonProcess(tmp_path, allow_shm_names=True, master=mooncake_master.address).start()
    try:
        assert oct(os.stat(path).st_mode & 0o777) == "0o660"
        second = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "serve", "--socket", str(path), "--metrics-address", "127.0.0.1:0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1
        assert f"another daemon is serving on {path}" in second.stderr
        assert d.serving()
    finally:
        assert d.stop() == 0
    assert not path.exists()
