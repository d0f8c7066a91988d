"""Who a call is: TLS (optionally with client certificates), bearer tokens, side-socket tickets; one parser for each.

Every credential a call carries is read here and only here, by the same code for the TCP listener's token check and
for the tenant a session acts for, so the two can never read a call two ways.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvsidecar.errors import ConfigError, Unauthenticated
from kvsidecar.tenancy.table import Caller, hash_token
from kvsidecar.tenancy.tickets import Tickets
from kvsidecar_contract.paths import TICKET_METADATA

log = logging.getLogger(__name__)

# Health answers carry nothing secret, and probes (kubelet, load balancers) cannot send tokens.
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/",)


AUTHORIZATION = "authorization"
BEARER = "Bearer "


def metadata_value(metadata: Any, key: str) -> str | None:
    """The one value of a metadata key (None when absent); Unauthenticated when the call sent it more than once."""
    values = [v for k, v in (metadata or ()) if k == key]
    if not values:
        return None
    if len(values) > 1:
        raise Unauthenticated(f"the call sent {len(values)} {key!r} headers: send exactly one")
    value = values[0]
    return value if isinstance(value, str) else bytes(value).decode(errors="replace")


def bearer_token_hash(metadata: Any) -> str | None:
    """The `sha256:` hash of the call's bearer token (`authorization: Bearer <token>`), or None without one."""
    sent = metadata_value(metadata, AUTHORIZATION)
    if sent is None or not sent.startswith(BEARER):
        return None
    return hash_token(sent.removeprefix(BEARER))


def caller_of(context: Any, tickets: Tickets) -> Caller:
    """The credentials a call proved: a redeemed side-socket ticket (Unix), or its certificate and token (TCP)."""
    peer: str = context.peer() or ""
    metadata = context.invocation_metadata() or ()
    if peer.startswith("unix:"):
        ticket = metadata_value(metadata, TICKET_METADATA)
        cred = tickets.redeem(ticket) if ticket is not None else None
        if cred is None:
            return Caller(transport="unix")
        return Caller(uid=cred.uid, gids=cred.groups, transport="unix")
    auth = context.auth_context() or {}
    subjects = auth.get("x509_subject") or []
    subject = subjects[0].decode(errors="replace") if subjects else None
    return Caller(cert_subject=subject, token_hash=bearer_token_hash(metadata), transport="tcp")


def read_token(path: str) -> str:
    """The token in a file (surrounding whitespace ignored); it must not be empty."""
    p = Path(path)
    try:
        token = p.read_text().strip()
        mode = p.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO) & ~stat.S_IRGRP:
        log.warning("token file %s is readable by others (mode %o): make it 0600 or 0640", path, mode & 0o777)
    return token


@dataclass(frozen=True)
class TlsSettings:
    """The TCP listener's files (cut from Config): certificate chain, key, client CA ("": none) and token file."""

    cert: str
    key: str
    client_ca: str
    token_file: str


def server_credentials(config: TlsSettings) -> grpc.ServerCredentials:
    """TLS credentials of the TCP listener, requiring client certificates when a client CA is configured."""

    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None

    chain = read(config.cert, "TLS certificate")
    key = read(config.key, "TLS key")
    ca = read(config.client_ca, "client CA") if config.client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


class TokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call without `authorization: Bearer <token>` of a known token (health checks excepted).

    Tokens are kept as SHA-256 hashes (`hash_token`): the --token-file token and every tenant's, asked for at each
    call so a reloaded tenants file applies at once. Every hash is compared in constant time.
    """

    def __init__(
        self,
        token: str | None,
        on_refused: Callable[[str], None] | None = None,
        more: Callable[[], Sequence[bytes]] = tuple,
    ) -> None:
        self._fixed = [hash_token(token).encode()] if token else []
        self._more = more
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(UNAUTHENTICATED_METHODS):
            return handler
        reason = "missing or wrong bearer token: send `authorization: Bearer <token>`"
        try:
            token_hash = bearer_token_hash(details.invocation_metadata)
        except Unauthenticated as exc:
            token_hash, reason = None, str(exc)
        if token_hash is not None:
            digest = token_hash.encode()
            if any([hmac.compare_digest(digest, h) for h in [*self._fixed, *self._more()]]):
                return handler
        if self._on_refused is not None:
            self._on_refused(method)
        return _refusal(handler, reason)


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)


def check_files_exist(config: TlsSettings) -> None:
    """Fail at start-up, not at the first TLS handshake, when a configured file is missing."""
    for path in (config.cert, config.key, config.client_ca, config.token_file):
        if path and not os.path.isfile(path):
            raise ConfigError(f"no such file: {path}")
