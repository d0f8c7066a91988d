"""Fixtures the servicer tests share: a daemon in this process over a small in-memory store."""

import pytest

from kvsidecar.store.memory_store import MemoryStore
from support.inprocess import InProcessDaemon


@pytest.fixture
def store():
    return MemoryStore()


@pytest.fixture
def daemon(tmp_path, store):
    # These ranks register named /dev/shm segments, a right granted explicitly (trusted ranks of this node).
    d = InProcessDaemon(tmp_path, store, allow_shm_names=True).start()
    yield d
    d.stop()
