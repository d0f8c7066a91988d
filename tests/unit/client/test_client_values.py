"""Value types from response messages, channel options and deadlines: pure conversions."""

import concurrent.futures
import math

import pytest

from kvsidecar_client import (
    DaemonUnavailable,
    Deadlines,
    FailedBlock,
    GroupPlacement,
    Hit,
    InvalidRequest,
    LoadResult,
    SaveJob,
    SaveResult,
)
from kvsidecar_client._channel import DEFAULT_MAX_MESSAGE_BYTES, channel_options, target
from kvsidecar_client.results import Registration, SessionInfo
from kvsidecar_contract import placement
from kvsidecar_contract.mapping import hit_from_message, hit_to_message
from kvsidecar_contract.proto import sidecar_pb2 as pb


def test_save_result_from_proto():
    message = pb.SaveResponse(
        written=3,
        skipped=2,
        failed=1,
        striped_to_others=4,
        bytes_written=3 << 20,
        failures=[pb.FailedBlock(group=1, block_id=42, reason="no_space")],
    )
    assert SaveResult.from_proto(message) == SaveResult(3, 2, 1, 4, 3 << 20, (FailedBlock(1, 42, "no_space"),))


def test_hit_from_proto_and_a_local_miss():
    message = pb.LookupResponse(hit_tokens=13824, tail_boundaries=[14848, 13824], degraded=False, detail="")
    hit = hit_from_message(message)
    assert hit == Hit(13824, (14848, 13824), False, "") and hit_to_message(hit) == message
    assert Hit is placement.Hit  # one Hit: the contract's, the daemon's answer and the client's alike
    assert hit.tail_boundaries == (14848, 13824)
    assert Hit.miss(3, "daemon down") == Hit(0, (0, 0, 0), True, "daemon down")


def test_load_result_names_failed_blocks_once():
    message = pb.LoadResponse(
        loaded=5,
        bytes_loaded=5 << 16,
        failures=[
            pb.FailedBlock(group=0, block_id=7, reason="not_found"),
            pb.FailedBlock(group=1, block_id=9, reason="transfer_failed"),
            pb.FailedBlock(group=2, block_id=7, reason="not_found"),
        ],
    )
    result = LoadResult.from_proto(message)
    assert result.failures[1] == FailedBlock(1, 9, "transfer_failed")
    assert result.failed_block_ids == {7, 9}
    assert LoadResult(0, 0).failed_block_ids == set()


def test_session_info_and_registration_from_proto():
    message = pb.OpenSessionResponse(
        session_id="secret",
        lease_ms=10000,
        hit_alignment_tokens=16,
        fine_grained_hits=True,
        groups=[pb.GroupPlacement(replication_factor=2, shard_id=1, keys_per_boundary=2, span_tokens=16)],
        daemon_version="0.1.0",
    )
    assert SessionInfo.from_proto(message) == SessionInfo(10000, 16, True, (GroupPlacement(2, 1, 2, 16),), "0.1.0")
    assert Registration.from_proto(pb.RegisterMemoryResponse(mapped_bytes=4096, value_bytes=[64, 128])) == (
        4096,
        (64, 128),
    )


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("unix:///run/kvsidecar/kvsidecar.sock", "unix:///run/kvsidecar/kvsidecar.sock"),
        ("/tmp/kvsidecar-0/kvsidecar.sock", "unix:///tmp/kvsidecar-0/kvsidecar.sock"),
        ("unix:relative.sock", "unix:relative.sock"),
        ("127.0.0.1:50051", "127.0.0.1:50051"),
    ],
)
def test_target(address, expected):
    assert target(address) == expected


def test_channel_options():
    options = dict(channel_options())
    assert options["grpc.max_send_message_length"] == 64 * 1024 * 1024 == DEFAULT_MAX_MESSAGE_BYTES
    assert options["grpc.max_receive_message_length"] == 64 * 1024 * 1024
    # Never ping more often than a default gRPC server tolerates (5 minutes without data), or it hangs up on us.
    assert options["grpc.keepalive_time_ms"] >= 300_000
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert options["grpc.max_reconnect_backoff_ms"] <= 1000
    # gRPC core reads it as the time a connection attempt may take (20 s by default): 100 ms failed handshakes
    # with a loaded daemon ("connection attempt timed out before receiving SETTINGS frame").
    assert "grpc.min_reconnect_backoff_ms" not in options
    assert dict(channel_options(1 << 20))["grpc.max_receive_message_length"] == 1 << 20


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan])
def test_deadlines_must_be_finite_and_positive(value):
    with pytest.raises(InvalidRequest, match="lookup"):
        Deadlines(lookup=value)


def test_save_job_waits_reports_and_calls_back():
    future = concurrent.futures.Future()
    job = SaveJob(future)
    seen = []
    job.add_done_callback(seen.append)
    assert not job.done()
    with pytest.raises(TimeoutError, match="still in flight"):
        job.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        job.exception(timeout=0.01)
    future.set_result(SaveResult(1, 0, 0, 0, 64))
    assert job.done() and job.result() == SaveResult(1, 0, 0, 0, 64, ()) and job.exception() is None
    assert seen == [job]


def test_a_failed_save_job_raises_its_error():
    future = concurrent.futures.Future()
    future.set_exception(DaemonUnavailable("gone", method="Save"))
    job = SaveJob(future)
    assert job.done()
    assert isinstance(job.exception(), DaemonUnavailable)
    with pytest.raises(DaemonUnavailable, match="gone"):
        job.result()
