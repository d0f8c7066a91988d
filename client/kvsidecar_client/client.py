"""SidecarClient: what an engine rank (or its scheduler) calls to save, look up and load KV-cache blocks.

Sessions, keep-alive and reconnects live in `session.py`; this module validates input, builds requests and turns
answers into value types.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from kvsidecar_client._channel import DEFAULT_MAX_MESSAGE_BYTES, TcpAuth, make_channel
from kvsidecar_client._data import DataSocket, data_socket_for
from kvsidecar_client._side import SideSocket, side_socket_for, unix_socket_path
from kvsidecar_client.batch import LoadItem, SaveItem, load_items, parts, retention_message, save_items, send
from kvsidecar_client.deadlines import Deadlines
from kvsidecar_client.errors import (
    ClientClosed,
    DaemonUnavailable,
    InvalidRequest,
    PreconditionFailed,
    SidecarError,
)
from kvsidecar_client.jobs import SaveJob
from kvsidecar_client.layout import EngineLayout, GroupSpec, SessionSpec
from kvsidecar_client.results import Hit, LoadResult, Registration, SessionInfo
from kvsidecar_client.retention import Retention
from kvsidecar_client.saves import SaveSender
from kvsidecar_client.session import SessionKeeper
from kvsidecar_contract.limits import MAX_REGIONS
from kvsidecar_contract.mapping import hit_from_message
from kvsidecar_contract.placement.packed import PackedHashes
from kvsidecar_contract.proto import sidecar_pb2 as pb

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_REGIONS", "SidecarClient"]

# Lookups started with `lookup_async` run as blocking calls on this many threads per client (a scheduler's arrivals
# of one step are looked up side by side; more wait their turn, their deadline counting from the start of the call).
_LOOKUP_WORKERS = 4


class SidecarClient:
    """A session with the node's kvsidecar daemon: register memory once, then save, look up and load blocks.

    One client per engine rank (role "rank") or per scheduler (role "scheduler": lookups only), created in the
    process that uses it (gRPC channels do not survive fork). Thread-safe: save, lookup and load may be called from
    several threads. Build it with `connect`; `SidecarClient(channel, spec)` then `start()` does the same over a
    channel of your own.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        spec: SessionSpec,
        *,
        deadlines: Deadlines | None = None,
        side: SideSocket | None = None,
        data: DataSocket | None = None,
        retention: Retention | None = None,
    ) -> None:
        self._keeper = SessionKeeper(channel, spec, deadlines or Deadlines(), side, data)
        self._spec = spec
        self.retention = retention  # the default of saves and loads that name none
        self._deadlines = self._keeper.deadlines
        # Saves are sent, and re-sent after a lost session, from here.
        self._saves = SaveSender(self._keeper)
        self._lookups = concurrent.futures.ThreadPoolExecutor(_LOOKUP_WORKERS, "kvsidecar-lookup")

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        model: str,
        layout: EngineLayout,
        num_kv_heads: int,
        hash_block_size: int,
        groups: Sequence[GroupSpec],
        cache_prefix: str = "",
        value_identity: str = "",
        role: str = "rank",
        hash_bytes: int = 32,
        client_name: str | None = None,
        deadlines: Deadlines | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        auth: TcpAuth | None = None,
        hit_alignment_tokens: int = 0,
        fine_grained_hits: bool | None = None,
        share_across_tp: bool | int = False,
        data_socket: bool = True,
        retention: Retention | None = None,
    ) -> SidecarClient:
        """Open a session at `address` (unix:///path, a bare /path, or host:port), waiting for a daemon still starting.

        Raises InvalidRequest for a bad layout (before any I/O) and DaemonUnavailable when no daemon answers within
        the connect deadline. A TCP listener needs `auth` (TLS, a client certificate and/or a token).
        `value_identity` says what the engine's bytes mean beyond the model's name (docs/values.md); engines whose
        identities differ never share a value. `share_across_tp` stores the groups that allow it for every TP size
        (docs/placement.md rule 11): True per KV head, an int N as a TP=N engine holds its heads; every session of
        the engine must say the same. `data_socket`: send saves, loads and lookups over the daemon's data socket
        where it has one (a Unix-socket daemon; without the socket, or with False, they go over gRPC).
        `retention` is the default of every save and load that names none (docs/retention.md).
        """
        spec = SessionSpec(
            model=model,
            layout=layout,
            num_kv_heads=num_kv_heads,
            hash_block_size=hash_block_size,
            groups=tuple(groups),
            cache_prefix=cache_prefix,
            value_identity=value_identity,
            role=role,
            hash_bytes=hash_bytes,
            client_name=_default_client_name() if client_name is None else client_name,
            hit_alignment_tokens=hit_alignment_tokens,
            fine_grained_hits=fine_grained_hits,
            share_across_tp=share_across_tp,
        )
        path = unix_socket_path(address) if auth is None else None
        side = side_socket_for(address) if path is not None else None
        data = data_socket_for(path) if data_socket else None
        channel = make_channel(address, max_message_bytes, auth)
        client = cls(channel, spec, deadlines=deadlines, side=side, data=data, retention=retention)
        try:
            client.start()
        except BaseException:
            client.close()
            raise
        return client

    def start(self) -> None:
        """Open the session (waiting up to the connect deadline for the daemon) and start renewing it."""
        self._keeper.start()

    # ---- the engine's calls ----

    def register(
        self,
        tensors: Sequence[torch.Tensor],
        groups_of_tensor: Sequence[Sequence[int]],
        *,
        head_dims: Sequence[int | None] | None = None,
        timeout: float | None = None,
    ) -> Registration:
        """Register the rank's KV-cache tensors once (dim 0 = blocks; tensor i serves groups_of_tensor[i]).

        CPU tensors must come from `shared_tensor`; CUDA tensors are shared by CUDA IPC. The client keeps the tensors
        (and so their shared memory) alive, and registers them again on every re-opened session. head_dims[i] names
        tensor i's KV-head dim (None: none): needed where a group's values are cut by KV heads (share_across_tp),
        and that dim must then be the outermost of a block.
        """
        method = "RegisterMemory"
        self._keeper.check_open(method)
        if self._spec.is_scheduler:
            raise PreconditionFailed("a scheduler session has no memory to register", method=method)
        if len(tensors) != len(groups_of_tensor):
            raise InvalidRequest(
                f"{len(tensors)} tensors but {len(groups_of_tensor)} entries in groups_of_tensor", method=method
            )
        if not 1 <= len(tensors) <= MAX_REGIONS:
            raise InvalidRequest(f"register 1..{MAX_REGIONS} tensors, got {len(tensors)}", method=method)
        num_groups = len(self._spec.groups)
        dims = list(head_dims) if head_dims is not None else [None] * len(tensors)
        if len(dims) != len(tensors):
            raise InvalidRequest(f"{len(tensors)} tensors but {len(dims)} entries in head_dims", method=method)
        memory = tuple(
            (tensor, tuple(groups), dim) for tensor, groups, dim in zip(tensors, groups_of_tensor, dims, strict=True)
        )
        for index, (_, groups, _dim) in enumerate(memory):
            if not groups or any(not isinstance(g, int) or not 0 <= g < num_groups for g in groups):
                raise InvalidRequest(
                    f"tensor {index}: groups {groups!r} must name one or more of the {num_groups} groups",
                    method=method,
                )
        return self._keeper.register(memory, self._deadlines.register if timeout is None else timeout)

    def save(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        saved_tokens: int = 0,
        token_ids: Sequence[int] = (),
        token_ids_start: int = 0,
        retention: Retention | None = None,
        timeout: float | None = None,
    ) -> SaveJob:
        """Start saving the request's blocks and return at once; do not reuse the blocks before `job.done()`.

        `block_ids[g][i]` is group g's physical block for its i-th span; `token_ids`, optional, are the request's
        tokens from position `token_ids_start` on (the daemon's KV events then carry each stored block's tokens);
        `retention` keeps them ahead of ordinary cache (None: the client's default).
        Daemon trouble is reported by the job
        (`job.result()` raises), never by this call; bad input and a missing `register` raise here.
        """
        self._keeper.check_open("Save")
        self._require_memory("Save")
        timeout = self._deadlines.save if timeout is None else timeout
        deadline = time.monotonic() + timeout
        request = _request(
            "Save",
            pb.SaveRequest,
            block_hashes=block_hashes,
            block_ids=self._block_ids(block_ids, "Save"),
            num_tokens=num_tokens,
            saved_tokens=saved_tokens,
            token_ids=token_ids,
            token_ids_start=token_ids_start,
            retention=retention_message(retention or self.retention),
        )
        return self._saves.send(request, deadline)

    def save_batch(self, items: Sequence[SaveItem], *, timeout: float | None = None) -> dict[str, SaveJob]:
        """Start one SaveBatch call for many requests' saves (an engine step) and return each one's job by name.

        Each job is what `save` would have returned for its item: an item the client or the daemon refuses fails
        its own job only, daemon trouble fails every job of the call. Names must be unique.
        """
        method = "SaveBatch"
        self._keeper.check_open(method)
        self._require_memory(method)
        _unique([item.name for item in items], method)
        deadline = time.monotonic() + (self._deadlines.save if timeout is None else timeout)
        batch = save_items(items, lambda ids: self._block_ids(ids, method), self.retention)
        return self._saves.send_batch([item.name for item in items], batch, deadline)

    def lookup(
        self,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        *,
        eagle: bool = False,
        timeout: float | None = None,
        miss_on_unavailable: bool = True,
    ) -> Hit:
        """The longest prefix every group can serve (the last prompt token is always recomputed).

        With `miss_on_unavailable` (the default) an unreachable daemon or a lookup past its deadline answers a
        degraded miss (hit_tokens 0, degraded True) instead of raising DaemonUnavailable: the engine recomputes.
        """
        self._keeper.check_open("Lookup")
        info = self.session_info
        if info is not None and info.packed_hashes:
            # One field instead of one per hash: a 128k-token prompt's 8192 hashes cost ~0.1 ms to send, not ~0.9.
            # (A daemon older than packed_hashes, reached after a restart, would read no hashes: a miss.)
            hashes: dict[str, Any] = {"packed_block_hashes": _packed(block_hashes, self._spec.hash_bytes)}
        else:
            hashes = {"block_hashes": block_hashes}
        request = _request("Lookup", pb.LookupRequest, num_tokens=num_tokens, eagle=eagle, **hashes)
        try:
            response = self._keeper.call("Lookup", request, self._deadlines.lookup if timeout is None else timeout)
        except DaemonUnavailable as error:
            if not miss_on_unavailable:
                raise
            return Hit.miss(len(self._spec.groups), f"daemon unavailable: {error}")
        return hit_from_message(response)

    def lookup_async(
        self,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        *,
        eagle: bool = False,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Hit]:
        """Start `lookup` on a client thread and return its future at once (for a caller that must never wait).

        The future holds what `lookup` returns (a degraded miss when the daemon is unreachable or past the
        deadline) or the SidecarError it raises, bad input (InvalidRequest) included: building the request of a
        long prompt is work this call leaves to the client thread. Cancelling a lookup not yet started keeps it
        from being sent; one already sent completes, and its answer is dropped with the future.
        """
        self._keeper.check_open("Lookup")
        hashes = list(block_hashes)  # the caller may change its sequence meanwhile
        try:
            return self._lookups.submit(self.lookup, hashes, num_tokens, eagle=eagle, timeout=timeout)
        except RuntimeError:  # the pool is shut down: the client closed
            raise ClientClosed("the client is closed", method="Lookup") from None

    def load_detailed(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        hit: Hit,
        *,
        start_tokens: int = 0,
        retention: Retention | None = None,
        groups: Sequence[int] = (),
        timeout: float | None = None,
    ) -> LoadResult:
        """Read a lookup's hit into the blocks `block_ids` (per group) and name every block that failed; with
        `retention` (None: the client's default) what it read is kept ahead of ordinary cache. `groups` names the
        KV-cache groups the load is for (empty: every group): the others' blocks are neither read nor reported
        failed, whatever their block ids (an engine that moves one group per call).

        Raises DaemonUnavailable when the daemon cannot be reached: the client cannot know which blocks the load
        would have read, so the engine must then recompute every block it asked for.
        """
        self._keeper.check_open("Load")
        self._require_memory("Load")
        ids = self._block_ids(block_ids, "Load")
        if hit.hit_tokens == 0:
            return LoadResult(0, 0, ())
        request = _request(
            "Load",
            pb.LoadRequest,
            block_hashes=block_hashes,
            block_ids=ids,
            hit_tokens=hit.hit_tokens,
            tail_boundaries=hit.tail_boundaries,
            start_tokens=start_tokens,
            retention=retention_message(retention or self.retention),
            carried_groups=groups,
        )
        response = self._keeper.call("Load", request, self._deadlines.load if timeout is None else timeout)
        return LoadResult.from_proto(response)

    def load_batch(
        self, items: Sequence[LoadItem], *, timeout: float | None = None
    ) -> dict[str, LoadResult | SidecarError]:
        """Many requests' loads in one LoadBatch call (an engine step): each item's result or its own error, by name.

        An item answered with an error read nothing the client can vouch for: the engine recomputes every block
        that item asked for, as after `load_detailed` raised. Names must be unique.
        """
        method = "LoadBatch"
        self._keeper.check_open(method)
        self._require_memory(method)
        _unique([item.name for item in items], method)
        batch = load_items(items, lambda ids: self._block_ids(ids, method), self.retention)
        deadline = time.monotonic() + (self._deadlines.load if timeout is None else timeout)
        for part in parts(batch):
            send(self._keeper, method, part, LoadResult, deadline)
        out: dict[str, LoadResult | SidecarError] = {}
        for item, outcome in zip(items, batch.outcomes(), strict=True):
            if isinstance(outcome, Exception) and not isinstance(outcome, SidecarError):
                raise outcome  # not the daemon's answer nor the client's refusal: a fault of its own
            out[item.name] = outcome
        return out

    def load(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        hit: Hit,
        *,
        start_tokens: int = 0,
        retention: Retention | None = None,
        groups: Sequence[int] = (),
        timeout: float | None = None,
    ) -> set[int]:
        """Like `load_detailed`, returning only the ids of the blocks that failed to load."""
        result = self.load_detailed(
            block_hashes, block_ids, hit, start_tokens=start_tokens, retention=retention, groups=groups, timeout=timeout
        )
        return result.failed_block_ids

    def reset(self, *, timeout: float | None = None) -> int:
        """Remove every stored block of this model under this cache prefix; returns how many were removed."""
        self._keeper.check_open("Reset")
        timeout = self._deadlines.control if timeout is None else timeout
        return int(self._keeper.call("Reset", pb.ResetRequest(), timeout).removed)

    def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        """Daemon, store and session state, as the daemon reports it."""
        self._keeper.check_open("Stats")
        timeout = self._deadlines.control if timeout is None else timeout
        metadata = self._keeper.credentials(timeout, "Stats")
        response: pb.StatsResponse = self._keeper.rpc("Stats", pb.StatsRequest(), timeout, metadata=metadata)
        return response

    def close(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` s (default: the control deadline) for saves in flight, then close session and channel.

        Never raises for a daemon that is gone: its lease reclaims the session.
        """
        if self._keeper.closed.is_set():
            return
        timeout = self._deadlines.control if timeout is None else timeout
        concurrent.futures.wait(self._saves.pending(), timeout=timeout)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._keeper.close(timeout)
        self._saves.shutdown()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- state for the engine and for operators ----

    @property
    def spec(self) -> SessionSpec:
        """What this client told the daemon about its engine."""
        return self._spec

    @property
    def session_info(self) -> SessionInfo | None:
        """The current session's lease, hit alignment and placement; None while no session is open."""
        session = self._keeper.session
        return None if session is None else session.info

    @property
    def registration(self) -> Registration | None:
        """The daemon's answer to the latest registration of memory, or None before `register`."""
        return self._keeper.registration

    @property
    def connected(self) -> bool:
        """A session is open and the daemon answered the last keep-alive."""
        return self._keeper.connected

    @property
    def store_healthy(self) -> bool | None:
        """The store's health as of the last keep-alive; None before the first one."""
        return self._keeper.store_healthy

    # ---- input ----

    def _require_memory(self, method: str) -> None:
        if self._spec.is_scheduler:
            raise PreconditionFailed(f"a scheduler session has no memory: {method} is for engine ranks", method=method)
        if not self._keeper.registered:
            raise PreconditionFailed("register() the KV-cache tensors first", method=method)

    def _block_ids(self, block_ids: Sequence[Sequence[int]], method: str) -> list[pb.BlockIds]:
        if len(block_ids) != len(self._spec.groups):
            raise InvalidRequest(
                f"block_ids needs one list per KV-cache group ({len(self._spec.groups)}), got {len(block_ids)}",
                method=method,
            )
        try:
            return [pb.BlockIds(ids=ids) for ids in block_ids]
        except (TypeError, ValueError) as error:
            raise InvalidRequest(f"block ids must be ints in [0, 2**32): {error}", method=method) from None


def _request(method: str, message: Any, **fields: Any) -> Any:
    # protobuf raises TypeError/ValueError for a str hash or a negative count: give the engine our error type.
    try:
        return message(**fields)
    except (TypeError, ValueError) as error:
        raise InvalidRequest(f"bad {method} request: {error}", method=method) from None


def _packed(block_hashes: Sequence[bytes], hash_bytes: int) -> bytes:
    try:
        return PackedHashes.of(block_hashes, hash_bytes).data
    except (TypeError, ValueError) as error:
        raise InvalidRequest(f"bad Lookup request: {error}", method="Lookup") from None


def _unique(names: Sequence[str], method: str) -> None:
    if len(set(names)) != len(names):
        raise InvalidRequest(f"item names must be unique within a batch ({len(names)} items)", method=method)


def _default_client_name() -> str:
    from kvsidecar_client import __version__

    return f"{socket.gethostname()} pid={os.getpid()} kvsidecar-client/{__version__}"
