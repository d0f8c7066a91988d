"""Fixtures shared by every suite. Keep each section small; suite-specific fixtures belong in the test module."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvsidecar.master import EmbeddedMaster
from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore

# --- Mooncake: one real master per session, stores connected to it -------------------------------------------------

# Mooncake's client reads its own environment when it is set up.
MOONCAKE_CLIENT_ENV = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",  # else the client advertises eth0 and leaves loopback
    "MC_LOG_LEVEL": "ERROR",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",  # a missing master fails setup in ~4 s instead of ~90 s
}
TEST_SEGMENT_SIZE = 64 << 20


@pytest.fixture(scope="session")
def mooncake_client_env() -> Iterator[None]:
    """Mooncake's client environment for the whole session (tests are the edge that sets it)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in MOONCAKE_CLIENT_ENV.items():
            mp.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[EmbeddedMaster]:
    """A real mooncake_master on free loopback ports, stopped (and checked gone by PID) at the end."""
    master = EmbeddedMaster().start()
    pid = master.pid
    assert pid is not None
    try:
        yield master
    finally:
        master.stop()
        assert not _pid_alive(pid), f"mooncake_master PID {pid} survived stop()"


def _settings_for(master: EmbeddedMaster | str, **overrides: object) -> MooncakeSettings:
    base = MooncakeSettings(
        local_hostname="127.0.0.1",
        master_server_addr=master if isinstance(master, str) else master.address,
        metadata_server="P2PHANDSHAKE",
        protocol="tcp",
        global_segment_size=TEST_SEGMENT_SIZE,
    )
    return dataclasses.replace(base, **overrides)


@pytest.fixture(scope="session")
def mooncake_settings() -> Callable[..., MooncakeSettings]:
    """Build settings for a test client of a master (or host:port): TCP, P2PHANDSHAKE, a 64 MiB segment."""
    return _settings_for


@pytest.fixture
def connect_mooncake(mooncake_client_env: None) -> Iterator[Callable[[MooncakeSettings], MooncakeStore]]:
    """Connect stores of one's own (to close, or on another master); each is closed after the test."""
    opened: list[MooncakeStore] = []

    def connect(settings: MooncakeSettings) -> MooncakeStore:
        store = MooncakeStore.connect(settings)
        opened.append(store)
        return store

    yield connect
    for store in reversed(opened):
        store.close()


@pytest.fixture(scope="session")
def _session_mooncake_store(mooncake_client_env: None, mooncake_master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    # Shared because close() takes 1-2 s; tests stay apart through key_prefix.
    store = MooncakeStore.connect(_settings_for(mooncake_master))
    yield store
    store.close()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def mooncake_store(_session_mooncake_store: MooncakeStore, key_prefix: str) -> Iterator[MooncakeStore]:
    """The session's store on the session master; keys under key_prefix are removed after the test."""
    yield _session_mooncake_store
    assert not _session_mooncake_store.closed, "a test closed the shared store; use connect_mooncake instead"
    _session_mooncake_store.remove_prefix(key_prefix)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
