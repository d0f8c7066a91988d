"""Who may talk to the daemon: the socket's permissions, TLS with client certificates and a token, tenants."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
import sys

import grpc
import pytest

from kvsidecar_client import EngineLayout, GroupSpec, PermissionDenied, SidecarClient, TcpAuth
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc
from kvsidecar_testing.processes import DaemonProcess, free_port
from support.certs import make_pki
from support.rawrank import RawRank, group, open_request

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tcp_daemon(mooncake_master, tmp_path, pki):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    port = free_port()
    d = DaemonProcess(
        tmp_path, allow_shm_names=True,
        master=mooncake_master.address,
        extra=(
            "--listen", f"127.0.0.1:{port}",
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca), "--token-file", str(token),
        ),
    ).start()  # fmt: skip
    d.tcp = f"127.0.0.1:{port}"
    yield d
    assert d.stop() == 0, d.log()


def open_session(target: str, credentials: grpc.ChannelCredentials | None) -> pb.OpenSessionResponse:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        req = open_request([group("mla", 16)], role=pb.ROLE_SCHEDULER)
        return pb_grpc.SidecarStub(channel).OpenSession(req, timeout=10)


def test_tcp_needs_tls_a_client_certificate_and_the_token(tcp_daemon, pki):
    ca, cert, key = pki.ca.read_bytes(), pki.client_cert.read_bytes(), pki.client_key.read_bytes()
    good = TcpAuth(ca, cert, key, TOKEN)
    assert open_session(tcp_daemon.tcp, good.credentials()).session_id

    refusals = {
        "plaintext": None,
        "no client certificate": TcpAuth(ca, None, None, TOKEN).credentials(),
        "certificate of another CA": TcpAuth(
            ca, pki.other_client_cert.read_bytes(), pki.other_client_key.read_bytes(), TOKEN
        ).credentials(),
    }
    for what, creds in refusals.items():
        with pytest.raises(grpc.RpcError) as err:
            open_session(tcp_daemon.tcp, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what  # the TLS handshake fails

    for token in (None, "wrong-token", TOKEN + "x"):
        with pytest.raises(grpc.RpcError) as err:
            open_session(tcp_daemon.tcp, TcpAuth(ca, cert, key, token).credentials())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
        assert "bearer token" in err.value.details()


def test_the_client_library_speaks_tls_and_token(tcp_daemon, pki):
    layout = EngineLayout()
    auth = TcpAuth.from_files(str(pki.ca), str(pki.client_cert), str(pki.client_key), "")
    with pytest.raises(PermissionDenied, match="bearer token"):
        SidecarClient.connect(tcp_daemon.tcp, model="m", layout=layout, num_kv_heads=1, hash_block_size=16,
                              groups=[GroupSpec("mla", 16)], role="scheduler", auth=auth)  # fmt: skip
    auth = TcpAuth(auth.root_ca, auth.client_cert, auth.client_key, TOKEN)
    client = SidecarClient.connect(tcp_daemon.tcp, model="m", layout=layout, num_kv_heads=1, hash_block_size=16,
                                   groups=[GroupSpec("mla", 16)], role="scheduler", auth=auth)  # fmt: skip
    try:
        assert client.lookup([bytes(32)], 17).hit_tokens == 0
    finally:
        client.close()


def test_health_over_tls_needs_no_token_and_status_speaks_tls(tcp_daemon, pki, tmp_path):
    base = [sys.executable, "-m", "kvsidecar", "status", "--address", tcp_daemon.tcp, "--tls-ca", str(pki.ca),
            "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]  # fmt: skip
    token = tmp_path / "status-token"
    token.write_text(TOKEN)
    ok = subprocess.run([*base, "--token-file", str(token)], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # Without the token the health service still answers, but Stats is refused: not healthy.
    no_token = subprocess.run(base, capture_output=True, text=True, timeout=30)
    assert no_token.returncode == 2 and "UNAUTHENTICATED" in no_token.stdout


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--listen", "127.0.0.1:0"], "--listen needs --tls-cert and --tls-key"),
        (["--listen", "127.0.0.1:0", "--tls-cert", "c", "--tls-key", "k"], "TCP clients must authenticate"),
        (["--token-file", "t"], "only apply to the TCP listener"),
        (["--listen", "127.0.0.1:0", "--tls-cert", "/nope.pem", "--tls-key", "/nope.key", "--token-file", "/t"],
         "no such file: /nope.pem"),
    ],
)  # fmt: skip
def test_tcp_never_runs_open(tmp_path, flags, reason):
    # A free metrics port: a daemon of the machine's own may hold the default one (9469).
    serve = ["serve", "--socket", str(tmp_path / "s.sock"), "--metrics-address", "127.0.0.1:0", *flags]
    out = subprocess.run([sys.executable, "-m", "kvsidecar", *serve], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert reason in out.stderr


def test_socket_mode_and_group(mooncake_master, tmp_path):
    group_name = grp.getgrgid(os.getgid()).gr_name
    d = DaemonProcess(
        tmp_path,
        allow_shm_names=True,
        master=mooncake_master.address,
        extra=("--socket-mode", "0600", "--socket-group", group_name),
    ).start()
    try:
        st = os.stat(d.socket)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_gid == os.getgid()
    finally:
        assert d.stop() == 0


def test_tenants_never_see_each_others_blocks(mooncake_master, tmp_path):
    d = DaemonProcess(tmp_path, allow_shm_names=True, master=mooncake_master.address).start()
    hashes = [bytes([7]) * 32, bytes([8]) * 32]
    a = RawRank(d.target, open_request([group("full_attention", 16)], model="org/M", prefix="tenant-a"), 4, 512)
    b = RawRank(d.target, open_request([group("full_attention", 16)], model="org/M", prefix="tenant-b"), 4, 512)
    try:
        a.register()
        b.register()
        a.fill_block(0, 0, b"A" * 512)
        a.fill_block(0, 1, b"A" * 512)
        assert a.save(hashes, [[0, 1]], 32).written == 2
        assert a.lookup(hashes, 33).hit_tokens == 32
        assert b.lookup(hashes, 33).hit_tokens == 0  # the same prompt, another tenant: a miss
        miss = b.load(hashes, [[2, 3]], pb.LookupResponse(hit_tokens=32, tail_boundaries=[32]))
        assert {f.reason for f in miss.failures} == {"not_found"}  # even a forged hit reads only its own keys
        assert b.block(0, 2) == bytes(512)
    finally:
        a.close()
        b.close()
        assert d.stop() == 0
