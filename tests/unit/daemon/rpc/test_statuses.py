"""The one table from domain errors to gRPC statuses, and wire.py converting only (folder rules: test_layering.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from kvsidecar.errors import (
    BadRequest,
    DeviceUnavailable,
    Forbidden,
    OutOfOrder,
    RequestError,
    ShuttingDown,
    StoreError,
    TooLate,
    UnknownSession,
)
from kvsidecar.rpc.statuses import MAX_REASON_CHARS, status_of
from kvsidecar.store import StoreCode
from kvsidecar.store.base import StoreUnavailable
from kvsidecar_contract.placement import InvalidLayout, RequestMismatch

C = grpc.StatusCode
DAEMON = Path(__file__).resolve().parents[4] / "kvsidecar"


@pytest.mark.parametrize(
    ("error", "code", "reason"),
    [
        (BadRequest("block hash 1 has 3 bytes"), C.INVALID_ARGUMENT, "block hash 1 has 3 bytes"),
        (InvalidLayout("dcp_size 3 must divide tp_size 4"), C.INVALID_ARGUMENT, "dcp_size 3 must divide tp_size 4"),
        (RequestMismatch("hit past the prompt"), C.INVALID_ARGUMENT, "hit past the prompt"),
        (UnknownSession("unknown session 'x'"), C.NOT_FOUND, "unknown session 'x'"),
        (OutOfOrder("call RegisterMemory once"), C.FAILED_PRECONDITION, "call RegisterMemory once"),
        (Forbidden("a scheduler session"), C.PERMISSION_DENIED, "a scheduler session"),
        (ShuttingDown("the daemon is shutting down"), C.UNAVAILABLE, "the daemon is shutting down"),
        (DeviceUnavailable("the GPU path failed (cuda:0: ...)"), C.UNAVAILABLE, "the GPU path failed (cuda:0: ...)"),
        (
            TooLate("no lookup slot within the call's deadline"),
            C.DEADLINE_EXCEEDED,
            "no lookup slot within the call's deadline",
        ),
        (RequestError("odd"), C.INTERNAL, "odd"),
        (StoreError(StoreCode.INVALID_PARAMS, "bad key"), C.INVALID_ARGUMENT, "store: invalid_params: bad key"),
        (StoreError(StoreCode.NO_SPACE, "full"), C.UNAVAILABLE, "store: no_space: full"),
        (StoreUnavailable("master down"), C.UNAVAILABLE, "store: unavailable: master down"),
        (KeyError("k"), C.INTERNAL, "internal error: KeyError: 'k'"),
    ],
)
def test_each_error_has_its_status_and_reason(error, code, reason):
    assert status_of(error) == (code, reason)


def test_a_subclass_gets_its_nearest_listed_status():
    class Stale(UnknownSession):
        pass

    assert status_of(Stale("gone")) == (C.NOT_FOUND, "gone")


def test_long_reasons_are_cut_to_the_bound():
    code, reason = status_of(BadRequest("x" * 100_000))
    assert code is C.INVALID_ARGUMENT
    assert len(reason) <= MAX_REASON_CHARS and reason.endswith(" ... (reason cut)")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_wire_only_converts():
    forbidden = {
        "kvsidecar.datapath.transfers",
        "kvsidecar.memory.regions",
        "kvsidecar.sessions.registry",
        "kvsidecar.rpc.servicer",
        "kvsidecar.rpc.dispatch",
        "kvsidecar.rpc.handlers",
    }
    assert not _imports(DAEMON / "rpc" / "wire.py") & forbidden
    assert "grpc.method_handlers_generic_handler" not in (DAEMON / "rpc" / "wire.py").read_text()
