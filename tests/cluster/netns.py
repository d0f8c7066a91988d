"""Simulated nodes on one machine: network namespaces on a bridge, created and removed by the test (needs root)."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest


def require_root() -> None:
    """Skip unless this process may create network namespaces (root with iproute2)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces, veth pairs and bridges need root (CI runs as root)")
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        pytest.skip("iproute2 (`ip`) is not installed")


def free_subnet(second_octets: range) -> str:
    """A random 10.x.y (a /24) that no address or route of this machine touches, so two runs never collide."""
    import ipaddress

    try:
        used = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    except FileNotFoundError:  # no iproute2: the tests skip anyway
        used = ""
    taken = []
    for line in used.splitlines():
        word = line.split()[0] if line.split() else ""
        if word[0:1].isdigit():
            try:
                taken.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for _ in range(100):
        subnet = f"10.{secrets.choice(second_octets)}.{secrets.randbelow(256)}"
        net = ipaddress.ip_network(f"{subnet}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Node:
    """One namespace with one address on the bridge."""

    ns: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv run inside this node's namespace (in this one for a node without a namespace)."""
        return ["ip", "netns", "exec", self.ns, *argv] if self.ns else list(argv)

    def run(self, argv: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv), capture_output=True, text=True, **kw)  # type: ignore[call-overload]

    def popen(self, argv: Sequence[str], **kw: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(argv), **kw)  # type: ignore[call-overload]


@dataclass
class Fabric:
    """A bridge in the root namespace (its address is `host`) and nodes attached to it by veth pairs."""

    subnet: str  # the first three octets, e.g. "10.213.7"
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    nodes: list[Node] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"kvb{self.tag}"

    @property
    def host(self) -> str:
        """The root namespace's address on the bridge: how a node reaches this host's wildcard listeners."""
        return f"{self.subnet}.1"

    @property
    def cidr(self) -> str:
        return f"{self.subnet}.0/24"

    def __enter__(self) -> Fabric:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, index: int = 0) -> Node:
        """A new namespace with address subnet.index (default: the next one), its loopback up."""
        index = index or len(self.nodes) + 2
        node = Node(f"kvs{self.tag}n{index}", f"{self.subnet}.{index}")
        outer, inner = f"kv{self.tag}h{index}", f"kv{self.tag}c{index}"
        self.nodes.append(node)
        _ip("netns", "add", node.ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", node.ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", inner)
        _ip("-n", node.ns, "link", "set", inner, "up")
        _ip("-n", node.ns, "link", "set", "lo", "up")
        _ip("-n", node.ns, "route", "add", "default", "via", self.host)
        return node

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            # Deleting the namespace deletes its veth end, and with it the peer on the bridge.
            subprocess.run(["ip", "netns", "del", node.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
