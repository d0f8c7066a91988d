"""What the integration tests share beyond the session's master (tests/conftest.py): a daemon process per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar_testing.processes import DaemonProcess


@pytest.fixture
def daemon(mooncake_master: EmbeddedMaster, tmp_path) -> Iterator[DaemonProcess]:
    """`kvsidecar serve` on the session's master, in a folder of its own; it must stop cleanly."""
    workdir = tmp_path / "daemon"
    workdir.mkdir()
    d = DaemonProcess(workdir, master=mooncake_master.address).start()
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()
