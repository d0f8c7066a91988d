"""A look at a running daemon for operators' tools (`kvsidecar status`, `kvsidecar retention`): a channel as the
client opens it, and the daemon's Stats (and an operator's calls) made as this process's own uid."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import grpc

from kvsidecar_client._channel import TcpAuth, make_channel
from kvsidecar_client._side import side_socket_for
from kvsidecar_client.errors import SidecarError, from_rpc_error
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto.sidecar_pb2_grpc import SidecarStub

__all__ = ["DaemonProbe"]


class DaemonProbe:
    """A channel to the daemon at address (a Unix socket, or with auth its TCP listener), closed by `close` or at
    the end of a `with` block.

    `channel` carries whatever else a tool asks (the gRPC health service, say); `stats` asks for the daemon's Stats
    with a side-socket ticket over a Unix socket, so a tenant sees its own sessions.
    """

    def __init__(self, address: str, auth: TcpAuth | None = None) -> None:
        self.address = address
        self._auth = auth
        self.channel: grpc.Channel = make_channel(address, auth=auth)

    def stats(self, timeout: float) -> pb.StatsResponse:
        """The daemon's Stats; raises the client's SidecarError for a refusal (PermissionDenied: this uid is no
        tenant's) or an unreachable daemon."""
        stats: pb.StatsResponse = self._call("Stats", pb.StatsRequest(), timeout)
        return stats

    def drop_retention(self, tenant: str, timeout: float) -> pb.DropRetentionResponse:
        """Make every value tenant's requests retained ordinary cache again (an operator's credential only:
        PermissionDenied otherwise)."""
        dropped: pb.DropRetentionResponse = self._call("DropRetention", pb.DropRetentionRequest(tenant=tenant), timeout)
        return dropped

    def _call(self, method: str, request: object, timeout: float) -> Any:
        """One call with this uid's side-socket ticket over a Unix socket (the TCP listener's own credentials else)."""
        side = side_socket_for(self.address) if self._auth is None else None
        try:
            metadata = tuple(side.metadata(timeout)) if side is not None else ()
        except SidecarError:
            metadata = ()  # an older daemon without a side socket, or one still starting
        try:
            return getattr(SidecarStub(self.channel), method)(request, timeout=timeout, metadata=metadata or None)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, method) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> DaemonProbe:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
