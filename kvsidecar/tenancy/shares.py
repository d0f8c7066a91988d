"""Fair shares: how much of a bounded resource each account holds, capped per account and daemon-wide.

An account is the caller's tenant with a tenants file, else its uid (a TCP caller without either: its certificate
subject, else one account for all such callers). One account using up its share leaves the rest of the daemon's
bound to the others; the refusal names which cap it hit, its value, and the setting that changes it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.errors import Exhausted
from kvsidecar.parsing import GiB, TiB

__all__ = [
    "DEFAULT_MAX_MEMFDS",
    "DEFAULT_MAX_MEMFDS_PER_ACCOUNT",
    "DEFAULT_MAX_REGISTERED_BYTES",
    "DEFAULT_MAX_REGISTERED_BYTES_PER_ACCOUNT",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_MAX_SESSIONS_PER_ACCOUNT",
    "SessionShares",
    "ShareLimits",
    "Shares",
    "account_of",
]

# Sized for a GPU node (8 GPUs, 1-2 TiB of host memory, one engine uid or a few): see docs/security.md.
DEFAULT_MAX_REGISTERED_BYTES = 1 * TiB  # host memory (memfds, /dev/shm) registered by all sessions together
DEFAULT_MAX_REGISTERED_BYTES_PER_ACCOUNT = 512 * GiB  # ... by one tenant (tenants file: max_registered_bytes) or uid
DEFAULT_MAX_SESSIONS = 4096
DEFAULT_MAX_SESSIONS_PER_ACCOUNT = 1024
DEFAULT_MAX_MEMFDS = 4096  # memfds parked or mapped (each mapped one holds two of the daemon's descriptors)
DEFAULT_MAX_MEMFDS_PER_ACCOUNT = 1024


def account_of(tenant: str, uid: int | None, cert_subject: str | None = None) -> str:
    """The account a caller's shares are counted under: 'tenant NAME', 'uid N', a certificate, or 'tcp'."""
    if tenant:
        return f"tenant {tenant}"
    if uid is not None:
        return f"uid {uid}"
    if cert_subject:
        return f"certificate {cert_subject}"
    return "tcp"


def _count(n: int) -> str:
    return str(n)


@dataclass(frozen=True)
class _Cap:
    value: int
    setting: str


class Shares:
    """What each account holds of one resource (`what`, e.g. 'registered bytes'), bounded per account and in all.

    per_account and total are the caps; each is named by its setting in refusals. take() raises Exhausted when
    either would be passed and takes nothing then; give() returns what take() took.
    """

    def __init__(
        self,
        what: str,
        per_account: int,
        total: int,
        *,
        per_account_setting: str,
        total_setting: str,
        show: Callable[[int], str] = _count,
    ) -> None:
        self.what = what
        self._per_account = _Cap(per_account, per_account_setting)
        self._total = _Cap(total, total_setting)
        self._show = show
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._sum = 0

    def take(self, account: str, amount: int, *, limit: int | None = None, limit_setting: str = "") -> None:
        """Count amount more for account, or Exhausted naming the cap; limit overrides the per-account cap."""
        cap = self._per_account if limit is None else _Cap(limit, limit_setting or self._per_account.setting)
        with self._lock:
            held = self._held.get(account, 0)
            if held + amount > cap.value:
                raise Exhausted(
                    f"{self.what}: {account} holds {self._show(held)} and asks for {self._show(amount)} more, past "
                    f"its share of {self._show(cap.value)} ({cap.setting})"
                )
            if self._sum + amount > self._total.value:
                raise Exhausted(
                    f"{self.what}: the daemon holds {self._show(self._sum)} for all accounts and {account} asks for "
                    f"{self._show(amount)} more, past the daemon-wide cap of {self._show(self._total.value)} "
                    f"({self._total.setting})"
                )
            self._held[account] = held + amount
            self._sum += amount

    def give(self, account: str, amount: int) -> None:
        """Return amount that take() counted for account."""
        with self._lock:
            left = self._held.get(account, 0) - amount
            if left > 0:
                self._held[account] = left
            else:
                self._held.pop(account, None)
            self._sum = max(0, self._sum - amount)

    def held(self, account: str | None = None) -> int:
        """What account holds now (None: all accounts together)."""
        with self._lock:
            return self._sum if account is None else self._held.get(account, 0)


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / (1 << 30):.2f} GiB)"


@dataclass(frozen=True)
class ShareLimits:
    """The caps of SessionShares (cut from Config): sessions, memfds and registered host bytes, per account and
    daemon-wide."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_sessions_per_account: int = DEFAULT_MAX_SESSIONS_PER_ACCOUNT
    max_memfds: int = DEFAULT_MAX_MEMFDS
    max_memfds_per_account: int = DEFAULT_MAX_MEMFDS_PER_ACCOUNT
    max_registered_bytes: int = DEFAULT_MAX_REGISTERED_BYTES
    max_registered_bytes_per_account: int = DEFAULT_MAX_REGISTERED_BYTES_PER_ACCOUNT


class SessionShares:
    """The shares sessions draw from: open sessions, memfds held, registered host bytes (ShareLimits)."""

    def __init__(
        self,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_sessions_per_account: int = DEFAULT_MAX_SESSIONS_PER_ACCOUNT,
        max_memfds: int = DEFAULT_MAX_MEMFDS,
        max_memfds_per_account: int = DEFAULT_MAX_MEMFDS_PER_ACCOUNT,
        max_registered_bytes: int = DEFAULT_MAX_REGISTERED_BYTES,
        max_registered_bytes_per_account: int = DEFAULT_MAX_REGISTERED_BYTES_PER_ACCOUNT,
    ) -> None:
        self.sessions = Shares(
            "open sessions",
            max_sessions_per_account,
            max_sessions,
            per_account_setting="--max-sessions-per-account",
            total_setting="--max-sessions",
        )
        self.memfds = Shares(
            "memfds held",
            max_memfds_per_account,
            max_memfds,
            per_account_setting="--max-memfds-per-account",
            total_setting="--max-memfds",
        )
        self.registered_bytes = Shares(
            "registered host memory",
            max_registered_bytes_per_account,
            max_registered_bytes,
            per_account_setting="--max-registered-bytes-per-account",
            total_setting="--max-registered-bytes",
            show=_bytes,
        )

    @classmethod
    def of(cls, limits: ShareLimits) -> SessionShares:
        """The shares a daemon's settings give."""
        return cls(**dataclasses.asdict(limits))
