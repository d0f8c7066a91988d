"""The daemon's way to Mooncake at the start: waiting, within the start's deadline, for its master to accept
connections, before Mooncake's setup (which, with no master, retries for about 90 s holding the GIL) is called; the
client set up with Mooncake's environment, its listeners fenced."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from kvsidecar.daemon.settings import StoreSettings
from kvsidecar.daemon.signals import Signals
from kvsidecar.errors import DaemonError, FenceError
from kvsidecar.fence.daemon import DaemonFence
from kvsidecar.parsing import parse_address
from kvsidecar.store import Store
from kvsidecar.store.base import StoreUnavailable

__all__ = ["MOONCAKE_RPC_TIMEOUT_S", "connect_store", "reach_master"]

log = logging.getLogger("kvsidecar")

MOONCAKE_RPC_TIMEOUT_S = 30.0  # Mooncake's own default for MC_RPC_TIMEOUT_MS

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


async def connect_store(
    settings: StoreSettings, master: str, timeout: float, fence: DaemonFence, signals: Signals
) -> tuple[Store, float]:
    """Mooncake's client, set up once its master accepts connections, trying again until timeout (--master-timeout);
    with the longest one of its calls to the master may take (its RPC timeout), in seconds."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    call_s = _mooncake_environment(settings.local_hostname)
    while True:
        await reach_master(master, deadline, timeout)
        try:
            # The setup holds the GIL while it runs: a stop signal meanwhile ends the process at once.
            with signals.fatal():
                return await loop.run_in_executor(None, _open_store, settings, master, fence), call_s
        except StoreUnavailable as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("Mooncake setup failed, trying again until %g s have passed: %s", timeout, exc.reason)


def _open_store(cfg: StoreSettings, master: str, fence: DaemonFence) -> Store:
    # Mooncake is imported only here (and in the store package): the rest of the daemon runs without it.
    from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore
    from kvsidecar.store.native import ensure_native_libs

    ensure_native_libs()
    settings = MooncakeSettings(
        local_hostname=cfg.local_hostname,
        metadata_server=cfg.metadata_server,
        master_server_addr=master,
        global_segment_size=cfg.segment_size,
        local_buffer_size=cfg.local_buffer_size,
        protocol=cfg.protocol,
        rdma_devices=cfg.rdma_devices,
        replica_num=cfg.replicas,
    )
    # Mooncake opens its listeners on every interface during setup; the fence seals them before it returns.
    try:
        return fence.open_store(lambda: MooncakeStore.connect(settings), lambda store: store.close())
    except FenceError as exc:
        raise DaemonError(f"refusing to run: {exc}") from None


def _mooncake_environment(local_hostname: str) -> float:
    """Mooncake's own environment variables, set at the edge where the operator has not; the longest one of its
    calls to the master may take (its RPC timeout), in seconds."""
    # Stay on loopback when the node is loopback.
    if local_hostname in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    # One attempt per setup (~4.4 s when it fails): the daemon waits for the master itself (--master-timeout).
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    # A hung master must not hold a worker thread for Mooncake's default 30 s: lookups degrade to misses, and a load
    # tries again within its deadline (datapath/retries.py).
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", "5000")
    try:
        timeout_ms = float(os.environ["MC_RPC_TIMEOUT_MS"])
    except ValueError:
        timeout_ms = 0
    return timeout_ms / 1000 if timeout_ms > 0 else MOONCAKE_RPC_TIMEOUT_S  # <= 0: Mooncake waits its default
