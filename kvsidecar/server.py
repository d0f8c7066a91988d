"""The running daemon: embedded master, store, metrics endpoint and gRPC server, started and stopped in order."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvsidecar import __version__, notify, wire
from kvsidecar.auth import TokenAuth, check_files_exist, read_token, server_credentials
from kvsidecar.config import Config, ConfigError, parse_address
from kvsidecar.datapath import DataPath
from kvsidecar.disk.node import DiskTierNode
from kvsidecar.fence.daemon import DaemonFence, FenceError, policy_for
from kvsidecar.metrics import Metrics
from kvsidecar.service import SidecarService
from kvsidecar.session import SessionRegistry
from kvsidecar.sidechannel import SideChannel
from kvsidecar.store import Store
from kvsidecar.tenancy import Tenancy
from kvsidecar_contract.paths import side_socket_path
from kvsidecar_contract.proto import sidecar_pb2

log = logging.getLogger("kvsidecar")

SERVICE_NAME = sidecar_pb2.DESCRIPTOR.services_by_name["Sidecar"].full_name
HOUSEKEEPING_INTERVAL_S = 1.0
SHUTDOWN_GRACE_S = 5.0


class DaemonError(RuntimeError):
    """The daemon cannot start (socket taken, master or store unavailable)."""


def claim_socket(path: str) -> None:
    """Make `path` free for a new listener: take over a stale socket, refuse a live one or a non-socket."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if not (p.exists() or p.is_symlink()):
        return
    if not p.is_socket():
        raise DaemonError(f"{path} exists and is not a socket: refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("taking over stale socket %s (no daemon answers on it)", path)
            p.unlink(missing_ok=True)
            return
        except OSError as exc:
            raise DaemonError(f"cannot check socket {path}: {exc.strerror}") from None
    raise DaemonError(f"another daemon is serving on {path}")


def _server(service: SidecarService, health: health_aio.HealthServicer, config: Config, **kw: Any) -> grpc.aio.Server:
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options, **kw)
    server.add_generic_rpc_handlers((wire.sidecar_handlers(service),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return server


def _socket_gid(config: Config) -> int | None:
    if not config.socket_group:
        return None
    try:
        return grp.getgrnam(config.socket_group).gr_gid
    except KeyError as exc:
        raise DaemonError(f"cannot give the sockets to group {config.socket_group!r}: {exc}") from None


def create_servers(
    service: SidecarService, config: Config, metrics: Metrics
) -> tuple[list[grpc.aio.Server], health_aio.HealthServicer, list[str]]:
    """The Unix-socket server and, with --listen, an authenticated TLS one; bound, not started."""
    health = health_aio.HealthServicer()
    unix = _server(service, health, config)
    claim_socket(config.socket)
    # The socket file appears at bind time; a tight umask keeps it private until its mode is set.
    old = os.umask(0o177)
    try:
        unix.add_insecure_port(f"unix://{config.socket}")
    finally:
        os.umask(old)
    os.chmod(config.socket, config.socket_mode)
    if config.socket_group:
        try:
            os.chown(config.socket, -1, grp.getgrnam(config.socket_group).gr_gid)
        except (KeyError, PermissionError) as exc:
            raise DaemonError(f"cannot give {config.socket} to group {config.socket_group!r}: {exc}") from None
    servers, addresses = [unix], [f"unix://{config.socket}"]
    if config.listen:
        check_files_exist(config)
        interceptors = []
        refused = metrics.requests_rejected
        tenancy = service.tenancy
        # With client certificates, a tenants file's own credentials decide at OpenSession; without them the
        # tenants' tokens guard the listener, as --token-file's does.
        if config.token_file or (config.tenants and not config.tls_client_ca):
            token = read_token(config.token_file) if config.token_file else None
            interceptors.append(
                TokenAuth(token, lambda method: refused.labels(method, "UNAUTHENTICATED").inc(), tenancy.token_hashes)
            )
        tcp = _server(service, health, config, interceptors=interceptors)
        port = tcp.add_secure_port(config.listen, server_credentials(config))
        if not port:
            raise DaemonError(f"cannot listen on {config.listen}")
        host, _ = parse_address(config.listen)
        servers.append(tcp)
        addresses.append(f"{host}:{port}")
    return servers, health, addresses


class Daemon:
    """One kvsidecar process. Pass `store` to run over a given store (tests); by default it builds Mooncake's."""

    def __init__(self, config: Config, *, store: Store | None = None, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self._store = store
        self.master: Any = None
        self.master_address = config.master
        self.addresses: list[str] = []
        self.metrics_url = ""
        self._httpd: Any = None
        self._servers: list[grpc.aio.Server] = []
        self._health: health_aio.HealthServicer | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self.service: SidecarService | None = None
        self.side: SideChannel | None = None
        self.tenancy: Tenancy | None = None
        self.disk_tier: DiskTierNode | None = None
        self.fence: DaemonFence | None = None  # set when the daemon sets up Mooncake itself
        self.failure = ""  # why the daemon stopped itself, if it did

    async def start(self) -> None:
        """Start everything; on failure, stop what was started and raise DaemonError."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        claim_socket(cfg.socket)  # fail before starting a master if another daemon owns the socket
        try:
            self.tenancy = Tenancy(cfg.tenants)
        except ConfigError as exc:
            raise DaemonError(str(exc)) from None
        if cfg.ssd_dir:
            self.disk_tier = await loop.run_in_executor(
                None, DiskTierNode, cfg, self.metrics, self._embedded_master_metrics_url
            )
        if self._store is None:
            if not cfg.master:
                self._start_master()
            self._store = await loop.run_in_executor(None, self._open_store)
        tiered = self.disk_tier.wrap(self._store) if self.disk_tier is not None else None
        store = self._store = tiered or self._store
        host, port = parse_address(cfg.metrics_address)
        try:
            self._httpd, _ = start_http_server(port, host, registry=self.metrics.registry)
        except OSError as exc:
            raise DaemonError(f"cannot serve metrics on {cfg.metrics_address}: {exc.strerror}") from None
        self.metrics_url = f"http://{host}:{self._httpd.server_port}/metrics"
        # Built in dependency order: the store's buffer registration into the sessions, both into the service.
        sessions = SessionRegistry(
            cfg.session_ttl, store.register_buffer, store.unregister_buffer, metrics=self.metrics
        )
        tenancy = self.tenancy
        self.service = SidecarService(
            DataPath(
                store,
                self.metrics,
                budget_of=tenancy.budget,
                tiers=tiered.tiers if tiered is not None else None,
            ),
            sessions,
            self.metrics,
            workers=cfg.workers,
            master_address=self.master_address,
            tenancy=tenancy,
            side_socket=True,
        )
        self._servers, self._health, self.addresses = create_servers(self.service, cfg, self.metrics)
        self.side = SideChannel(side_socket_path(cfg.socket), tenancy.tickets, sessions.accept_fds)
        self.side.bind(cfg.socket_mode, _socket_gid(cfg))
        self.side.start()
        for server in self._servers:
            await server.start()
        if self.fence is not None:
            self.fence.report(cfg, self.addresses, self._httpd.server_port, self.metrics, self.service)
        await self._check_store()
        self._housekeeping = asyncio.create_task(self._housekeep())
        extra = f" tcp+tls {self.addresses[1]}" if len(self.addresses) > 1 else ""
        origin = "embedded" if self.master is not None else "external"
        log.info(
            "kvsidecar %s ready: grpc %s%s, metrics %s, mooncake master %s (%s), %s",
            __version__,
            self.addresses[0],
            extra,
            self.metrics_url,
            self.master_address or "none",
            origin,
            tenancy.table.describe(),
        )
        notify.ready(f"serving on {self.addresses[0]}")

    def _start_master(self) -> None:
        from kvsidecar.master import EmbeddedMaster
        from kvsidecar.store.native import ensure_native_libs

        # Started from the event loop's thread, which lives as long as the daemon: the master is told to stop
        # by the kernel if the daemon dies without stopping it (see EmbeddedMaster).
        self.master = EmbeddedMaster(
            binary=self.config.master_binary or None,
            lease_ttl_ms=self.config.master_lease_ttl_ms,
            env=ensure_native_libs(),
        )
        self.master.start()
        self.master_address = self.master.address

    def _embedded_master_metrics_url(self) -> str | None:
        # Only an embedded master's numbers are this node's alone.
        master = self.master
        return master.metrics_url if master is not None and master.alive() else None

    def _open_store(self) -> Store:
        # Mooncake is imported only here (and in the store package): the rest of the daemon runs without it.
        from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore
        from kvsidecar.store.native import ensure_native_libs

        cfg = self.config
        ensure_native_libs()
        # Mooncake's own environment variables, set at the edge: stay on loopback when the node is loopback.
        if cfg.local_hostname in ("127.0.0.1", "localhost", "::1"):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        # A hung master must not hold a worker thread for Mooncake's default 30 s: lookups degrade to misses.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", "5000")
        settings = MooncakeSettings(
            local_hostname=cfg.local_hostname,
            metadata_server=cfg.metadata_server,
            master_server_addr=self.master_address,
            global_segment_size=cfg.segment_size,
            local_buffer_size=cfg.local_buffer_size,
            protocol=cfg.protocol,
            rdma_devices=cfg.rdma_devices,
            replica_num=cfg.replicas,
        )
        # Mooncake opens its listeners on every interface during setup; the fence seals them before it returns.
        # The disk tier is the daemon's own (kvsidecar.disk), so it needs no listener: single node admits nobody.
        single_node = self.master is not None
        policy = policy_for(embedded_master=single_node, peer_networks=cfg.peer_network)
        self.fence = DaemonFence(policy, self.master.metrics_url if self.master is not None else "")
        try:
            return self.fence.open_store(lambda: MooncakeStore.connect(settings), lambda store: store.close())
        except FenceError as exc:
            raise DaemonError(f"refusing to run: {exc}") from None

    async def _check_store(self) -> None:
        assert self.service is not None and self._health is not None
        health = await asyncio.get_running_loop().run_in_executor(None, self.service.refresh_health)
        self.metrics.store_healthy.set(1 if health.healthy else 0)
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", serving)
        # The Sidecar service answers even when the store is down (lookups miss); its health says so.
        await self._health.set(SERVICE_NAME, serving if health.healthy else not_serving)

    async def _housekeep(self) -> None:
        assert self.service is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            await loop.run_in_executor(None, self.service.sessions.expire)
            if self.disk_tier is not None:
                await loop.run_in_executor(None, self.disk_tier.housekeep)
            if self.fence is not None and not await self._sweep_fence():
                return
            if self.master is not None and not self.master.alive():
                self._restart_master()
            await self._check_store()

    async def _sweep_fence(self) -> bool:
        assert self.fence is not None
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.fence.sweep)
        except FenceError as exc:
            # Fail closed: a Mooncake port that cannot be fenced hands engine memory to the network.
            self.failure = f"stopping: {exc}"
            log.critical("%s", self.failure)
            os.kill(os.getpid(), signal.SIGTERM)
            return False
        return True

    def _restart_master(self) -> None:
        # On the event loop's thread on purpose (see _start_master); a restart takes a fraction of a second.
        log.error("embedded mooncake_master (PID %s) died: restarting it on %s", self.master.pid, self.master_address)
        try:
            self.master.restart()
        except Exception as exc:
            log.error("could not restart the embedded master (next try in %.0f s): %s", HOUSEKEEPING_INTERVAL_S, exc)
            return
        log.info("embedded mooncake_master restarted as PID %s; its store starts empty", self.master.pid)

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

    async def stop(self) -> None:
        """Stop in reverse order: refuse new work, drain, release sessions, close the store, stop the master."""
        notify.stopping()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeping
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self.service is not None:
            self.service.stop_accepting()
        await asyncio.gather(*(server.stop(SHUTDOWN_GRACE_S) for server in self._servers))
        if self.side is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.side.stop)
        loop = asyncio.get_running_loop()
        if self.service is not None:
            await loop.run_in_executor(None, self.service.sessions.close_all)
            await loop.run_in_executor(None, self.service.shutdown_pools)
        if self._store is not None:
            await loop.run_in_executor(None, self._store.close)
        if self.fence is not None:
            self.fence.release()
        if self.master is not None:
            await loop.run_in_executor(None, self.master.stop)
        if self.disk_tier is not None:
            self.disk_tier.release()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._servers:
            Path(self.config.socket).unlink(missing_ok=True)


async def serve(config: Config) -> None:
    """Run the daemon until SIGTERM or SIGINT."""
    daemon = Daemon(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload_tenants)
    await daemon.start()
    await stop.wait()
    log.info("kvsidecar stopping")
    await daemon.stop()
    if daemon.failure:
        raise DaemonError(daemon.failure)
