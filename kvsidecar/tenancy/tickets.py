"""Who a Unix peer is: its kernel credentials (SO_PEERCRED), and single-use tickets that stand for them on a gRPC call.

gRPC Python hides a connection's descriptor, so the side socket (rpc/side.py) reads the peer's credentials and
issues a ticket for them; the client sends the ticket as `kvsidecar-ticket` metadata on its next gRPC call. Tickets
expire after TICKET_TTL_S and are redeemed once.
"""

from __future__ import annotations

import array
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.errors import Exhausted

__all__ = ["MAX_TICKETS", "MAX_TICKETS_PER_UID", "TICKET_TTL_S", "PeerCred", "Tickets", "peer_cred"]

TICKET_TTL_S = 30.0
MAX_TICKETS = 4096  # outstanding at once; a peer minting tickets in a loop cannot grow the daemon's memory
# ... of one uid: a uid minting in a loop uses up its own share, never the others' (a rank needs one per call).
MAX_TICKETS_PER_UID = 256
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python has no constant for it


@dataclass(frozen=True)
class PeerCred:
    """What the kernel says about the process at the other end of a Unix socket."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


def peer_cred(sock: socket.socket) -> PeerCred:
    """The connected peer's pid, uid, gid (SO_PEERCRED) and supplementary groups (SO_PEERGROUPS)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    groups = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        groups.update(array.array("I", raw[: len(raw) - len(raw) % 4]))
    except OSError:
        pass  # an older kernel: the primary group only
    return PeerCred(pid, uid, gid, frozenset(groups))


class Tickets:
    """Single-use, short-lived tickets standing for the Unix credentials of the peer they were issued to."""

    def __init__(self, ttl: float = TICKET_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, tuple[PeerCred, float]] = {}
        self._per_uid: dict[int, int] = {}

    def issue(self, peer: PeerCred) -> str:
        """A new ticket for the peer, or Exhausted when its uid's share or all tickets are outstanding."""
        now = self._clock()
        with self._lock:
            if len(self._live) >= MAX_TICKETS or self._per_uid.get(peer.uid, 0) >= MAX_TICKETS_PER_UID:
                self._drop_expired(now)
            if self._per_uid.get(peer.uid, 0) >= MAX_TICKETS_PER_UID:
                raise Exhausted(
                    f"tickets: uid {peer.uid} has {MAX_TICKETS_PER_UID} outstanding (its share, MAX_TICKETS_PER_UID): "
                    "redeem them before asking for more"
                )
            if len(self._live) >= MAX_TICKETS:
                raise Exhausted(f"{MAX_TICKETS} tickets are outstanding: redeem them before asking for more")
            ticket = secrets.token_urlsafe(24)
            self._live[ticket] = (peer, now + self._ttl)
            self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
        return ticket

    def _drop_expired(self, now: float) -> None:
        self._live = {t: v for t, v in self._live.items() if v[1] > now}
        self._per_uid = {}
        for peer, _ in self._live.values():
            self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1

    def redeem(self, ticket: str) -> PeerCred | None:
        """The credentials a ticket stands for, once; None for an unknown, used or expired ticket."""
        with self._lock:
            entry = self._live.pop(ticket, None)
            if entry is not None:
                left = self._per_uid.get(entry[0].uid, 1) - 1
                if left > 0:
                    self._per_uid[entry[0].uid] = left
                else:
                    self._per_uid.pop(entry[0].uid, None)
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]
