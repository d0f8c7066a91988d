"""The session with the daemon: opening it, keeping it alive, and re-opening and re-registering it after a loss.

Liveness. Right after OpenSession the keeper opens the session's liveness connection on the daemon's data socket
(`DataSocket.hold`): while it is open the daemon never expires the session, so an engine too busy (GIL, CPU) to send
its KeepAlives in time keeps it, and when the process exits or is killed the kernel closes it and the daemon
releases the session at once. Without a data socket (TCP, older daemons) the lease alone applies.

Reconnect protocol. A background thread renews the session with KeepAlive every lease/3. When the daemon answers
NOT_FOUND (the lease expired, or the daemon restarted and forgot every session), the keeper opens a new session with
the same OpenSessionRequest and registers the same tensors again, and only then publishes it; calls made with the old
session get NOT_FOUND too, wait for that re-open (never longer than their own deadline) and are retried once on the
new session. While the daemon cannot be reached, the thread probes it every 0.5 s and calls fail at once with
DaemonUnavailable; the first probe or call that reaches a restarted daemon gets NOT_FOUND and re-opens. A daemon
that was only briefly unreachable still knows the session, so it is kept.

This is the only module that calls the gRPC stub, and every failure leaves it mapped by `errors.from_rpc_error`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from kvsidecar_client._data import DataSocket
from kvsidecar_client._side import SideSocket
from kvsidecar_client.deadlines import Deadlines
from kvsidecar_client.descriptions import describe_regions
from kvsidecar_client.errors import (
    ClientClosed,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidRequest,
    PermissionDenied,
    PreconditionFailed,
    SessionLost,
    SidecarError,
    from_rpc_error,
)
from kvsidecar_client.layout import SessionSpec
from kvsidecar_client.results import Registration, SessionInfo
from kvsidecar_contract.limits import MAX_MEMFDS
from kvsidecar_contract.methods import BY_FRAME
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto.sidecar_pb2_grpc import SidecarStub

if TYPE_CHECKING:
    import torch

__all__ = ["LiveSession", "Memory", "SessionKeeper", "remaining"]

_FRAMED = frozenset(method.name for method in BY_FRAME.values())  # the calls the data socket carries

log = logging.getLogger("kvsidecar_client")

RETRY_INTERVAL = 0.5  # seconds between probes while the daemon is unreachable
_FALLBACK_LEASE_MS = 15_000  # if a daemon ever answers lease_ms 0
_CLOSE_SESSION_TIMEOUT = 2.0

# Each registered tensor: (tensor, the groups it serves, its KV-head dim or None).
Memory = tuple[tuple["torch.Tensor", tuple[int, ...], int | None], ...]


@dataclass(frozen=True, eq=False)
class LiveSession:
    """One open session; compared by identity, so any object other than the current one is stale."""

    id: str
    info: SessionInfo
    side_secret: bytes = b""  # proves this session's side-socket requests; empty when the daemon has no side socket


def remaining(deadline: float, method: str) -> float:
    """Seconds left before `deadline`, or DeadlineExceeded."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("no time left after re-opening the session", method=method)
    return left


class SessionKeeper:
    """Owns the channel, the current session and the registered memory, and keeps the session alive."""

    def __init__(
        self,
        channel: grpc.Channel,
        spec: SessionSpec,
        deadlines: Deadlines,
        side: SideSocket | None = None,
        data: DataSocket | None = None,
    ) -> None:
        self.channel = channel
        self.side = side  # the daemon's side socket (Unix-socket daemons): tickets and memfd passing
        self.data = data  # the daemon's data socket (Unix-socket daemons): saves, loads, lookups without gRPC
        self.stub = SidecarStub(channel)
        self.spec = spec
        self.deadlines = deadlines
        self.closed = threading.Event()
        # Serializes opening, registering and re-opening; data calls never hold it.
        self._lock = threading.Lock()
        self._session: LiveSession | None = None
        self._memory: Memory | None = None
        self._registration: Registration | None = None
        self._lease_ms = _FALLBACK_LEASE_MS
        self._store_healthy: bool | None = None
        self._down_reason: str | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- state ----

    @property
    def session(self) -> LiveSession | None:
        """The current session, or None while none is open."""
        return self._session

    @property
    def registered(self) -> bool:
        """Memory was registered (and is registered again on every new session)."""
        return self._memory is not None

    @property
    def registration(self) -> Registration | None:
        """The daemon's answer to the latest registration."""
        return self._registration

    @property
    def connected(self) -> bool:
        """A session is open and the daemon answered the last keep-alive."""
        return self._session is not None and self._down_reason is None

    @property
    def store_healthy(self) -> bool | None:
        """The store's health as of the last keep-alive."""
        return self._store_healthy

    def check_open(self, method: str) -> None:
        """Raise ClientClosed after close()."""
        if self.closed.is_set():
            raise ClientClosed("the client is closed", method=method)

    # ---- lifecycle ----

    def start(self) -> None:
        """Open the first session (waiting up to the connect deadline for the daemon) and start the keep-alive."""
        with self._lock:
            self.check_open("OpenSession")
            if self._thread is not None:
                raise PreconditionFailed("the client is already started", method="OpenSession")
            self._open_locked(wait_for_ready=True, timeout=self.deadlines.connect)
            self._thread = threading.Thread(target=self._keepalive_loop, name="kvsidecar-keepalive", daemon=True)
        self._thread.start()

    def register(self, memory: Memory, timeout: float) -> Registration:
        """Register memory on the current session (opening one if needed) and remember it for every later session."""
        # Describe every region before talking to the daemon, so bad tensors fail here with their reason.
        fds: list[int] = []  # sealed memfds to pass first; refused later if there is no side socket
        regions = describe_regions(memory, fds, self.spec.cuts())
        if not self._lock.acquire(timeout=timeout):
            raise DeadlineExceeded("the session is being re-opened; try again", method="RegisterMemory")
        try:
            self.check_open("RegisterMemory")
            if self._memory is not None:
                raise PreconditionFailed("memory is registered once per client", method="RegisterMemory")
            session = self._session or self._open_locked(wait_for_ready=False, timeout=self.deadlines.control)
            try:
                registration = self._register_rpc(session, regions, fds, timeout)
            except SessionLost:
                self._session = None
                session = self._open_locked(wait_for_ready=False, timeout=self.deadlines.control)
                registration = self._register_rpc(session, regions, fds, timeout)
            self._memory = memory
            self._registration = registration
            return registration
        finally:
            self._lock.release()

    def close(self, timeout: float) -> None:
        """Stop the keep-alive, close the session if the daemon is there, and close the channel."""
        self.closed.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        locked = self._lock.acquire(timeout=timeout)
        session, self._session = self._session, None
        if locked:
            self._lock.release()
        if session is not None:
            self._close_quietly(session)
        if self.data is not None:
            self.data.close()
        self.channel.close()

    # ---- calls ----

    def rpc(
        self,
        method: str,
        request: Any,
        timeout: float,
        *,
        wait_for_ready: bool = False,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> Any:
        """One call, its failure mapped into the client's exceptions; saves, loads and lookups go over the data
        socket where the daemon has one for this session."""
        session = self._session
        if self.data is not None and method in _FRAMED and session is not None and session.id == request.session_id:
            try:
                response = self.data.call(session.id, session.side_secret, method, request, timeout)
            except DaemonUnavailable as error:
                if self.closed.is_set():
                    raise ClientClosed("the client was closed during the call", method=method) from None
                raise error
            if response is not None:
                return response
        try:
            extra = {"metadata": tuple(metadata)} if metadata else {}
            return getattr(self.stub, method)(request, timeout=timeout, wait_for_ready=wait_for_ready, **extra)
        except grpc.RpcError as error:
            raise self.map_error(error, method) from None
        except ValueError:
            # grpc refuses calls on a closed channel with a ValueError.
            if self.closed.is_set():
                raise ClientClosed("the client is closed", method=method) from None
            raise

    def map_error(self, error: grpc.RpcError, method: str) -> SidecarError:
        """A failed call's exception; calls cut short by close() are ClientClosed."""
        mapped = from_rpc_error(error, method)
        if self.closed.is_set() and isinstance(mapped, DaemonUnavailable):
            return ClientClosed("the client was closed during the call", method=method)
        return mapped

    def call(self, method: str, request: Any, timeout: float) -> Any:
        """A session-bound call: on NOT_FOUND, re-open (or adopt another thread's re-open) and retry once."""
        deadline = time.monotonic() + timeout
        session = self._session or self.recover(None, deadline, method)
        request.session_id = session.id
        try:
            return self.rpc(method, request, timeout)
        except SessionLost:
            session = self.recover(session, deadline, method)
        request.session_id = session.id
        return self.rpc(method, request, remaining(deadline, method))

    def recover(self, stale: LiveSession | None, deadline: float, method: str) -> LiveSession:
        """A session other than `stale`: the one another thread opened meanwhile, or a new one opened here."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise DeadlineExceeded("the session is being re-opened; the call ran out of time", method=method)
        try:
            self.check_open(method)
            current = self._session
            if current is not None and current is not stale:
                return current
            self._session = None
            if stale is not None:
                log.warning("kvsidecar session lost (daemon restarted or lease expired); re-opening")
            return self._open_locked(wait_for_ready=False, timeout=self.deadlines.control)
        finally:
            self._lock.release()

    # ---- inside ----

    def _open_locked(self, *, wait_for_ready: bool, timeout: float) -> LiveSession:
        # Called with self._lock held. The session is published only once its memory is registered again, so no
        # call can reach the daemon with a session that would answer FAILED_PRECONDITION.
        response = self._open_rpc(timeout, wait_for_ready)
        session = LiveSession(response.session_id, SessionInfo.from_proto(response), response.side_secret)
        # Its liveness first: from here the daemon keeps the session while this process lives, however long a
        # registration or a busy engine's KeepAlives take, and releases it as soon as the process is gone.
        held = self.data is not None and self.data.hold(session.id, session.side_secret, self.deadlines.control)
        if self._memory is not None:
            try:
                fds: list[int] = []  # sealed memfds to pass first; refused later if there is no side socket
                regions = describe_regions(self._memory, fds, self.spec.cuts())
                self._registration = self._register_rpc(session, regions, fds, self.deadlines.register)
            except BaseException:
                self._close_quietly(session)
                if self.data is not None:
                    self.data.let_go()
                raise
        self._lease_ms = session.info.lease_ms or _FALLBACK_LEASE_MS
        self._session = session
        self._wake.set()  # the keep-alive thread adopts the new lease at once
        log.info(
            "kvsidecar session open (%s, daemon %s, %s%s)",
            self.spec.role,
            session.info.daemon_version or "?",
            "kept while this process lives" if held else f"lease {self._lease_ms} ms",
            ", memory registered" if self._memory is not None else "",
        )
        return session

    def _open_rpc(self, timeout: float, wait_for_ready: bool) -> pb.OpenSessionResponse:
        """OpenSession as who this process is; once more if the daemon's side socket appeared only during the call."""
        deadline = time.monotonic() + timeout
        metadata = self.credentials(timeout, "OpenSession")
        request = self.spec.to_proto()
        response: pb.OpenSessionResponse | None
        try:
            response = self.rpc("OpenSession", request, timeout, wait_for_ready=wait_for_ready, metadata=metadata)
        except PermissionDenied:
            if metadata or self.side is None or not self.side.available():
                raise
            response = None  # refused as nobody: the daemon came up after we asked for a ticket
        # A daemon that came up between the ticket request and the call opened the session without our uid.
        late = self.side is not None and not metadata and self.side.available()
        if response is not None and not (late and not response.side_secret):
            return response
        if response is not None:
            self._close_quietly(LiveSession(response.session_id, SessionInfo.from_proto(response)))
        left = remaining(deadline, "OpenSession")
        again: pb.OpenSessionResponse = self.rpc(
            "OpenSession", request, left, metadata=self.credentials(left, "OpenSession")
        )
        return again

    def credentials(self, timeout: float, method: str) -> list[tuple[str, str]]:
        """Metadata proving this process's uid to the daemon (a side-socket ticket); empty without a side socket."""
        if self.side is None:
            return []
        try:
            return self.side.metadata(timeout)
        except DaemonUnavailable:
            # A daemon still starting has no side socket yet; the gRPC call then says what is wrong.
            return []

    def _register_rpc(
        self, session: LiveSession, regions: Sequence[pb.MemoryRegion], fds: Sequence[int], timeout: float
    ) -> Registration:
        if len(fds) > MAX_MEMFDS:
            raise InvalidRequest(
                f"{len(fds)} memfd tensors: at most {MAX_MEMFDS} per session (views of one tensor share one)",
                method="RegisterMemory",
            )
        if fds:
            if self.side is None or not session.side_secret:
                raise InvalidRequest(
                    "sealed memfd tensors (shared_tensor's default) reach the daemon over its Unix socket's side "
                    "socket only; this client has none (a TCP daemon, an older daemon, or a channel of your own): "
                    "allocate with shared_tensor(shape, dtype, named=True) for trusted ranks",
                    method="RegisterMemory",
                )
            self.side.send_fds(session.id, session.side_secret, fds, timeout)
        request = pb.RegisterMemoryRequest(session_id=session.id, regions=regions)
        return Registration.from_proto(self.rpc("RegisterMemory", request, timeout))

    def _close_quietly(self, session: LiveSession) -> None:
        try:
            self.rpc("CloseSession", pb.CloseSessionRequest(session_id=session.id), _CLOSE_SESSION_TIMEOUT)
        except SidecarError as error:
            # The daemon may be gone or already forgot the session; either way its lease reclaims the mappings.
            log.debug("closing kvsidecar session: %s", error)

    def _keepalive_loop(self) -> None:
        while not self.closed.is_set():
            interval = self._lease_ms / 3000
            if self._session is None or self._down_reason is not None:
                interval = min(interval, RETRY_INTERVAL)
            self._wake.wait(interval)
            self._wake.clear()
            if self.closed.is_set():
                return
            try:
                self._keepalive_once()
            except Exception:
                # This thread is the session's liveness: an unexpected error must not end it silently.
                log.exception("kvsidecar keep-alive failed unexpectedly; retrying")

    def _keepalive_once(self) -> None:
        session = self._session
        deadline = time.monotonic() + self.deadlines.control
        try:
            if session is None:
                self.recover(None, deadline, "OpenSession")
            else:
                request = pb.KeepAliveRequest(session_id=session.id)
                try:
                    response = self.rpc("KeepAlive", request, self.deadlines.control)
                except SessionLost:
                    self.recover(session, deadline, "KeepAlive")
                else:
                    self._store_healthy = response.store_healthy
                    self._lease_ms = response.lease_ms or self._lease_ms
        except ClientClosed:
            return
        except SidecarError as error:
            if self._down_reason != str(error):
                log.warning("kvsidecar daemon unreachable (%s); retrying every %.1f s", error, RETRY_INTERVAL)
            self._down_reason = str(error)
            return
        if self._down_reason is not None:
            log.info("kvsidecar daemon reachable again")
            self._down_reason = None
