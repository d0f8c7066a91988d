"""Tenants over the TCP listener: bearer tokens (stored hashed) and client-certificate subjects name the tenant."""

from __future__ import annotations

import pytest
import torch

from kvsidecar.tenancy.table import hash_token
from kvsidecar_client import (
    EngineLayout,
    GroupSpec,
    InvalidRequest,
    PermissionDenied,
    SidecarClient,
    TcpAuth,
    shared_tensor,
)
from kvsidecar_testing.processes import DaemonProcess, free_port
from support.certs import _leaf, make_pki

pytestmark = pytest.mark.integration

TOKEN_A, TOKEN_B = "alpha-token-for-tests", "beta-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    pki = make_pki(d)
    _leaf(d, "ca", "engine-c", "extendedKeyUsage=clientAuth\n")  # CN=engine-c: tenant gamma's certificate
    return pki


def tls_daemon(tmp_path, master, pki, *, client_ca: bool) -> DaemonProcess:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[tenants.alpha]\ntokens = ["{hash_token(TOKEN_A)}"]\nprefixes = ["team-a"]\n\n'
        f'[tenants.beta]\ntokens = ["{hash_token(TOKEN_B)}"]\nprefixes = ["team-b"]\nshm_names = true\n\n'
        f'[tenants.gamma]\ncert_subjects = ["CN=engine-c"]\nprefixes = ["team-c"]\n'
    )
    port = free_port()
    ca = ("--tls-client-ca", str(pki.ca)) if client_ca else ()
    d = DaemonProcess(
        tmp_path, master=master,
        extra=("--listen", f"127.0.0.1:{port}", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
               *ca, "--tenants", str(tenants)),
    ).start()  # fmt: skip
    d.tcp = f"127.0.0.1:{port}"
    return d


def connect(d, auth, prefix, role="rank"):
    return SidecarClient.connect(d.tcp, model="org/m", layout=EngineLayout(), num_kv_heads=1, hash_block_size=16,
                                 groups=[GroupSpec("full_attention", 16)], cache_prefix=prefix, role=role,
                                 auth=auth)  # fmt: skip


def test_two_tokens_and_a_certificate_are_three_tenants(tmp_path, mooncake_master, pki):
    d = tls_daemon(tmp_path, mooncake_master.address, pki, client_ca=True)
    ca, cert, key = pki.ca.read_bytes(), pki.client_cert.read_bytes(), pki.client_key.read_bytes()
    c_cert = pki.ca.with_name("engine-c.pem").read_bytes()
    c_key = pki.ca.with_name("engine-c.key").read_bytes()
    clients = []
    try:
        a = connect(d, TcpAuth(ca, cert, key, TOKEN_A), "team-a")
        clients.append(a)
        assert a.session_info.tenant == "alpha"
        with pytest.raises(PermissionDenied, match="tenant alpha may not open sessions under cache prefix 'team-b'"):
            connect(d, TcpAuth(ca, cert, key, TOKEN_A), "team-b")
        b = connect(d, TcpAuth(ca, cert, key, TOKEN_B), "team-b")
        clients.append(b)
        assert b.session_info.tenant == "beta"
        for token in (None, "wrong", TOKEN_A + "x"):
            with pytest.raises(PermissionDenied, match="is no tenant's credential"):
                connect(d, TcpAuth(ca, cert, key, token), "team-a")
        c = connect(d, TcpAuth(ca, c_cert, c_key, None), "team-c", role="scheduler")
        clients.append(c)
        assert c.session_info.tenant == "gamma"
        with pytest.raises(PermissionDenied, match="tenant gamma may not"):
            connect(d, TcpAuth(ca, c_cert, c_key, None), "team-a")

        # Stats: each tenant sees its own sessions only.
        assert {s.cache_prefix for s in a.stats().sessions} == {"team-a"}
        assert {s.cache_prefix for s in c.stats().sessions} == {"team-c"}
        assert a.stats().caller_tenant == "alpha"

        # Over TCP no fd can be passed: sealed tensors are refused by the client, named ones by untrusted tenants.
        with pytest.raises(InvalidRequest, match="named=True"):
            a.register([shared_tensor((4, 16, 8), torch.float32)], [(0,)])
        a2 = connect(d, TcpAuth(ca, cert, key, TOKEN_A), "team-a")
        clients.append(a2)
        with pytest.raises(PermissionDenied, match="/dev/shm names are for trusted ranks only"):
            a2.register([shared_tensor((4, 16, 8), torch.float32, named=True)], [(0,)])
        assert b.register([shared_tensor((4, 16, 8), torch.float32, named=True)], [(0,)]).mapped_bytes > 0
    finally:
        for client in clients:
            client.close()
        assert d.stop() == 0, d.log()


def test_without_client_certificates_the_tenants_tokens_guard_the_listener(tmp_path, mooncake_master, pki):
    d = tls_daemon(tmp_path, mooncake_master.address, pki, client_ca=False)
    ca = pki.ca.read_bytes()
    try:
        a = connect(d, TcpAuth(ca, None, None, TOKEN_A), "team-a", role="scheduler")
        try:
            assert a.session_info.tenant == "alpha"
        finally:
            a.close()
        with pytest.raises(PermissionDenied, match="bearer token"):
            connect(d, TcpAuth(ca, None, None, "wrong"), "team-a", role="scheduler")  # UNAUTHENTICATED
    finally:
        assert d.stop() == 0, d.log()
