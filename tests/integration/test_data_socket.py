"""The data socket (saves and loads without gRPC) against a real daemon and a real mooncake_master: the client uses it
byte-exact, a connection acts only for the session whose uid and side secret it proves, bad frames get their reason
while everyone else is served, and a client the socket refuses carries on over gRPC."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvsidecar_client import EngineLayout, LoadItem, SaveItem, SidecarClient, shared_tensor
from kvsidecar_client import GroupSpec as ClientGroup
from kvsidecar_client._side import SideSocket
from kvsidecar_contract import frames
from kvsidecar_contract.paths import data_socket_path, side_socket_path
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.processes import DaemonProcess
from support.localusers import shared_dir, throwaway_users
from support.rawrank import group, open_request

pytestmark = pytest.mark.integration

U = 16
NUM_BLOCKS = 32
INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED = 3, 5, 7, 8


def connect(daemon: DaemonProcess, key_prefix: str, **kw: object) -> tuple[SidecarClient, torch.Tensor]:
    kv = shared_tensor((NUM_BLOCKS, U, 64), torch.float16)
    client = SidecarClient.connect(
        daemon.target, model="org/DataSocket", layout=EngineLayout(), num_kv_heads=1, hash_block_size=U,
        groups=[ClientGroup("full_attention", block_size=U)], cache_prefix=key_prefix, **kw,
    )  # fmt: skip
    client.register([kv], groups_of_tensor=[(0,)])
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(23)))
    return client, kv


def data_requests(daemon: DaemonProcess) -> dict[str, float]:
    return daemon.metric_samples("kvsidecar_data_socket_requests_total", "method")


def round_trip(client: SidecarClient, kv: torch.Tensor, salt: str, blocks: int = 4) -> None:
    """Save blocks 0.., load them into the upper half, and check the bytes."""
    hashes = chained_hashes(salt, blocks)
    result = client.save(hashes, [list(range(blocks))], blocks * U).result(timeout=60)
    assert (result.written, result.failed) == (blocks, 0), result
    hit = client.lookup(hashes, blocks * U + 1)
    assert hit.hit_tokens == blocks * U
    upper = [NUM_BLOCKS // 2 + b for b in range(blocks)]
    assert client.load(hashes, [upper], hit) == set()
    assert torch.equal(kv[NUM_BLOCKS // 2 : NUM_BLOCKS // 2 + blocks], kv[:blocks])


def test_saves_and_loads_travel_the_data_socket_byte_exact_and_grpc_only_clients_still_work(daemon, key_prefix):
    client, kv = connect(daemon, key_prefix)
    plain, plain_kv = connect(daemon, key_prefix + "-grpc", data_socket=False)
    try:
        before, calls_before = data_requests(daemon), daemon.requests_by_method()
        round_trip(client, kv, "over the data socket")
        after = data_requests(daemon)
        assert after.get("Save", 0) - before.get("Save", 0) == 1
        assert after.get("Load", 0) - before.get("Load", 0) == 1
        # A step's batches too, answered per name.
        hashes = chained_hashes("batched", 2)
        jobs = client.save_batch([SaveItem("a", hashes, [[4, 5]], 2 * U)])
        assert jobs["a"].result(timeout=60).written == 2
        hit = client.lookup(hashes, 2 * U + 1)
        loaded = client.load_batch([LoadItem("a", hashes, [[20, 21]], hit)])
        assert loaded["a"].loaded == 2 and torch.equal(kv[20:22], kv[4:6])  # type: ignore[union-attr]
        batched = data_requests(daemon)
        assert batched.get("SaveBatch", 0) - after.get("SaveBatch", 0) == 1
        assert batched.get("LoadBatch", 0) - after.get("LoadBatch", 0) == 1
        assert batched.get("Lookup", 0) == 2  # lookups too (the two above)
        # The client that asked for gRPC alone never touches the socket, and gets the same bytes.
        round_trip(plain, plain_kv, "over grpc")
        assert data_requests(daemon) == batched
        calls = daemon.requests_by_method()
        assert calls["Save"] - calls_before.get("Save", 0) == 2  # every request counts once, whichever way it came
        # An operator sees who holds connections: `kvsidecar status` counts them per session.
        kept = client._keeper.data._count  # type: ignore[union-attr]
        held = {s.get("data_connections", 0) for s in status(daemon)["sessions"] if s["model"] == "org/DataSocket"}
        # Its calls' connections and its session's liveness connection; the gRPC-only client holds none.
        assert kept >= 1 and held == {0, kept + 1}, (held, kept)
        assert "data conn" in subprocess.run(
            [sys.executable, "-m", "kvsidecar", "status", "--socket", daemon.socket], capture_output=True, text=True,
            timeout=60,
        ).stdout  # fmt: skip
        # A save waited on at once (result() with no timeout) is sent from the waiting thread: no hand-off to a save
        # thread and back. One nobody waits on yet goes from a save thread. Same answers and bytes either way.
        senders: list[int] = []
        call = client._keeper.call
        client._keeper.call = lambda *a: senders.append(threading.get_ident()) or call(*a)  # type: ignore[method-assign]
        waited = chained_hashes("waited on at once", 3)
        assert client.save(waited, [[8, 9, 10]], 3 * U).result().written == 3
        assert client.save(chained_hashes("left to a save thread", 2), [[11, 12]], 2 * U).result(60).written == 2
        assert senders[0] == threading.get_ident() != senders[1], senders
        hit = client.lookup(waited, 3 * U + 1)
        assert client.load(waited, [[24, 25, 26]], hit) == set() and torch.equal(kv[24:27], kv[8:11])
    finally:
        client.close()
        plain.close()
    assert _eventually_no_connections(daemon), "closed clients leave no connection (and no daemon thread) behind"


def status(daemon: DaemonProcess) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "status", "--socket", daemon.socket, "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def _eventually_no_connections(daemon: DaemonProcess) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if daemon.metric_samples("kvsidecar_data_socket_connections", "") == {"": 0.0}:
            return True
        time.sleep(0.05)
    return False


# ---- raw frames ----


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def open_session(daemon: DaemonProcess) -> tuple[str, bytes]:
    """A session opened over gRPC with this process's ticket, as the client does: (id, side secret)."""
    import grpc

    from kvsidecar_contract.proto.sidecar_pb2_grpc import SidecarStub

    side = SideSocket(side_socket_path(daemon.socket))
    request = open_request([group("full_attention", U)], model="org/Raw", u=U)
    with grpc.insecure_channel(daemon.target) as channel:
        response = SidecarStub(channel).OpenSession(request, timeout=30, metadata=side.metadata(10))
    assert response.side_secret, "a session opened with a ticket has a side secret"
    return response.session_id, response.side_secret


def raw(daemon: DaemonProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(data_socket_path(daemon.socket))
    return sock


def send(sock: socket.socket, method: int, body: bytes, seconds: float = 0.0, length: int | None = None) -> None:
    sock.sendall(frames.REQUEST.pack(len(body) if length is None else length, method, seconds) + body)


def reply(sock: socket.socket) -> tuple[int, bytes]:
    header = recv(sock, frames.REPLY.size)
    length, status = frames.REPLY.unpack(header)
    return status, recv(sock, length)


def recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += got
    return buf


def hello(session: str, secret: bytes | str) -> bytes:
    return json.dumps({"session": session, "secret": secret if isinstance(secret, str) else secret.hex()}).encode()


def test_a_connection_acts_only_for_the_session_it_proves(daemon):
    session, secret = open_session(daemon)
    other, _ = open_session(daemon)
    refusals = {
        "no hello": (frames.METHOD_IDS["Save"], b""),
        "not json": (frames.HELLO, b"{"),
        "wrong secret": (frames.HELLO, hello(session, "00" * 16)),
        "another session's secret": (frames.HELLO, hello(other, secret)),
        "unknown session": (frames.HELLO, hello("0" * 32, secret)),
    }
    expected = {
        "no hello": (INVALID_ARGUMENT, "starts with one HELLO frame"),
        "not json": (INVALID_ARGUMENT, "a HELLO frame is the JSON object"),
        "wrong secret": (PERMISSION_DENIED, "wrong side secret"),
        "another session's secret": (PERMISSION_DENIED, "wrong side secret"),
        "unknown session": (NOT_FOUND, "unknown session"),
    }
    for name, (method, body) in refusals.items():
        with raw(daemon) as sock:
            send(sock, method, body)
            status, reason = reply(sock)
            assert (status, expected[name][1] in reason.decode()) == (expected[name][0], True), (name, reason)
            assert sock.recv(1) == b"", f"{name}: the daemon closes a connection it refused"
    with raw(daemon) as sock:
        send(sock, frames.HELLO, hello(session, secret))
        assert reply(sock) == (frames.OK, b"")
        # Bound to one session: a request naming another is refused, and the connection goes on.
        send(sock, frames.METHOD_IDS["Save"], pb.SaveRequest(session_id=other).SerializeToString())
        status, reason = reply(sock)
        assert status == PERMISSION_DENIED and b"bound to another session" in reason
        request = pb.SaveRequest(session_id=session, block_ids=[pb.BlockIds()])
        send(sock, frames.METHOD_IDS["Save"], request.SerializeToString())
        status, reason = reply(sock)
        assert status == 9 and b"register" in reason.lower(), reason  # FAILED_PRECONDITION: no memory yet


def test_bad_frames_get_their_reason_and_the_daemon_keeps_serving(daemon, key_prefix):
    client, kv = connect(daemon, key_prefix)
    session, secret = open_session(daemon)
    try:
        with raw(daemon) as sock:
            send(sock, frames.HELLO, hello(session, secret))
            assert reply(sock)[0] == frames.OK
            send(sock, 77, b"whatever")
            status, reason = reply(sock)
            assert status == INVALID_ARGUMENT and b"unknown data-socket method 77" in reason
            send(sock, frames.METHOD_IDS["Load"], b"\xff\xff\xff")
            status, reason = reply(sock)
            assert status == INVALID_ARGUMENT and b"not a valid kvsidecar.v1.LoadRequest" in reason, reason
            round_trip(client, kv, "between bad frames")
            # A frame past --max-message-bytes is answered and the connection closed: its body is never read.
            send(sock, frames.METHOD_IDS["Save"], b"", length=2**32 - 1)
            status, reason = reply(sock)
            assert status == INVALID_ARGUMENT and b"--max-message-bytes" in reason
            assert sock.recv(1) == b""
        # Headers claiming big frames cost nothing until their bytes arrive: eight of them claiming 60 MiB each.
        rss = rss_mib(daemon.pid)
        claims = [raw(daemon) for _ in range(8)]
        for claim in claims:
            send(claim, frames.HELLO, hello(session, secret))
            assert reply(claim)[0] == frames.OK
            send(claim, frames.METHOD_IDS["SaveBatch"], b"", length=60 << 20)
        time.sleep(0.5)
        grown = rss_mib(daemon.pid) - rss
        for claim in claims:
            claim.close()
        assert grown < 120, f"the daemon's RSS grew {grown} MiB for 480 MiB of claimed, unsent frames"
        # A peer that connects and says nothing is closed (it holds no thread for long).
        with raw(daemon) as silent:
            silent.settimeout(10)
            assert silent.recv(1) == b""
        # One that vanishes mid-frame costs nothing either.
        with raw(daemon) as torn:
            torn.sendall(frames.REQUEST.pack(10, frames.HELLO, 0.0) + b"{")
        round_trip(client, kv, "after the bad frames")
    finally:
        client.close()


def test_connections_are_bounded_per_uid_and_a_refused_client_uses_grpc(daemon, key_prefix):
    from kvsidecar.rpc.datasocket import MAX_CONNECTIONS_PER_UID

    held = []
    try:
        while len(held) < MAX_CONNECTIONS_PER_UID:
            held.append(raw(daemon))  # this uid's whole share, idle before their hello
            if len(held) % 32 == 0:
                time.sleep(0.1)  # let the accept thread keep up
        with raw(daemon) as extra:
            status, reason = reply(extra)
            assert status == RESOURCE_EXHAUSTED and b"MAX_CONNECTIONS_PER_UID" in reason, reason
        before = data_requests(daemon)
        client, kv = connect(daemon, key_prefix)
        try:
            round_trip(client, kv, "refused by the data socket")  # over gRPC, same bytes
        finally:
            client.close()
        assert data_requests(daemon) == before
    finally:
        for sock in held:
            sock.close()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"), reason="needs root and useradd (CI has both)")
def test_another_uid_with_the_secret_is_refused(mooncake_master):
    """The secret alone is not enough: the kernel-reported uid must be the one that opened the session."""
    with throwaway_users(1, "kvds") as (user,), shared_dir("kvds-", 0o777) as d:
        daemon = DaemonProcess(d, master=mooncake_master.address, extra=("--socket-mode", "0666")).start()
        try:
            session, secret = open_session(daemon)
            probe = (
                "import json, os, socket, struct, sys\n"
                "os.setgroups([]); os.setgid(int(sys.argv[4])); os.setuid(int(sys.argv[3]))\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(30); s.connect(sys.argv[1])\n"
                "body = sys.argv[2].encode()\n"
                f"s.sendall(struct.pack({frames.REQUEST.format!r}, len(body), {frames.HELLO}, 0.0) + body)\n"
                "head = b''\n"
                "while len(head) < 5: head += s.recv(5 - len(head))\n"
                "n, status = struct.unpack('<IB', head)\n"
                "print(json.dumps([status, s.recv(n).decode()]))\n"
            )
            out = subprocess.run(
                [sys.executable, "-c", probe, data_socket_path(daemon.socket), hello(session, secret).decode(),
                 str(user.pw_uid), str(user.pw_gid)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            status, reason = json.loads(out.stdout)
            assert status == PERMISSION_DENIED and "another uid" in reason, reason
        finally:
            assert daemon.stop() == 0, daemon.log()


def hold_connections(daemon: DaemonProcess, client: SidecarClient, kv: torch.Tensor, n: int) -> None:
    """Make the client keep at least n data-socket connections, by loading from n threads at once."""
    hashes = chained_hashes("held", 1)
    assert client.save(hashes, [[0]], U).result(timeout=60).failed == 0
    hit = client.lookup(hashes, U + 1)
    for _ in range(50):
        if daemon.metric_samples("kvsidecar_data_socket_connections", "")[""] >= n:
            return
        start = threading.Barrier(n)

        def load(start: threading.Barrier = start) -> None:
            start.wait()
            client.load(hashes, [[NUM_BLOCKS - 1]], hit)

        threads = [threading.Thread(target=load) for _ in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    raise AssertionError(f"the client never held {n} connections")


def test_a_restarted_daemon_is_reached_again_and_stopping_waits_for_nobody_idle(mooncake_master, tmp_path, key_prefix):
    first = DaemonProcess(tmp_path, master=mooncake_master.address).start()
    client, kv = connect(first, key_prefix)
    try:
        round_trip(client, kv, "before the restart")
        hold_connections(first, client, kv, 3)  # several idle connections, all of which the restart kills
        started = time.monotonic()
        assert first.stop() == 0, first.log()
        assert time.monotonic() - started < 8, "an idle data-socket connection must not hold the daemon's stop"
        second = DaemonProcess(tmp_path, master=mooncake_master.address).start()
        try:
            # The first call finds its connection dead, drops every kept one (the same daemon's), opens one, is told
            # the session is gone, re-opens and registers again, and is sent again: one call, no error to the engine.
            round_trip(client, kv, "after the restart")
            assert data_requests(second).get("Save", 0) >= 1
        finally:
            client.close()
            assert second.stop() == 0, second.log()
    finally:
        client.close()
