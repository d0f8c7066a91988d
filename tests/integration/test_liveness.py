"""A session lives exactly as long as its process: real daemon, real rank processes, stopped and killed for real.

A client holds one liveness connection per session on the daemon's data socket. A rank too busy to send its
KeepAlives (here: SIGSTOPped, or with the GIL held by one thread) keeps its session past the lease, while a rank of
the same kind without that connection (gRPC only) loses its own; a rank killed -9 has its session released at
once, long before any lease, even when a child it forked still holds a copy of its descriptors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator

import pytest

from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.waiting import wait_until

pytestmark = pytest.mark.integration

# argv: target, client name, "data" or "grpc", "fork" or "". Prints "registered", then on each empty line of stdin
# saves and looks up one block and prints whether the session is the first one, the hit and the re-opens it saw. On
# "hold" it blocks in read(2) on stdin WITH the GIL held (ctypes.PyDLL keeps it), until one more byte comes: no
# other thread of it runs Python meanwhile, its keep-alive thread included (an engine starved of the GIL).
RANK = textwrap.dedent(
    """
    import ctypes, logging, os, sys, time, torch
    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor
    reopened = []
    class Seen(logging.Handler):
        def emit(self, record):
            if "session lost" in record.getMessage():
                reopened.append(record.getMessage())
    logging.getLogger("kvsidecar_client").addHandler(Seen())
    target, name, path, fork = sys.argv[1:5]
    client = SidecarClient.connect(target, model="org/Liveness", layout=EngineLayout(), num_kv_heads=1,
                                   hash_block_size=16, groups=[GroupSpec("mla", block_size=16)], client_name=name,
                                   data_socket=path == "data")
    kv = shared_tensor((8, 16, 16), torch.float32)
    client.register([kv], groups_of_tensor=[(0,)])
    if fork == "fork" and os.fork() == 0:  # a child that outlives its parent, with copies of its descriptors
        time.sleep(600)
        os._exit(0)
    first = client._keeper.session.id
    print("registered", flush=True)
    n = 0
    while line := sys.stdin.readline():
        if line == "hold\\n":
            ctypes.PyDLL(None).read(0, ctypes.create_string_buffer(1), 1)
            continue
        n += 1
        h = [bytes([n]) * 32]
        kv.fill_(float(n))
        client.save(h, [[0]], 16).result(timeout=60)
        hit = client.lookup(h, 17).hit_tokens
        print(client._keeper.session.id == first, hit, len(reopened), flush=True)
    """
)


def counter(daemon: DaemonProcess, prefix: str) -> float:
    body = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(prefix))


def rank_sessions(daemon: DaemonProcess) -> float:
    return counter(daemon, 'kvsidecar_sessions{role="rank"}')


@contextlib.contextmanager
def rank(daemon: DaemonProcess, name: str, path: str = "data", fork: str = "") -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, daemon.target, name, path, fork],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered", daemon.log()[-2000:]
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)  # the rank and any child it forked
        proc.wait(30)


def ask(proc: subprocess.Popen[str]) -> list[str]:
    """One save and lookup on the rank: [same session as at start, hit tokens, re-opens seen]."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    return proc.stdout.readline().split()


def stall(proc: subprocess.Popen[str], how: str) -> None:
    """Stop the rank's Python: the whole process (SIGSTOP), or every thread but one (the GIL held)."""
    if how == "sigstop":
        os.kill(proc.pid, signal.SIGSTOP)
    else:
        assert proc.stdin is not None
        proc.stdin.write("hold\n")
        proc.stdin.flush()


def resume(proc: subprocess.Popen[str], how: str) -> None:
    if how == "sigstop":
        os.kill(proc.pid, signal.SIGCONT)
    else:
        assert proc.stdin is not None
        proc.stdin.write("x")  # the one byte the held read(2) waits for
        proc.stdin.flush()


@pytest.mark.parametrize("how", ["sigstop", "gil-held"])
def test_a_stalled_rank_keeps_its_session_past_the_lease_where_one_without_liveness_loses_it(
    mooncake_master, tmp_path, how
):
    daemon = DaemonProcess(tmp_path, master=mooncake_master.address, session_ttl=2).start()
    try:
        with rank(daemon, "busy") as busy, rank(daemon, "grpc-only", path="grpc") as lease_only:
            assert ask(busy) == ["True", "16", "0"]
            assert rank_sessions(daemon) == 2
            # Neither can send a KeepAlive now, as an engine starved of the GIL or of CPU could not.
            stall(busy, how)
            stall(lease_only, how)
            wait_until(
                lambda: "(rank, grpc-only) expired" in daemon.log(), timeout=30,
                what="the lease-only rank's session expired (lease 2 s, swept every second)",
            )  # fmt: skip
            assert rank_sessions(daemon) == 1  # the stopped rank with its liveness connection kept its session
            assert "(rank, busy)" not in daemon.log()
            resume(busy, how)
            # Same session, its memory still registered: the save and the lookup need no re-open.
            assert ask(busy) == ["True", "16", "0"]
            looked_up = counter(daemon, "kvsidecar_lookup_tokens_total")
            resume(lease_only, how)
            same, hit, reopened = ask(lease_only)  # the lease-only rank re-opens, as before (back-compat)
            assert (same, hit, reopened) == ("False", "16", "1")  # its save after the re-open is stored
            # Looked up once: a call refused for the lapsed session was not counted, and is sent once more.
            assert counter(daemon, "kvsidecar_lookup_tokens_total") - looked_up == 17
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("fork", ["", "fork"], ids=["alone", "with-a-forked-child"])
def test_a_killed_rank_is_released_at_once_not_a_lease_later(mooncake_master, tmp_path, fork):
    daemon = DaemonProcess(tmp_path, master=mooncake_master.address, session_ttl=600).start()
    try:
        with rank(daemon, "doomed", fork=fork) as doomed:
            assert rank_sessions(daemon) == 1
            os.kill(doomed.pid, signal.SIGKILL)  # the rank alone; a forked child lives on with its copies
            doomed.wait(30)
            wait_until(
                lambda: rank_sessions(daemon) == 0, timeout=30, what="the killed rank's session released",
                detail=lambda: daemon.log()[-2000:],
            )  # fmt: skip
            assert "(rank, doomed) its process closed its liveness connection" in daemon.log()
    finally:
        assert daemon.stop() == 0
