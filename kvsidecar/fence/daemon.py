"""The fence of one daemon: its policy from the configuration, Mooncake's listeners sealed as the store opens,
later ones caught by a sweep, and every listener of the daemon with who may reach it."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvsidecar.errors import FenceError
from kvsidecar.fence import bpf, segments
from kvsidecar.fence.guard import Listener, ListenerFence, Policy, listening_inodes

__all__ = ["DaemonFence", "FenceError", "Listener", "ReportSettings", "is_loopback_host", "policy_for"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def is_loopback_host(host: str) -> bool:
    """Whether host names this machine's loopback (so only processes on this host can use it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ReportSettings:
    """What the listener report says of kvsidecar's own listeners (cut from Config): the socket's mode and group,
    the metrics endpoint's address."""

    socket_mode: int
    socket_group: str
    metrics_address: str


def policy_for(*, embedded_master: bool, peer_networks: tuple[str, ...]) -> Policy:
    """Nobody for the only node of an embedded master; loopback and the named peer networks otherwise."""
    if embedded_master:
        return Policy.nobody()
    return Policy.peers(bpf.parse_networks(peer_networks))


class DaemonFence:
    """Seals the listeners Mooncake opens in this daemon and reports every listener the daemon holds."""

    def __init__(self, policy: Policy, master_admin_url: Callable[[], str] = str) -> None:
        """master_admin_url answers the embedded master's admin HTTP ("" without one), watched for segments that
        are not this daemon's."""
        self.policy = policy
        self._fence = ListenerFence(policy)
        self._own: list[Listener] = []
        self._master_admin_url = master_admin_url

    def open_store(self, connect: Callable[[], _T], close: Callable[[_T], None]) -> _T:
        """Run connect() (which sets up Mooncake) and fence every listener it opened; close the store if one fails."""
        before = listening_inodes()
        store = connect()
        try:
            sealed = self._fence.seal_new(before)
        except FenceError:
            close(store)
            raise
        for listener in sealed:
            log.info("fenced %s %s: allowed %s", listener.role, listener.address, listener.allowed)
        return store

    def add_own(self, role: str, address: str, allowed: str) -> None:
        """Record a listener kvsidecar opened itself (gRPC, metrics) for the report."""
        self._own.append(Listener(role, address, allowed))

    def own_ports(self) -> set[int]:
        ports = set()
        for listener in self._own:
            tail = listener.address.rpartition(":")[2]
            if tail.isdigit():
                ports.add(int(tail))
        return ports

    def sweep(self) -> None:
        """Fence listeners Mooncake opened after start; raise FenceError if one cannot be, or was reached first."""
        for listener in self._fence.sweep(self.own_ports()):
            log.warning("fenced late listener %s %s: allowed %s", listener.role, listener.address, listener.allowed)
        self._fence.check_breaches()
        url = self._master_admin_url()
        if url:
            self._check_segments(url)

    def _check_segments(self, url: str) -> None:
        try:
            detail = segments.segments_detail(url)
        except (OSError, ValueError) as exc:  # the master is down or restarting: its supervisor handles that
            log.debug("cannot list the embedded master's segments: %s", exc)
            return
        ports = {int(item.address.rpartition(":")[2]) for item in self._fence.listeners()}
        foreign = segments.foreign_segments(detail, ports)
        if foreign:
            # The master would place some of this daemon's blocks in that memory and serve them back from it.
            raise FenceError(
                f"a Mooncake client other than this daemon mounted a segment at the embedded master: "
                f"{', '.join(foreign)}; a local account could read and alter the blocks placed there"
            )

    def listeners(self) -> list[Listener]:
        """Every listener of the daemon: kvsidecar's own, then the fenced ones."""
        return self._own + self._fence.listeners()

    def dropped(self) -> dict[tuple[str, str], int]:
        """Packets each fenced listener refused so far, by (role, address)."""
        return {(item.role, item.address): count for item, count in self._fence.dropped().items()}

    def summary(self) -> str:
        """One line for the start-up log."""
        return "; ".join(f"{item.role} {item.address} (allowed: {item.allowed})" for item in self.listeners())

    def release(self) -> None:
        self._fence.release()

    def report(self, config: ReportSettings, addresses: list[str], metrics_port: int, metrics: Any) -> None:
        """Record kvsidecar's own listeners, export all of them as kvsidecar_listener_info and log them once."""
        group = f", group {config.socket_group}" if config.socket_group else ""
        self.add_own(
            "grpc-unix", addresses[0], f"local accounts with access to a mode {config.socket_mode:04o} file{group}"
        )
        if len(addresses) > 1:
            self.add_own("grpc-tcp", addresses[1], "any address; TLS with client authentication")
        host = config.metrics_address.rpartition(":")[0].strip("[]")
        where = "local accounts (loopback)" if is_loopback_host(host) else "any address (read-only metrics)"
        self.add_own("metrics", f"{host}:{metrics_port}", where)
        for item in self.listeners():
            metrics.listener_info.labels(item.role, item.address, item.allowed).set(1)
        log.info("listeners: %s", self.summary())

    def listeners_with_drops(self) -> list[tuple[Listener, int]]:
        """Every listener, with the packets it refused (0 for kvsidecar's own)."""
        dropped = self.dropped()
        return [(item, dropped.get((item.role, item.address), 0)) for item in self.listeners()]
