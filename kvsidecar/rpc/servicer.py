"""The Sidecar service over gRPC: every method-table row (`kvsidecar_contract.methods`) answered by the dispatcher.

A call's body reaches the dispatcher unparsed (gRPC's own deserializers raise before any servicer code runs, which
clients see as UNKNOWN with no reason); its credentials are read off its context on the event loop, and its
refusal is raised with context.abort. Nothing here is per method.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvsidecar.rpc import wire
from kvsidecar.rpc.auth import caller_of
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.rpc.handlers import Call
from kvsidecar_contract.methods import METHODS, Method

__all__ = ["answering", "sidecar_service"]


def sidecar_service(dispatcher: Dispatcher) -> grpc.GenericRpcHandler:
    """kvsidecar.v1.Sidecar for a gRPC server: each row's calls, as bytes, to the dispatcher."""
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            answering(dispatcher, method), response_serializer=method.response.SerializeToString
        )
        for method in METHODS
    }
    return grpc.method_handlers_generic_handler(wire.SERVICE_NAME, handlers)


def answering(dispatcher: Dispatcher, method: Method) -> Callable[[bytes, Any], Awaitable[Any]]:
    """The gRPC behaviour of one row: run the call, or abort it with its status."""
    tickets = dispatcher.handlers.tenancy.tickets

    async def answer(body: bytes, context: Any) -> Any:
        try:
            call = Call(_deadline(context), functools.partial(caller_of, _Seen(context), tickets))
            return await dispatcher.run(method, body, call)
        except Exception as exc:
            code, reason = dispatcher.refused(method.name, exc)
            await context.abort(code, reason)
            raise AssertionError("unreachable: context.abort raises") from exc

    return answer


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
