"""Fixtures shared by every suite. Keep each section small; suite-specific fixtures belong in the test module."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator

import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore
from kvsidecar_testing.mooncake_env import MooncakeEnv

# --- Mooncake: one real master per session, stores connected to it -------------------------------------------------

TEST_SEGMENT_SIZE = 64 << 20


@pytest.fixture(scope="session")
def mooncake_client_env() -> Iterator[MooncakeEnv]:
    """Mooncake's client environment for the whole session (tests are the edge that sets it), and its private tmp."""
    tempfile.gettempdir()  # Python's own temporary files (pytest's included) stay where they were
    env = MooncakeEnv()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.variables().items():
            mp.setenv(name, value)
        yield env
    left = env.close()
    if left:
        warnings.warn(f"Mooncake left {len(left)} files in its temporary folder (removed): {left[:5]}", stacklevel=1)


@pytest.fixture(scope="session")
def mooncake_master(mooncake_client_env: MooncakeEnv) -> Iterator[EmbeddedMaster]:
    """A real mooncake_master on free loopback ports, stopped (and checked gone by PID) at the end."""
    master = EmbeddedMaster(env=mooncake_client_env.variables()).start()
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
