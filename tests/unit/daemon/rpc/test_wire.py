"""wire.py turns proto into domain values and results back into proto, field for field."""

from __future__ import annotations

import pytest

from kvsidecar import __version__
from kvsidecar.errors import BadRequest, Forbidden
from kvsidecar.memory.mappings import Opener
from kvsidecar.reasons import Reason
from kvsidecar.rpc import wire
from kvsidecar.store import StoreHealth
from kvsidecar.values import (
    CudaHandle,
    Failure,
    LoadOutcome,
    RegionRequest,
    Role,
    SaveOutcome,
    SessionSummary,
    ShmHandle,
)
from kvsidecar_contract.placement import Geometry, GroupSpec, Hit, Kind, Layout, PackedHashes, Parallel
from kvsidecar_contract.proto import sidecar_pb2 as pb

CUDA = pb.CudaIpcHandle(
    device=1,
    handle=b"\x01\x02",
    storage_size=1 << 20,
    storage_offset=4096,
    ref_counter_handle=b"rc",
    ref_counter_offset=8,
    event_handle=b"ev",
    event_sync_required=True,
)


def test_regions_carry_every_field_and_handle():
    regions = [
        pb.MemoryRegion(
            shm=pb.SharedMemoryHandle(name="seg"),
            mapping_bytes=8192,
            offset=64,
            block_stride=1024,
            block_bytes=512,
            num_blocks=7,
            groups=[0, 2],
        ),
        pb.MemoryRegion(cuda=CUDA, mapping_bytes=4096, block_stride=4096, block_bytes=4096, num_blocks=1, groups=[1]),
        pb.MemoryRegion(mapping_bytes=1),
    ]
    assert wire.regions(regions) == [
        RegionRequest(ShmHandle("seg"), 8192, 64, 1024, 512, 7, (0, 2)),
        RegionRequest(CudaHandle(1, b"\x01\x02", 1 << 20, 4096, b"rc", 8, b"ev", True), 4096, 0, 4096, 4096, 1, (1,)),
        RegionRequest(None, 1, 0, 0, 0, 0, ()),
    ]


def test_memory_decides_how_each_handle_is_opened_and_keyed():
    opener = Opener(shm_names=True)
    shm, cuda = wire.regions([pb.MemoryRegion(shm=pb.SharedMemoryHandle(name="seg")), pb.MemoryRegion(cuda=CUDA)])
    assert (opener.key(0, shm.handle), opener.key(1, cuda.handle)) == ("shm:seg", "cuda:1:0102:4096")
    (empty,) = wire.regions([pb.MemoryRegion()])
    with pytest.raises(BadRequest, match="region 1: needs a shm or cuda handle"):
        opener.key(1, empty.handle)
    (nameless,) = wire.regions([pb.MemoryRegion(shm=pb.SharedMemoryHandle(name=""))])
    with pytest.raises(BadRequest, match="region 0: shared-memory name is empty"):
        opener.key(0, nameless.handle)
    # Names are a right a session must be granted; by default nobody has it.
    with pytest.raises(Forbidden, match="/dev/shm names are for trusted ranks only"):
        Opener().key(0, shm.handle)


def test_open_response_carries_the_placement():
    layout = Layout("m", (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 32)), Parallel(tp_size=2, tp_rank=1))
    geo = Geometry.of(layout)
    out = wire.open_response("sid", 7.5, geo)
    assert (out.session_id, out.lease_ms, out.daemon_version) == ("sid", 7500, __version__)
    assert out.packed_hashes  # the client may send a Lookup's hashes in one field
    assert (out.hit_alignment_tokens, out.fine_grained_hits) == (geo.unit, geo.fine_grained)
    assert [(g.replication_factor, g.shard_id, g.keys_per_boundary, g.span_tokens) for g in out.groups] == [
        (g.factor, g.shard, g.keys_per_boundary, g.span) for g in geo.groups
    ]


def test_outcomes_become_responses():
    failures = (Failure(0, 3, Reason.NO_SPACE), Failure(1, 9, Reason.NO_BLOCK))
    saved = wire.save_response(SaveOutcome(5, 2, failures, 4, 5120, 1))
    assert (saved.written, saved.skipped, saved.failed, saved.striped_to_others, saved.bytes_written, saved.absent) == (
        5,
        2,
        2,
        4,
        5120,
        1,
    )
    assert [(f.group, f.block_id, f.reason) for f in saved.failures] == list(failures)
    hit = wire.lookup_response(Hit(48, (48, 32), True, "1 of 9 existence probes failed"))
    assert (hit.hit_tokens, list(hit.tail_boundaries), hit.degraded, hit.detail) == (
        48,
        [48, 32],
        True,
        "1 of 9 existence probes failed",
    )
    loaded = wire.load_response(LoadOutcome(3, 3072, failures[:1]))
    assert (loaded.loaded, loaded.bytes_loaded, [f.reason for f in loaded.failures]) == (3, 3072, ["no_space"])
    assert wire.register_response(8192, [1024, 512]) == pb.RegisterMemoryResponse(
        mapped_bytes=8192, value_bytes=[1024, 512]
    )
    assert wire.keepalive_response(2.0, True) == pb.KeepAliveResponse(lease_ms=2000, store_healthy=True)
    assert wire.reset_response(12).removed == 12


def test_stats_response_shows_each_session():
    p = Parallel(tp_size=4, tp_rank=3, pp_size=2, pp_rank=1, pcp_size=1, pcp_rank=0, dcp_size=2)
    summary = SessionSummary("abcdefgh", Role.SCHEDULER, "org/m", "tenant", p, 0, 1.5, "vllm")
    out = wire.stats_response(9.0, StoreHealth(False, "master down"), "127.0.0.1:1", [summary], {"x_total": 3.0})
    assert (out.daemon_version, out.uptime_seconds, out.store_healthy, out.store_detail, out.master_address) == (
        __version__,
        9.0,
        False,
        "master down",
        "127.0.0.1:1",
    )
    assert dict(out.counters) == {"x_total": 3.0}
    (info,) = out.sessions
    assert (info.session_id_prefix, info.role, info.model, info.cache_prefix, info.client_name) == (
        "abcdefgh",
        pb.ROLE_SCHEDULER,
        "org/m",
        "tenant",
        "vllm",
    )
    assert (info.parallel.tp_size, info.parallel.tp_rank, info.parallel.pp_rank, info.parallel.dcp_size) == (4, 3, 1, 2)
    assert (info.mapped_bytes, info.age_seconds) == (0, 1.5)


def test_packed_hashes_are_read_whole_or_refused_with_the_reason():
    hashes = [bytes([i]) * 32 for i in range(3)]
    args = wire.lookup_args(pb.LookupRequest(packed_block_hashes=b"".join(hashes), num_tokens=49), 32)
    assert isinstance(args.hashes, PackedHashes) and list(args.hashes) == hashes and args.num_tokens == 49
    assert list(wire.lookup_args(pb.LookupRequest(block_hashes=hashes, num_tokens=49), 32).hashes) == hashes
    with pytest.raises(BadRequest, match="holds 95 bytes, not a whole number of 32-byte hashes"):
        wire.lookup_args(pb.LookupRequest(packed_block_hashes=b"".join(hashes)[:-1], num_tokens=49), 32)
    with pytest.raises(BadRequest, match="both set: send the hashes one way"):
        wire.lookup_args(pb.LookupRequest(block_hashes=hashes, packed_block_hashes=hashes[0], num_tokens=49), 32)
    with pytest.raises(BadRequest, match=f"at most {wire.MAX_HASHES} block hashes per request"):
        wire.packed_hashes(b"x" * (wire.MAX_HASHES + 1), 1)


def test_hashes_of_the_wrong_length_are_named():
    assert wire.hashes([b"a" * 32] * 3, 32) == [b"a" * 32] * 3
    with pytest.raises(BadRequest, match="block hash 2 has 31 bytes, the session declared 32"):
        wire.hashes([b"a" * 32, b"b" * 32, b"c" * 31], 32)
    with pytest.raises(BadRequest, match="at most"):
        wire.hashes([b"a"] * (wire.MAX_HASHES + 1), 1)


def test_a_requests_retention_is_read_whole_checked_and_answered():
    from kvsidecar.rpc.retention import retention_args
    from kvsidecar.values import RetentionArgs

    assert retention_args(pb.SaveRequest()) is None
    asked = pb.SaveRequest(block_ids=[pb.BlockIds()], retention=pb.Retention(seconds=300, renew=True, end_tokens=64))
    assert wire.save_args(asked, 32, 1).retention == RetentionArgs(300, 100, True, 64, False)  # priority 100 unset
    load = pb.LoadRequest(block_ids=[pb.BlockIds()], retention=pb.Retention(seconds=1.5, priority=0))
    assert wire.load_args(load, 32, 1).retention == RetentionArgs(1.5, 0)
    assert retention_args(pb.SaveRequest(retention=pb.Retention(hard=True))) == RetentionArgs(0, 100, hard=True)
    for bad, reason in (
        (pb.Retention(seconds=0), "seconds must be a number of seconds > 0"),
        (pb.Retention(seconds=float("inf")), "seconds must be"),
        (pb.Retention(seconds=5, priority=101), "priority is 0-100"),
    ):
        with pytest.raises(BadRequest, match=reason):
            retention_args(pb.SaveRequest(retention=bad))
    saved = wire.save_response(SaveOutcome(4, 0, (), 0, 4096, retained=2, unretained=2))
    assert (saved.retained, saved.unretained) == (2, 2)
    loaded = wire.load_response(LoadOutcome(3, 3072, (), retained=3))
    assert (loaded.retained, loaded.unretained) == (3, 0)
