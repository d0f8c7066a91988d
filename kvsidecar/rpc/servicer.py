"""The gRPC servicer: each method of the table (`kvsidecar_contract.methods`) read into its plain handler call
(handlers.py) and run as its row says, off the event loop.

The one gRPC boundary where failures become statuses (statuses.py), counted and raised with context.abort. A call's
credentials are read off its context on the event loop; its handler asks for them where it decides by the caller.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.rpc.auth import caller_of
from kvsidecar.rpc.handlers import Call, Handlers
from kvsidecar_contract.methods import METHODS, Method
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc

__all__ = ["SidecarService"]


class SidecarService(Handlers, pb_grpc.SidecarServicer):
    """kvsidecar.v1.Sidecar over gRPC: one `async def Method(request, context)` per table row (set below)."""


def _grpc_method(method: Method) -> Callable[[SidecarService, Any, Any], Awaitable[Any]]:
    """The servicer method of one row: admit the call, wait for its gate, run its handler in its pool."""

    async def answer(self: SidecarService, request: Any, context: Any) -> Any:
        self.metrics.requests.labels(method.name).inc()
        try:
            call = Call(_deadline(context), functools.partial(caller_of, _Seen(context), self.tenancy.tickets))
            work = self.admit(method, request, call)
            if method.pool == "loop":
                return work()
            loop = asyncio.get_running_loop()
            pool = self._pools[method.pool]
            if method.pool == "data":
                work = functools.partial(self.in_data_slot, work)
            if method.gate:
                # One account's gated calls hold at most its share of the slots; the rest wait here.
                async with self._lookup_gates.hold(self.sessions.account_of(request.session_id)):
                    return await loop.run_in_executor(pool, work)
            return await loop.run_in_executor(pool, work)
        except Exception as exc:
            code, reason = self.refused(method.name, exc)
            await context.abort(code, reason)
            raise AssertionError("unreachable: context.abort raises") from exc

    answer.__name__ = answer.__qualname__ = method.name
    return answer


for _method in METHODS:
    setattr(SidecarService, _method.name, _grpc_method(_method))


class _Seen:
    """What caller_of reads of a call's context, read on the event loop (a handler asks for it in a pool thread)."""

    def __init__(self, context: Any) -> None:
        self._peer: str = context.peer() or ""
        self._metadata = context.invocation_metadata() or ()
        # A Unix call's credential is its ticket; only a TCP call's is in its TLS session.
        self._auth = {} if self._peer.startswith("unix:") else context.auth_context() or {}

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> Any:
        return self._metadata

    def auth_context(self) -> Any:
        return self._auth


def _deadline(context: Any) -> float | None:
    """The client's deadline on time.monotonic(), if it set one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
