"""kvsidecar_testing's own parts: waits run on the clock they are given, the Mooncake environment is private."""

from __future__ import annotations

import os
import time

import pytest

from kvsidecar_testing.mooncake_env import CLIENT_ENV, MooncakeEnv
from kvsidecar_testing.processes import DaemonProcess, ProcessError
from kvsidecar_testing.waiting import Backoff, WaitTimeout, wait_until


class FakeClock:
    """Time passes only when someone sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_wait_until_returns_the_first_truthy_answer_backing_off():
    clock = FakeClock()
    answers = iter([None, 0, "", "ready"])
    assert wait_until(lambda: next(answers), timeout=10, what="x", clock=clock, backoff=Backoff(1, 2, 3)) == "ready"
    assert clock.slept == [1, 2, 3]


def test_wait_until_times_out_on_the_given_clock_and_says_what_it_saw():
    clock = FakeClock()
    with pytest.raises(WaitTimeout, match=r"the thing: not reached within 5 s:\nlast: 7"):
        wait_until(lambda: False, timeout=5, what="the thing", clock=clock, backoff=Backoff(1, 2, 2),
                   detail=lambda: "last: 7")  # fmt: skip
    assert clock.now == 5  # never slept past the deadline
    assert clock.slept == [1, 2, 2]


def test_a_daemon_that_never_gets_ready_times_out_on_its_clock_and_is_stopped_by_pid(tmp_path):
    never_ready = tmp_path / "python"
    never_ready.write_text("#!/bin/sh\nexec sleep 60\n")
    never_ready.chmod(0o755)
    clock = FakeClock()
    daemon = DaemonProcess(tmp_path, python=never_ready, clock=clock, backoff=Backoff(0.001, 2, 1))
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="daemon ready"):
        daemon.start(timeout=30)
    assert time.monotonic() - started < 10  # the 30 s passed on the fake clock
    assert clock.now == pytest.approx(30)
    assert daemon.proc is not None and daemon.proc.returncode is not None  # stopped and reaped
    assert daemon.mooncake is None and not any(p.name.startswith("kvsidecar-mooncake-") for p in tmp_path.iterdir())


def test_a_daemon_that_exits_at_start_reports_its_log(tmp_path):
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho 'no such flag' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(ProcessError, match=r"exited with 3:\nno such flag"):
        DaemonProcess(tmp_path, python=failing).start()


def test_mooncake_env_is_private_and_removed_with_what_was_left():
    env = MooncakeEnv()
    variables = env.variables(native=False)
    assert CLIENT_ENV.items() <= variables.items()
    assert {variables[k] for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR")} == {str(env.tmp)}
    (env.tmp / "leftover.sock").write_text("")
    assert env.close() == ["leftover.sock"]
    assert not os.path.exists(env.tmp)
