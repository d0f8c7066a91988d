"""Talking to the daemon the way a fuzzer must: any bytes in, every answer classified.

`Outcome` is what one call got back; `check_clean` is the property every fuzz case asserts: success, or a gRPC
error whose code is one the contract names for bad input and whose reason is not empty. UNKNOWN and INTERNAL are
daemon bugs; UNAVAILABLE and DEADLINE_EXCEEDED mean the daemon died or hung.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import grpc
from hypothesis import HealthCheck, Phase, settings

from kvsidecar_contract.proto import sidecar_pb2 as pb

SERVICE = "/kvsidecar.v1.Sidecar/"
METHODS: dict[str, tuple[type[Any], type[Any]]] = {
    "OpenSession": (pb.OpenSessionRequest, pb.OpenSessionResponse),
    "RegisterMemory": (pb.RegisterMemoryRequest, pb.RegisterMemoryResponse),
    "KeepAlive": (pb.KeepAliveRequest, pb.KeepAliveResponse),
    "CloseSession": (pb.CloseSessionRequest, pb.CloseSessionResponse),
    "Save": (pb.SaveRequest, pb.SaveResponse),
    "Lookup": (pb.LookupRequest, pb.LookupResponse),
    "Load": (pb.LoadRequest, pb.LoadResponse),
    "SaveBatch": (pb.SaveBatchRequest, pb.SaveBatchResponse),
    "LoadBatch": (pb.LoadBatchRequest, pb.LoadBatchResponse),
    "Reset": (pb.ResetRequest, pb.ResetResponse),
    "Stats": (pb.StatsRequest, pb.StatsResponse),
}

# What the contract lets a refused request answer (RESOURCE_EXHAUSTED: past the message size).
CLEAN_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
CALL_TIMEOUT_S = 20.0
SENT: Counter[str] = Counter()  # requests sent by every Wire of this process, by method ("raw " for raw bytes)


def scale() -> float:
    """KVSIDECAR_FUZZ_SCALE multiplies every fuzz test's example count (default 1; e.g. 20 for a long night run)."""
    return float(os.environ.get("KVSIDECAR_FUZZ_SCALE", "1"))


def examples(base: int) -> int:
    """base examples, scaled."""
    return max(1, int(base * scale()))


def fuzz_settings(base: int, **overrides: Any) -> settings:
    """Hypothesis settings of a fuzz test: `base` examples (scaled), no per-example deadline (the real daemon and
    master answer in milliseconds, but CI machines stall), and the print_blob to replay a failure."""
    return settings(
        max_examples=examples(base),
        deadline=None,
        print_blob=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        **overrides,
    )


class Outcome(NamedTuple):
    """The answer to one call: code OK with a response, or an error code with its reason."""

    method: str
    code: grpc.StatusCode
    details: str
    response: Any = None

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK

    def __str__(self) -> str:
        return f"{self.method} -> {self.code.name}: {self.details[:300]!r}"


def call(method: str, fn: Callable[[], Any]) -> Outcome:
    """Run one RPC and classify its answer (never raises for an RPC error)."""
    try:
        response = fn()
    except grpc.RpcError as error:
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        return Outcome(method, code, details or "")
    return Outcome(method, grpc.StatusCode.OK, "", response)


def check_clean(outcome: Outcome, allowed: Collection[grpc.StatusCode] | None = None, *, what: Any = "") -> None:
    """Success, or a contract error code with a non-empty reason; `allowed` narrows the codes further."""
    context = f"\nrequest: {what}" if what != "" else ""
    if outcome.ok:
        if allowed is not None and grpc.StatusCode.OK not in allowed:
            raise AssertionError(f"{outcome.method} succeeded, expected one of {_names(allowed)}{context}")
        return
    if outcome.code not in CLEAN_ERRORS:
        raise AssertionError(f"daemon answered {outcome} (a bug: never UNKNOWN/INTERNAL/UNAVAILABLE){context}")
    if not outcome.details.strip():
        raise AssertionError(f"{outcome.method} answered {outcome.code.name} without a reason{context}")
    if outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size exceeds" in outcome.details:
        raise AssertionError(f"the daemon's reason was too long for the client to receive: {outcome}{context}")
    if allowed is not None and outcome.code not in allowed:
        raise AssertionError(f"{outcome}: expected one of {_names(allowed)}{context}")


def _names(codes: Collection[grpc.StatusCode]) -> str:
    return ", ".join(sorted(c.name for c in codes))


class Wire:
    """Typed stubs and raw byte calls over one channel to the daemon."""

    def __init__(self, target: str, *, max_message_bytes: int = 128 << 20) -> None:
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_retries", 0),
        ]
        self.channel = grpc.insecure_channel(target, options=options)
        self._typed = {
            name: self.channel.unary_unary(
                SERVICE + name,
                request_serializer=req.SerializeToString,
                response_deserializer=resp.FromString,
            )
            for name, (req, resp) in METHODS.items()
        }
        # Identity (de)serializers: the bytes go out exactly as given, truncated or garbage.
        self._raw = {name: self.channel.unary_unary(SERVICE + name) for name in METHODS}

    def rpc(self, method: str, request: Any, timeout: float = CALL_TIMEOUT_S) -> Outcome:
        """A typed call, classified."""
        SENT[method] += 1
        return call(method, lambda: self._typed[method](request, timeout=timeout))

    def raw(self, method: str, payload: bytes, timeout: float = CALL_TIMEOUT_S) -> Outcome:
        """Send exactly these bytes as the request of `method`."""
        SENT["raw " + method] += 1
        return call(method, lambda: self._raw[method](payload, timeout=timeout))

    def close(self) -> None:
        self.channel.close()
