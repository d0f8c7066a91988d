"""Mooncake's setup output: the lines every start prints go to the log, everything else to the real stderr at once,
and fd 2 comes back exactly as it was (written to fd 2 here, as Mooncake's glog does)."""

from __future__ import annotations

import logging
import os

import pytest

from kvsidecar.store.setup_output import quiet_setup

NOTICE = "WARNING: Logging before InitGoogleLogging() is written to STDERR"
DESCRIPTOR = "E1204 18:32:35.961408 14241 transfer_metadata.cpp:1098] Local segment descriptor not found"
REAL = "E1204 18:48:52.951251  4044 master_client.cpp:361] Client not available"


def printing(*lines: str, rc: int = 0):
    def setup() -> int:
        for line in lines:
            os.write(2, f"{line}\n".encode())
        return rc

    return setup


def test_a_healthy_setup_keeps_its_expected_lines_for_the_debug_log(capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="kvsidecar.store.setup_output")
    before = os.fstat(2)
    assert quiet_setup(printing(NOTICE, DESCRIPTOR, "something else")) == 0
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert capfd.readouterr().err == "something else\n"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, f"Mooncake's client setup printed (expected at every start, not an error): {line}")
        for line in (NOTICE, DESCRIPTOR)
    ]


def test_a_failed_setup_shows_everything_mooncake_printed(capfd, caplog):
    assert quiet_setup(printing(NOTICE, REAL, rc=-1)) == -1
    assert capfd.readouterr().err == f"{REAL}\n"  # a real error reaches stderr as Mooncake printed it
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, f"Mooncake's client setup failed; it also printed: {NOTICE}")
    ]


def test_a_setup_that_raises_restores_stderr_and_logs_what_it_printed(capfd, caplog):
    def setup() -> int:
        os.write(2, f"{DESCRIPTOR}\n".encode())
        raise RuntimeError("setup blew up")

    with pytest.raises(RuntimeError, match="setup blew up"):
        quiet_setup(setup)
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
