"""gRPC status codes map into the client's exception hierarchy in one table, keeping the daemon's reason."""

import grpc
import pytest

from kvsidecar_client import errors
from kvsidecar_client.errors import (
    DaemonError,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidRequest,
    PermissionDenied,
    PreconditionFailed,
    ResourceExhausted,
    SessionLost,
    SidecarError,
    Unsupported,
    from_rpc_error,
)
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto.sidecar_pb2_grpc import SidecarStub

C = grpc.StatusCode

TABLE = [
    (C.INVALID_ARGUMENT, InvalidRequest),
    (C.OUT_OF_RANGE, InvalidRequest),
    (C.NOT_FOUND, SessionLost),
    (C.UNAVAILABLE, DaemonUnavailable),
    (C.CANCELLED, DaemonUnavailable),
    (C.DEADLINE_EXCEEDED, DeadlineExceeded),
    (C.FAILED_PRECONDITION, PreconditionFailed),
    (C.ALREADY_EXISTS, PreconditionFailed),
    (C.ABORTED, PreconditionFailed),
    (C.PERMISSION_DENIED, PermissionDenied),
    (C.UNAUTHENTICATED, PermissionDenied),
    (C.RESOURCE_EXHAUSTED, ResourceExhausted),
    (C.UNIMPLEMENTED, Unsupported),
    (C.INTERNAL, DaemonError),
    (C.UNKNOWN, DaemonError),
    (C.DATA_LOSS, DaemonError),
]


class FailedCall(grpc.RpcError, grpc.Call):
    """A finished call with a status, as grpc raises it (a test double: the real one needs a server)."""

    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


@pytest.mark.parametrize(("code", "cls"), TABLE, ids=[code.name for code, _ in TABLE])
def test_each_status_maps_to_its_class_and_keeps_the_reason(code, cls):
    error = from_rpc_error(FailedCall(code, "block id 7 outside region 0 (4 blocks)"), "Save")
    assert type(error) is cls
    assert error.reason == "block id 7 outside region 0 (4 blocks)"
    assert error.code is code
    assert error.method == "Save"
    assert str(error) == f"Save: block id 7 outside region 0 (4 blocks) [{code.name}]"


def test_the_table_covers_every_status_but_ok():
    assert set(errors.STATUS_ERRORS) == set(C) - {C.OK}
    assert dict(TABLE) == errors.STATUS_ERRORS


def test_an_empty_reason_is_replaced_by_the_code():
    error = from_rpc_error(FailedCall(C.NOT_FOUND, ""), "KeepAlive")
    assert isinstance(error, SessionLost)
    assert error.reason == "not found"


def test_an_rpc_error_without_status_is_a_connection_failure():
    error = from_rpc_error(grpc.RpcError("socket closed"), "Lookup")
    assert type(error) is DaemonUnavailable
    assert error.code is None
    assert "socket closed" in str(error)


def test_local_errors_have_no_code():
    error = InvalidRequest("bad shape")
    assert isinstance(error, ValueError)
    assert isinstance(error, SidecarError)
    assert str(error) == "bad shape"


def test_a_real_call_to_no_daemon_is_unavailable(tmp_path):
    with grpc.insecure_channel(f"unix://{tmp_path}/absent.sock") as channel, pytest.raises(grpc.RpcError) as info:
        SidecarStub(channel).Stats(pb.StatsRequest(), timeout=5)
    error = from_rpc_error(info.value, "Stats")
    assert type(error) is DaemonUnavailable
    assert error.code is C.UNAVAILABLE
    assert error.reason
