"""Fixtures of the fuzz suite: one real daemon against the real master, and a well-behaved client beside it.

Every fuzz module talks to the same daemon process, so by the end it has taken every case of every module; the
well-behaved client runs through all of them, and the daemon must still be alive and stop cleanly (exit code 0).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from support.fuzzdaemon import FuzzDaemon
from support.fuzzwire import SENT, Wire
from support.goodclient import GoodClient
from support.guarded import close_leftovers


@pytest.fixture(scope="session", autouse=True)
def _no_segment_left_behind() -> Iterator[None]:
    """Unlink the guarded segments of cases that failed before cleaning up."""
    yield
    close_leftovers()


@pytest.fixture(scope="session")
def fuzz_master() -> Iterator[EmbeddedMaster]:
    """A master of the fuzz suite's own: a daemon that dies on the shared master (a crash repro, a kill test) leaves
    its segment mounted there for the master's client TTL, and puts the master places in it fail meanwhile."""
    master = EmbeddedMaster().start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def fuzz_daemon(fuzz_master, tmp_path_factory) -> Iterator[FuzzDaemon]:
    """The daemon under fuzz: checked alive after every case, stopped by PID, its exit code checked."""
    daemon = FuzzDaemon(tmp_path_factory.mktemp("fuzz-daemon"), master=fuzz_master.address).start()
    try:
        yield daemon
    finally:
        alive = daemon.alive()
        code = daemon.stop()
    assert alive, f"the daemon died during the fuzz run:\n{daemon.log()[-4000:]}"
    assert code == 0, f"the daemon exited with {code}:\n{daemon.log()[-4000:]}"


@pytest.fixture(scope="session")
def good_client(fuzz_daemon) -> Iterator[GoodClient]:
    """A well-behaved rank saving, looking up and loading its own blocks for as long as the fuzz suite runs."""
    client = GoodClient(fuzz_daemon.target, secrets.token_hex(4)).start()
    try:
        yield client
    finally:
        client.stop()
    GOOD.update(rounds=client.rounds, blocks=client.blocks_verified)
    client.check()
    assert client.rounds > 0, "the well-behaved client never completed a round"


@pytest.fixture(scope="session")
def wire(fuzz_daemon) -> Iterator[Wire]:
    """Typed and raw calls to the daemon under fuzz."""
    w = Wire(fuzz_daemon.target)
    yield w
    w.close()


GOOD: dict[str, int] = {}


def pytest_terminal_summary(terminalreporter) -> None:
    """How much the fuzz suite sent, and how much the well-behaved client verified meanwhile."""
    if not SENT:
        return
    top = ", ".join(f"{m} {n}" for m, n in SENT.most_common(6))
    terminalreporter.write_line(f"fuzz: {sum(SENT.values())} requests sent through support.fuzzwire ({top}, ...)")
    if GOOD:
        terminalreporter.write_line(
            f"fuzz: the well-behaved client completed {GOOD['rounds']} rounds, {GOOD['blocks']} blocks verified"
        )
