"""What guards the embedded master's loopback ports: a private network namespace, or nothing.

Mooncake's master has no authentication, so whoever reaches its RPC and admin HTTP ports can list, remove and place
keys and read segment addresses. On one node the daemon is its only client. The guard moves the daemon's event-loop
thread into a network namespace of its own (loopback up, no other interface) before the master, the Mooncake client
and every worker thread start: the master (spawned from that thread), Mooncake's sockets and threads (created from
threads it starts) and the daemon's HTTP checks of the master all live there, and no other process on the node can
reach them. The sockets engines and operators use (the gRPC listeners, metrics, KV events) are opened in the host's
namespace for a moment (`host()`); a socket keeps the namespace it was made in.

Linux moves one thread at a time (`unshare(CLONE_NEWNET)` affects the caller only; threads it starts later inherit
its namespace): threads started earlier stay where they were, so the daemon enters the guard first and gives its
event loop a fresh default executor. It needs CAP_SYS_ADMIN (root, or a container granted it): without it the guard
is "nothing", said at start and in `kvsidecar status`, and `--tenants` needs `--trust-local-accounts`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["LoopbackGuard", "NOTHING"]

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_NS_PATH = "/proc/thread-self/ns/net"

NOTHING = "nothing"
_T = TypeVar("_T")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _loopback_up() -> None:
    """Bring `lo` up in the calling thread's network namespace (a new one starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


@dataclass
class LoopbackGuard:
    """The calling thread's private network namespace (`private`), or why there is none (`description`)."""

    description: str
    private: bool = False
    _host_fd: int = -1
    _private_fd: int = -1

    @classmethod
    def none(cls, why: str) -> LoopbackGuard:
        """No guard: the master's loopback ports are open to every local account; why says so."""
        return cls(f"{NOTHING} ({why})")

    @classmethod
    def enter_private(cls) -> LoopbackGuard:
        """Move the calling thread into a new network namespace with loopback up; a guard of nothing if the kernel
        refuses (the reason kept)."""
        libc = _libc()
        host_fd = os.open(_NS_PATH, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        except OSError as exc:
            os.close(host_fd)
            return cls.none(f"{exc.strerror}; a private network namespace needs CAP_SYS_ADMIN")
        try:
            _loopback_up()
            private_fd = os.open(_NS_PATH, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            _check(libc.setns(host_fd, CLONE_NEWNET), "setns(host network namespace)")
            os.close(host_fd)
            return cls.none(f"cannot bring up loopback in a private network namespace: {exc}")
        guard = cls(
            "a private network namespace: the master's ports and Mooncake's are reachable by this daemon alone",
            private=True,
            _host_fd=host_fd,
            _private_fd=private_fd,
        )
        log.info("entered a private network namespace (%s) for the embedded master and Mooncake", guard.namespace())
        return guard

    def namespace(self) -> str:
        """The calling thread's network namespace, as the kernel names it (net:[inode])."""
        return os.readlink(_NS_PATH)

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Run the body in the host's network namespace (sockets made there stay there), then come back."""
        if not self.private:
            yield
            return
        libc = _libc()
        _check(libc.setns(self._host_fd, CLONE_NEWNET), "setns(host network namespace)")
        try:
            yield
        finally:
            _check(libc.setns(self._private_fd, CLONE_NEWNET), "setns(private network namespace)")

    def inside(self, fn: Callable[..., _T]) -> Callable[..., _T]:
        """fn, run in the private namespace whatever thread calls it (the calling thread stays there): for a thread
        started in the host's namespace that still calls Mooncake, whose new connections must not go to the host's
        loopback, where any local account could listen on the master's port."""
        if not self.private:
            return fn

        def run(*args: Any) -> _T:
            _check(_libc().setns(self._private_fd, CLONE_NEWNET), "setns(private network namespace)")
            return fn(*args)

        return run

    def leave(self) -> None:
        """Move the calling thread back to the host's namespace for good; the private one ends with its last user."""
        if not self.private:
            return
        self.private = False
        try:
            _check(_libc().setns(self._host_fd, CLONE_NEWNET), "setns(host network namespace)")
        finally:
            os.close(self._host_fd)
            os.close(self._private_fd)
