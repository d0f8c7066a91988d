"""The gRPC servicer without a socket, as grpc's own examples test servicers: each row's behaviour over a dispatcher
and the in-memory store, with a ServicerContext that records the status an aborted call answers with (grpc.aio's
context raises from abort; this one does too)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.rpc.handlers import Handlers
from kvsidecar.rpc.servicer import answering
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.live import Tenancy
from kvsidecar_contract.methods import BY_NAME


class Aborted(Exception):
    """What the context raises on abort, carrying the status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    """A grpc.aio ServicerContext as far as the servicer uses it."""

    def __init__(
        self,
        peer: str = "unix:",
        metadata: Sequence[tuple[str, str]] = (),
        subject: str | None = None,
        remaining: float | None = None,
    ) -> None:
        self._peer, self._metadata, self._subject, self._remaining = peer, tuple(metadata), subject, remaining

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_subject": [self._subject.encode()]} if self._subject else {}

    def time_remaining(self) -> float | None:
        return self._remaining

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def service(tenants: Path | None = None, gpu_failure: str = "") -> Dispatcher:
    """A dispatcher over the in-memory store (single-tenant without a tenants file), two data workers."""
    store, metrics = MemoryStore(), Metrics()
    sessions = SessionRegistry(30, Movers(store, metrics), metrics=metrics)
    tenancy = Tenancy(metrics, str(tenants) if tenants else "")
    handlers = Handlers(DataPath(store, metrics), sessions, tenancy, metrics, gpu_failure=lambda: gpu_failure)
    return Dispatcher(handlers, metrics, workers=2)


def call(svc: Dispatcher, method: str, request: Any, context: Context | None = None) -> Any:
    """A gRPC call of `method` (a message, or the bytes a client sent) answered by the row's behaviour."""
    body = request if isinstance(request, bytes) else request.SerializeToString()
    return asyncio.run(answering(svc, BY_NAME[method])(body, context or Context()))


def refused(svc: Dispatcher, method: str, request: Any, context: Context | None = None) -> Aborted:
    """The status a call of `method` is aborted with."""
    with pytest.raises(Aborted) as err:
        call(svc, method, request, context)
    return err.value


def sample(svc: Dispatcher, name: str, labels: dict[str, str]) -> float:
    """One sample of the dispatcher's metrics (0 before it is counted)."""
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0
