"""The daemon's way to its Mooncake master at the start: waiting, within the start's deadline, for it to accept
connections, before Mooncake's setup (which, with no master, retries for about 90 s holding the GIL) is called."""

from __future__ import annotations

import asyncio
import logging
import time

from kvsidecar.errors import DaemonError
from kvsidecar.parsing import parse_address

__all__ = ["reach_master"]

log = logging.getLogger("kvsidecar")

_PROBE_EVERY_S = 0.25
_PROBE_TIMEOUT_S = 2.0  # one connection attempt (a host that drops packets answers nothing)


async def reach_master(address: str, deadline: float, timeout: float) -> None:
    """Return once a TCP connection to address succeeds; DaemonError naming the last reason when none does before
    deadline (time.monotonic()). timeout is the whole wait (--master-timeout), for the message."""
    host, port = parse_address(address)
    told = False
    while True:
        left = deadline - time.monotonic()
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), timeout=max(0.05, min(left, _PROBE_TIMEOUT_S))
            )
        except (OSError, asyncio.TimeoutError) as exc:
            reason = (exc.strerror if isinstance(exc, OSError) else None) or "no answer"
        else:
            writer.close()
            return
        if time.monotonic() + _PROBE_EVERY_S >= deadline:
            raise DaemonError(
                f"no Mooncake master answers at {address} ({reason}) within {timeout:g} s: is a mooncake_master "
                f"listening at {address}? (--master-timeout waits longer)"
            )
        if not told:
            log.info("waiting up to %g s for the Mooncake master at %s (%s)", timeout, address, reason)
            told = True
        await asyncio.sleep(_PROBE_EVERY_S)
