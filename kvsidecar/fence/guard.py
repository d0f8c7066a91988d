"""Fence the TCP listeners Mooncake opens inside the daemon: a locked BPF filter on each drops other sources' SYNs.

Mooncake binds its transfer port ([::], dual-stack) and its handshake RPC port (0.0.0.0) on every interface and
offers no option to do otherwise; both serve raw reads and writes of registered memory to whoever connects. The
fence attaches, through a duplicate of the listener's file descriptor, a classic BPF socket filter that passes only
packets from allowed networks. On a listening socket the kernel runs it on every SYN and on the handshake's final
ACK, and every accepted connection inherits it, so a peer outside the allow-list can neither connect nor keep a
connection. SO_LOCK_FILTER stops anything in the process from removing it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsidecar.errors import FenceError
from kvsidecar.fence import bpf, proctcp
from kvsidecar.fence.bpf import Network
from kvsidecar.fence.proctcp import TcpSocket

log = logging.getLogger(__name__)

SOL_SOCKET = 1
SO_ATTACH_FILTER = 26  # also SO_GET_FILTER
SO_LOCK_FILTER = 44
SO_MEMINFO = 55
_SK_MEMINFO_DROPS = 8
_MEMINFO_BYTES = 9 * 4


@dataclass(frozen=True)
class Policy:
    """Who may reach the fenced listeners: source networks; none at all means nobody, loopback included."""

    networks: tuple[Network, ...] = ()

    @classmethod
    def nobody(cls) -> Policy:
        """Single node: Mooncake's own segment is reached by memcpy, so its ports serve no one."""
        return cls(())

    @classmethod
    def peers(cls, networks: Iterable[Network]) -> Policy:
        """Many nodes: the named peer networks, and loopback always."""
        return cls(tuple(dict.fromkeys((*bpf.LOOPBACK, *networks))))

    def allows(self, address: proctcp.Address) -> bool:
        address = proctcp.unmapped(address)
        return any(address in net for net in self.networks if net.version == address.version)

    def describe(self) -> str:
        return ",".join(str(net) for net in self.networks) or "nobody"


@dataclass(frozen=True)
class Listener:
    """A listener of the daemon process and who may reach it."""

    role: str
    address: str
    allowed: str
    inode: int = 0  # 0: not a fenced TCP listener (the Unix socket, kvsidecar's own ports)


def mooncake_role(s: TcpSocket) -> str:
    """Mooncake's transfer acceptor is dual-stack IPv6 (asio); its handshake daemon is IPv4."""
    return "mooncake-transfer" if s.family == socket.AF_INET6 else "mooncake-handshake"


_libc = ctypes.CDLL(None, use_errno=True)


def _dup(fd: int, inode: int) -> socket.socket | None:
    """A socket object on a duplicate of fd, if fd still is the socket with this inode."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    if os.fstat(copy).st_ino != inode:  # the fd was closed and its number reused meanwhile
        os.close(copy)
        return None
    return socket.socket(fileno=copy)


def attached_filter(sock: socket.socket) -> bytes:
    """The classic BPF program attached to sock (b'' when none)."""
    count = ctypes.c_uint(bpf.BPF_MAXINSNS)
    buf = ctypes.create_string_buffer(8 * bpf.BPF_MAXINSNS)
    if _libc.getsockopt(sock.fileno(), SOL_SOCKET, SO_ATTACH_FILTER, buf, ctypes.byref(count)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.raw[: 8 * count.value]


def attach(sock: socket.socket, program: Sequence[bpf.Insn]) -> None:
    """Attach program to sock and lock it there."""
    code = ctypes.create_string_buffer(bpf.encode(program))
    fprog = struct.pack("@HP", len(program), ctypes.addressof(code))
    sock.setsockopt(SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    sock.setsockopt(SOL_SOCKET, SO_LOCK_FILTER, 1)


def dropped_packets(sock: socket.socket) -> int:
    """Packets the kernel dropped at this socket: on a fenced listener, mostly SYNs the filter refused."""
    info = sock.getsockopt(SOL_SOCKET, SO_MEMINFO, _MEMINFO_BYTES)
    return int(struct.unpack(f"={len(info) // 4}I", info)[_SK_MEMINFO_DROPS])


def breaches(sockets: Iterable[TcpSocket], ports: set[int], policy: Policy) -> list[TcpSocket]:
    """Connections to a fenced port from a source the policy refuses (pure)."""
    return [s for s in sockets if not s.listening and s.local_port in ports and not policy.allows(s.remote)]


def listening_inodes() -> set[int]:
    """Inodes of the TCP listeners this process holds now."""
    return {s.inode for s, _ in proctcp.listeners()}


# Every listener fenced in this process, by inode: several daemons may share a process (tests).
_FENCED: dict[int, Listener] = {}
_FENCED_LOCK = threading.Lock()


class ListenerFence:
    """Fences Mooncake's listeners in this process with one policy, and reports them."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.program = bpf.allow_program(policy.networks)
        self._code = bpf.encode(self.program)
        self._mine: dict[int, tuple[Listener, int]] = {}  # inode -> (listener, fd)
        self._lock = threading.Lock()

    def seal_new(self, before: set[int]) -> list[Listener]:
        """Fence every TCP listener that appeared since `before` (from listening_inodes()), whatever it binds."""
        return [self._fence(s, fd) for s, fd in proctcp.listeners() if s.inode not in before]

    def sweep(self, own_ports: set[int]) -> list[Listener]:
        """Fence listeners opened later on a non-loopback address that are neither kvsidecar's nor fenced yet."""
        found = []
        for s, fd in proctcp.listeners():
            with _FENCED_LOCK:
                known = s.inode in _FENCED
            if known or s.local_port in own_ports or proctcp.is_loopback_bound(s):
                continue
            log.warning("a new listener appeared on %s: fencing it (allowed: %s)", s.endpoint, self.policy.describe())
            found.append(self._fence(s, fd))
        return found

    def _fence(self, s: TcpSocket, fd: int) -> Listener:
        sock = _dup(fd, s.inode)
        if sock is None:
            raise FenceError(f"listener {s.endpoint} (fd {fd}) vanished while being fenced")
        with sock:
            try:
                attach(sock, self.program)
                ok = attached_filter(sock) == self._code
            except OSError as exc:
                raise FenceError(f"cannot fence listener {s.endpoint}: {exc.strerror}") from None
        if not ok:
            raise FenceError(f"listener {s.endpoint} carries a filter other than the fence after attaching it")
        listener = Listener(mooncake_role(s), s.endpoint, self.policy.describe(), s.inode)
        with self._lock:
            self._mine[s.inode] = (listener, fd)
        with _FENCED_LOCK:
            _FENCED[s.inode] = listener
        self.check_breaches()
        return listener

    def check_breaches(self) -> None:
        """Refuse to go on if a refused source holds a connection to a fenced port (it connected before the fence)."""
        with self._lock:
            ports = {int(entry[0].address.rsplit(":", 1)[1]) for entry in self._mine.values()}
        found = breaches(proctcp.read_tcp(), ports, self.policy)
        if found:
            peers = ", ".join(f"{s.remote}:{s.remote_port} -> port {s.local_port}" for s in found)
            raise FenceError(f"connections from outside the allow-list reached Mooncake before its fence: {peers}")

    def listeners(self) -> list[Listener]:
        """The listeners this fence holds."""
        with self._lock:
            return [entry[0] for entry in self._mine.values()]

    def dropped(self) -> dict[Listener, int]:
        """Packets each fenced listener dropped so far (listeners closed meanwhile are left out)."""
        with self._lock:
            entries = list(self._mine.values())
        out = {}
        for listener, fd in entries:
            sock = _dup(fd, listener.inode)
            if sock is not None:
                with sock:
                    out[listener] = dropped_packets(sock)
        return out

    def release(self) -> None:
        """Forget this fence's listeners (the store that owned them is closed)."""
        with self._lock:
            inodes, self._mine = list(self._mine), {}
        with _FENCED_LOCK:
            for inode in inodes:
                _FENCED.pop(inode, None)
