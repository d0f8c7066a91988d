"""The running daemon: embedded master, store, fence, metrics endpoint and gRPC servers, started and stopped in order.

Every part is built with what it needs, in dependency order; nothing is wired into another part after it is built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, start_http_server

from kvsidecar import __version__
from kvsidecar.daemon import notify
from kvsidecar.daemon.loopback import LoopbackGuard
from kvsidecar.daemon.master_link import connect_store
from kvsidecar.daemon.parts import build_data_path, build_service, build_sessions, open_tenancy
from kvsidecar.daemon.preflight import preflight
from kvsidecar.daemon.settings import EventSettings, Settings
from kvsidecar.daemon.signals import Signals, StopSignals
from kvsidecar.daemon.sockets import SocketLock, claim_socket
from kvsidecar.datapath.retries import DEFAULT_CALL_S, RetryPolicy
from kvsidecar.errors import ConfigError, DaemonError, FenceError
from kvsidecar.events.feed import NO_EVENTS
from kvsidecar.events.node import NodeEvents
from kvsidecar.events.publisher import PublisherError
from kvsidecar.fence.daemon import DaemonFence, policy_for
from kvsidecar.metrics import Metrics
from kvsidecar.movers.runtime import GpuRuntime
from kvsidecar.parsing import parse_address
from kvsidecar.rpc.datasocket import DataListener
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.rpc.servers import DISK_TIER_HEALTH, SERVICE_NAME, create_servers
from kvsidecar.rpc.side import SideChannel
from kvsidecar.store import Store
from kvsidecar.tenancy.live import Tenancy
from kvsidecar.tiers.node import DiskTierNode
from kvsidecar_contract.paths import data_socket_path, side_socket_path

if TYPE_CHECKING:
    from kvsidecar.daemon.master import EmbeddedMaster

__all__ = ["HOUSEKEEPING_INTERVAL_S", "SHUTDOWN_GRACE_S", "Daemon", "serve"]

log = logging.getLogger("kvsidecar")

HOUSEKEEPING_INTERVAL_S = 1.0
SHUTDOWN_GRACE_S = 5.0


class Daemon:
    """One kvsidecar process. Pass `store` to run over a given store (tests); by default it builds Mooncake's.

    Whatever the store, the daemon fences its listeners and, with --ssd-dir, keeps its disk tier. Each part is pushed
    with its undo onto one exit stack as it starts, so stop() (or a start that fails) undoes exactly what started,
    in reverse.
    """

    # Set once the start has come that far; read only by what runs after it (the housekeeping, health, tests).
    dispatcher: Dispatcher
    gpu: GpuRuntime
    _health: health_aio.HealthServicer

    def __init__(
        self,
        settings: Settings,
        *,
        store: Store | None = None,
        registry: CollectorRegistry | None = None,
        signals: Signals | None = None,
    ) -> None:
        """signals: the process's stop signals (serve's); a daemon in a thread of a test has none of its own."""
        self.settings = settings  # each part is told only its own settings from here on
        self.signals = signals or Signals()
        # The disk tier is the daemon's own (tiers/), so it opens no listener: a single node admits nobody.
        single_node = not settings.master.address
        self.fence = DaemonFence(
            policy_for(embedded_master=single_node, peer_networks=settings.master.peer_networks),
            self._master_admin_url,
        )
        self.metrics = Metrics(registry, listener_drops=self.fence.dropped)
        self._given_store = store
        self._owns_store = store is None  # the daemon opens Mooncake itself, and so owns its process's listeners
        self._parts = contextlib.AsyncExitStack()  # what started, each with its undo
        self.master: EmbeddedMaster | None = None
        self.master_address = settings.master.address
        self.loopback = LoopbackGuard.none("not started")
        self.tenancy: Tenancy | None = None  # a SIGHUP may come while the daemon starts
        self.disk_tier: DiskTierNode | None = None
        self.kv_events: NodeEvents | None = None
        self.addresses: list[str] = []
        self.metrics_url = ""
        self._store_call_s = DEFAULT_CALL_S  # the longest one Mooncake call takes (its RPC timeout)
        self.failure = ""  # why the daemon stopped itself, if it did

    async def start(self) -> None:
        """Start everything; on failure, stop what was started and raise DaemonError."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Undo what started, in reverse: refuse new work, drain, release sessions, close the store, stop the master,
        and let the socket go last."""
        notify.stopping()
        await self._parts.aclose()

    async def _start(self) -> None:
        """Every part, in dependency order, each pushed with its undo."""
        s, loop, parts = self.settings, asyncio.get_running_loop(), self._parts
        # Before anything is started: of any number of daemons started on one socket, one goes on from here.
        parts.callback(_let_socket_go, s.socket.path, claim_socket(s.socket.path, own_directory=s.socket.own_directory))
        gid = preflight(s)  # what can be checked without starting anything
        self.tenancy = tenancy = open_tenancy(s.tenancy, self.metrics)
        metrics_port = self._serve_metrics()  # bound now: a port in use fails the start before a master or Mooncake
        self.loopback = self._guard_loopback(loop)
        parts.callback(self.loopback.leave)
        if s.disk is not None:
            # Claims the directory and replays its index (seconds for a full tier): off the event loop.
            open_disk = partial(DiskTierNode, s.disk, self.metrics, self._master_metrics_url)
            self.disk_tier = await loop.run_in_executor(None, open_disk)
            parts.callback(self.disk_tier.release)
        store = await self._open_stores()
        # CUDA contexts and the page-locked segment start in the background: ranks may register before they are done.
        self.gpu = gpu = GpuRuntime(s.gpu, store, self.metrics)
        gpu.start()
        parts.push_async_callback(_in_thread, gpu.stop)  # unpins the segment before the store frees it
        self.kv_events = self._start_events(s.events, store)
        # The store and the GPU path into the sessions' movers, sessions and data path into the service.
        sessions = build_sessions(s.service, s.shares, store, self.metrics, gpu)
        events = self.kv_events.feed if self.kv_events else NO_EVENTS
        retries = RetryPolicy(call_s=self._store_call_s)
        datapath = build_data_path(s.service, store, self.metrics, tenancy, events, retries)
        self.dispatcher = build_service(
            s.service,
            datapath,
            sessions,
            tenancy,
            self.metrics,
            gpu,
            master_address=self.master_address,
            listeners=self.fence.listeners_with_drops,
        )
        parts.push_async_callback(_in_thread, _release_service, self.dispatcher)
        await self._open_servers(self.dispatcher, gid)
        self._open_data_socket(self.dispatcher, gid)
        self._report_listeners(metrics_port)
        await self._check_store()
        parts.push_async_callback(self._refuse_new_work)
        parts.push_async_callback(_cancel, asyncio.create_task(self._housekeep()))
        self._log_ready()

    async def _refuse_new_work(self) -> None:
        """The first of a stop: the health service says NOT_SERVING and new calls are refused."""
        await self._health.enter_graceful_shutdown()
        self.dispatcher.stop_accepting()

    async def _open_stores(self) -> Store:
        """The store the data path uses: the given one or Mooncake's (its master embedded or not), the disk tier
        behind it."""
        store = self._given_store
        if store is None:
            if not self.settings.master.address:
                self._start_master()
            self._parts.callback(self.fence.release)  # once the store that opened the fenced listeners is closed
            s = self.settings
            store, self._store_call_s = await connect_store(
                s.store, self.master_address, s.master.timeout, self.fence, self.signals
            )
        self._parts.push_async_callback(_in_thread, store.close)
        if self.disk_tier is not None:
            store = self.disk_tier.wrap(store)  # one store to the data path: DRAM, the disk behind it
        return store

    def _serve_metrics(self) -> int:
        """Serve /metrics; its port."""
        host, port = parse_address(self.settings.metrics_address)
        try:
            with self.loopback.host():  # the sockets operators and engines reach are the host's
                httpd, _ = start_http_server(port, host, registry=self.metrics.registry)
        except OSError as exc:
            raise DaemonError(f"cannot serve metrics on {self.settings.metrics_address}: {exc.strerror}") from None
        self._parts.callback(httpd.server_close)
        self._parts.callback(httpd.shutdown)
        self.metrics_url = f"http://{host}:{httpd.server_port}/metrics"
        return int(httpd.server_port)

    def _start_events(self, settings: EventSettings | None, store: Store) -> NodeEvents | None:
        if settings is None:
            return None
        # The store's lease-free location query lets the sweep see evictions. Its thread starts in the host's
        # namespace (with the sockets routers reach), so its Mooncake calls are moved into the private one.
        events = NodeEvents(
            settings.endpoint,
            settings.replay_endpoint,
            settings.topic,
            self.metrics.registry,
            self.loopback.inside(store.tiers),
        )
        self._parts.push_async_callback(_in_thread, events.stop)  # even if it fails to start
        try:
            with self.loopback.host():
                events.start()
        except PublisherError as exc:
            raise DaemonError(str(exc)) from None
        return events

    async def _open_servers(self, dispatcher: Dispatcher, gid: int | None) -> None:
        s = self.settings
        tenancy, sessions = dispatcher.handlers.tenancy, dispatcher.handlers.sessions
        with self.loopback.host():
            servers, self._health, self.addresses = create_servers(dispatcher, s.servers, self.metrics, gid)
            side = SideChannel(side_socket_path(s.socket.path), tenancy.tickets, sessions.accept_fds)
            self._parts.push_async_callback(_stop_servers, servers, side)
            side.bind(s.socket.mode, gid)
            side.start()
            for server in servers:
                await server.start()

    def _open_data_socket(self, dispatcher: Dispatcher, gid: int | None) -> None:
        # A Unix path reaches the same socket from any network namespace: its connection threads start here, where
        # the data pool's do (inside the loopback guard), since they call the store.
        s = self.settings
        path, sessions = data_socket_path(s.socket.path), dispatcher.handlers.sessions
        data_socket = DataListener(path, dispatcher, sessions, self.metrics, s.service.max_message_bytes)
        self._parts.push_async_callback(_in_thread, data_socket.stop, SHUTDOWN_GRACE_S)
        data_socket.bind(s.socket.mode, gid)
        data_socket.start()

    def _report_listeners(self, metrics_port: int) -> None:
        # The event sockets are kvsidecar's own: recorded before the fence's first sweep, which would fence them.
        for role, address, allowed in self.kv_events.listeners() if self.kv_events else ():
            self.fence.add_own(role, address, allowed)
        if self.master is not None:
            # Not fenced (the master is another process); what guards them is the loopback guard.
            guarded = "this daemon only (a private network namespace)"
            allowed = guarded if self.loopback.private else f"local accounts (loopback): {self.loopback.description}"
            self.fence.add_own("master-rpc", self.master.address, allowed)
            self.fence.add_own("master-http", self.master.metrics_url.removeprefix("http://"), allowed)
        self.fence.report(self.settings.report, self.addresses, metrics_port, self.metrics)

    def _log_ready(self) -> None:
        assert self.tenancy is not None
        extra = f" tcp+tls {self.addresses[1]}" if len(self.addresses) > 1 else ""
        origin = "embedded" if self.master is not None else "external"
        log.info(
            "kvsidecar %s ready: grpc %s%s, metrics %s, mooncake master %s (%s), %s, gpu %s",
            __version__,
            self.addresses[0],
            extra,
            self.metrics_url,
            self.master_address or "none",
            origin,
            self.tenancy.table.describe(),
            self.gpu.describe(),
        )
        notify.ready(f"serving on {self.addresses[0]}")

    def _guard_loopback(self, loop: asyncio.AbstractEventLoop) -> LoopbackGuard:
        """Enter a private network namespace for the embedded master and Mooncake where this daemon can; where it
        cannot, say so, and refuse tenants unless the operator trusts the node's local accounts."""
        s = self.settings
        if not (self._owns_store and not s.master.address):
            return LoopbackGuard.none("external master" if s.master.address else "no embedded master")
        if s.store.protocol != "tcp":
            guard = LoopbackGuard.none(f"--protocol {s.store.protocol} uses the host's network devices")
        else:
            guard = LoopbackGuard.enter_private()
        if guard.private:
            # Threads started from now on by this thread share its namespace; the loop's executor may hold older
            # ones (started before the guard), so it gets a fresh one.
            loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(thread_name_prefix="kvsidecar-io"))
            log.info("loopback guard: %s", guard.description)
            return guard
        if s.tenancy.tenants and not s.tenancy.trust_local_accounts:
            raise DaemonError(
                f"refusing --tenants: nothing guards the embedded master's loopback ports ({guard.description}"
                "), so every local account of this node could list, remove and place any tenant's keys; give the "
                "daemon CAP_SYS_ADMIN, or pass --trust-local-accounts if every local account is trusted (a pod's "
                "own network namespace: see docs/security.md)"
            )
        log.warning(
            "loopback guard: %s: every local account can reach the embedded master's RPC and HTTP ports",
            guard.description,
        )
        return guard

    def _master_admin_url(self) -> str:
        """The embedded master's admin HTTP address while it runs ("" without one)."""
        return self.master.metrics_url if self.master is not None else ""

    def _master_metrics_url(self) -> str | None:
        """The embedded master's metrics while it is alive: only its numbers are this node's alone."""
        return self.master.metrics_url if self.master is not None and self.master.alive() else None

    def _start_master(self) -> None:
        from kvsidecar.daemon.master import EmbeddedMaster
        from kvsidecar.store.native import ensure_native_libs

        # Started from the event loop's thread, which lives as long as the daemon: the master is told to stop
        # by the kernel if the daemon dies without stopping it (see EmbeddedMaster).
        self.master = master = EmbeddedMaster(
            binary=self.settings.master.binary or None,
            lease_ttl_ms=self.settings.master.lease_ttl_ms,
            env=ensure_native_libs(),
            max_soft_pin_ms=self.settings.master.max_soft_pin_ms,
        )
        self._parts.push_async_callback(_in_thread, master.stop)  # even if it fails to start
        master.start()
        self.master_address = master.address

    async def _check_store(self) -> None:
        assert self.dispatcher is not None and self._health is not None
        health = await asyncio.get_running_loop().run_in_executor(None, self.dispatcher.handlers.refresh_health)
        self.metrics.store_healthy.set(1 if health.healthy else 0)
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", serving)
        # The Sidecar service answers even when the store is down (lookups miss) or the GPU path failed (GPU
        # requests refused); its health says so.
        gpu_failed = self.gpu is not None and bool(self.gpu.failure)
        await self._health.set(SERVICE_NAME, serving if health.healthy and not gpu_failed else not_serving)
        if self.disk_tier is not None:
            # The store serves without its disk tier; whether the tier writes has a health name of its own.
            await self._health.set(DISK_TIER_HEALTH, not_serving if self.disk_tier.engine.not_writing() else serving)

    async def _housekeep(self) -> None:
        assert self.dispatcher is not None
        handlers = self.dispatcher.handlers
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            await loop.run_in_executor(None, handlers.sessions.expire)
            handlers.datapath.retention.report()  # retained bytes whose time ran out leave the gauges
            if self.disk_tier is not None:
                await loop.run_in_executor(None, self.disk_tier.housekeep)
            # Only a daemon that set up Mooncake itself owns the listeners of its process: a store handed in (tests)
            # lives beside listeners that are someone else's, which its fence must not touch.
            if self._owns_store and not await self._sweep_fence():
                return
            if self.master is not None and not self.master.alive():
                _restart_master(self.master)
            await self._check_store()

    async def _sweep_fence(self) -> bool:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.fence.sweep)
        except FenceError as exc:
            # Fail closed: a Mooncake port that cannot be fenced hands engine memory to the network.
            self.failure = f"stopping: {exc}"
            log.critical("%s", self.failure)
            os.kill(os.getpid(), signal.SIGTERM)
            return False
        return True

    def reload_tenants(self) -> None:
        """Read the tenants file again (SIGHUP): new sessions get the new rights; a bad file keeps the old ones."""
        if self.tenancy is None:
            return
        if not self.tenancy.path:
            log.info("SIGHUP: no tenants file to reload (single-tenant)")
            return
        try:
            table = self.tenancy.reload()
        except ConfigError as exc:
            log.error("SIGHUP: tenants file not reloaded, the old rights stay: %s", exc)
            return
        log.info("SIGHUP: tenants reloaded: %s", table.describe())


async def _in_thread(fn: Callable[..., object], *args: object) -> None:
    """An undo that blocks, run off the event loop."""
    await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _stop_servers(servers: list[grpc.aio.Server], side: SideChannel) -> None:
    """The gRPC servers given their grace to answer calls in flight, then the side socket."""
    await asyncio.gather(*(server.stop(SHUTDOWN_GRACE_S) for server in servers))
    await _in_thread(side.stop)


def _release_service(dispatcher: Dispatcher) -> None:
    """Every session's memory released, the dispatcher's pools shut down, the retention's work stopped."""
    dispatcher.handlers.sessions.close_all()
    dispatcher.shutdown()
    dispatcher.handlers.datapath.retention.stop()


def _restart_master(master: EmbeddedMaster) -> None:
    # On the event loop's thread on purpose (see Daemon._start_master); a restart takes a fraction of a second.
    log.error("embedded mooncake_master (PID %s) died: restarting it on %s", master.pid, master.address)
    try:
        master.restart()
    except Exception as exc:
        log.error("could not restart the embedded master (next try in %.0f s): %s", HOUSEKEEPING_INTERVAL_S, exc)
        return
    log.info("embedded mooncake_master restarted as PID %s; its store starts empty", master.pid)


def _let_socket_go(path: str, lock: SocketLock) -> None:
    # The socket path is this daemon's while it holds the lock (the claim took over or refused whatever was there).
    Path(path).unlink(missing_ok=True)
    lock.release()  # another daemon may take the socket from here on


async def serve(settings: Settings) -> None:
    """Run the daemon until SIGTERM or SIGINT, which also end a start at any point."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    daemon = Daemon(settings, signals=StopSignals(loop, stop.set))
    loop.add_signal_handler(signal.SIGHUP, daemon.reload_tenants)
    starting = asyncio.ensure_future(daemon.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("kvsidecar stopping: %s while starting", daemon.signals.received)
        starting.cancel()  # start() stops what it had started before it ends
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return
    stopping.cancel()
    starting.result()  # a start that failed raises its reason here
    await stop.wait()
    log.info("kvsidecar stopping")
    await daemon.stop()
    if daemon.failure:
        raise DaemonError(daemon.failure)
