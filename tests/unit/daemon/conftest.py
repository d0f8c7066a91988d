"""Fixtures the servicer tests share: a daemon in this process over a small in-memory store."""

import pytest

from kvsidecar.store.memory_store import MemoryStore
from support.inprocess import InProcessDaemon


@pytest.fixture
def store():
    return MemoryStore()


@pytest.fixture
def daemon(tmp_path, store):
    d = InProcessDaemon(tmp_path, store).start()
    yield d
    d.stop()
