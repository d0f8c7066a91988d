"""TCP sockets of a process as /proc shows them: parse /proc/net/tcp{,6} and map /proc/PID/fd (parsing is pure)."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

LISTEN = 0x0A
ESTABLISHED = 0x01
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")


@dataclass(frozen=True)
class TcpSocket:
    """One line of /proc/net/tcp or tcp6."""

    family: int
    local: Address
    local_port: int
    remote: Address
    remote_port: int
    state: int
    inode: int

    @property
    def listening(self) -> bool:
        return self.state == LISTEN

    @property
    def endpoint(self) -> str:
        """host:port as an operator writes it ([v6]:port)."""
        host = str(self.local)
        return f"[{host}]:{self.local_port}" if self.family == socket.AF_INET6 else f"{host}:{self.local_port}"


def unmapped(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it carries; others unchanged."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback_bound(s: TcpSocket) -> bool:
    """Bound to a loopback address, so packets from other hosts never reach it."""
    return unmapped(s.local).is_loopback


def _address(text: str) -> Address:
    # The kernel prints each 32-bit word of the address in host byte order (little-endian here).
    raw = bytes.fromhex(text)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    return ipaddress.ip_address(b"".join(words))


def _endpoint(text: str) -> tuple[Address, int]:
    host, port = text.split(":")
    return _address(host), int(port, 16)


def parse(text: str, family: int) -> list[TcpSocket]:
    """Sockets in the text of /proc/net/tcp (family AF_INET) or /proc/net/tcp6 (AF_INET6)."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, local_port = _endpoint(fields[1])
        remote, remote_port = _endpoint(fields[2])
        out.append(TcpSocket(family, local, local_port, remote, remote_port, int(fields[3], 16), int(fields[9])))
    return out


def socket_inodes(links: Iterable[tuple[int, str]]) -> dict[int, int]:
    """inode -> fd from (fd, readlink target) pairs of /proc/PID/fd."""
    out: dict[int, int] = {}
    for fd, target in links:
        m = _SOCKET_LINK.fullmatch(target)
        if m:
            out.setdefault(int(m.group(1)), fd)
    return out


# I/O.


def read_tcp(pid: int | str = "self") -> list[TcpSocket]:
    """Every TCP socket of the network namespace PID lives in; for "self", the calling thread's namespace (threads
    of one process can live in different ones: the daemon's loopback guard)."""
    out: list[TcpSocket] = []
    where = "thread-self" if pid == "self" else pid
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{where}/net/{name}") as f:
                out += parse(f.read(), family)
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
    return out


def _fd_links(pid: int | str) -> Iterator[tuple[int, str]]:
    base = f"/proc/{pid}/fd"
    for name in os.listdir(base):
        try:
            yield int(name), os.readlink(f"{base}/{name}")
        except OSError:  # closed meanwhile
            continue


def process_sockets(pid: int | str = "self") -> dict[int, int]:
    """inode -> fd of every socket PID holds."""
    return socket_inodes(_fd_links(pid))


def listeners(pid: int | str = "self") -> list[tuple[TcpSocket, int]]:
    """(socket, fd) for each TCP listener PID holds."""
    held = process_sockets(pid)
    return [(s, held[s.inode]) for s in read_tcp(pid) if s.listening and s.inode in held]
