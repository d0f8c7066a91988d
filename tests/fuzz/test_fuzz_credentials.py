"""Fuzzing rights: sessions opened with every prefix under every credential, against a daemon with a tenants file.

Credentials: a Unix peer with no ticket, a fresh ticket (this process's uid), a used and a forged ticket, and TLS
callers with either tenant's token, a wrong token or none (all presenting the client certificate, itself a tenant's
credential). The expected answer of each pair is written out here, not derived from the daemon's code: OK with the
right tenant in the reply, or PERMISSION_DENIED with a reason; Stats of each credential lists only its own tenant's
sessions; every refusal is counted per tenant; the daemon stays up.
"""

from __future__ import annotations

import os
import secrets
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.tenancy.table import hash_token
from kvsidecar_client import TcpAuth
from kvsidecar_client._side import side_socket_for
from kvsidecar_contract.paths import TICKET_METADATA
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc
from kvsidecar_testing.processes import DaemonProcess, free_port
from support.certs import make_pki
from support.fuzzwire import fuzz_settings
from support.rawrank import group, open_request

pytestmark = pytest.mark.integration

TOKEN_A, TOKEN_B = "fuzz-alpha-" + secrets.token_hex(4), "fuzz-beta-" + secrets.token_hex(4)
UID = os.getuid()
# tenant -> (prefix patterns, models or None for any); written out by hand: the oracle of this module.
RIGHTS = {
    "alpha": (["team-a", "team-a/*"], None),
    "beta": (["team-b"], ["beta-*"]),  # matched against the model's last path component (what keys carry)
    "local": (["local", "shared-*"], None),
    "certs": (["cert-only"], None),
}
PREFIXES = ["team-a", "team-a/x", "team-a/", "team-ab", "team-", "team-b", "team-b/x", "local", "shared-", "shared-1",
            "shared", "cert-only", "cert-onl", "", "ops", "TEAM-A"]  # fmt: skip
MODELS = ["org/beta-1", "org/alpha", "org/beta-", "beta-1", "other/beta-1", "beta-1/x", "org/beta-1/"]


@dataclass(frozen=True)
class Credential:
    name: str
    tenants: tuple[str, ...]  # the tenants it is a credential of
    transport: str  # unix | tcp
    token: str | None = None
    ticket: str = "none"  # unix: none | fresh | used | forged


CREDENTIALS = [
    Credential("unix without ticket", (), "unix"),
    Credential("unix fresh ticket", ("local",), "unix", ticket="fresh"),
    Credential("unix used ticket", (), "unix", ticket="used"),
    Credential("unix forged ticket", (), "unix", ticket="forged"),
    Credential("tls token alpha", ("alpha", "certs"), "tcp", TOKEN_A),
    Credential("tls token beta", ("beta", "certs"), "tcp", TOKEN_B),
    Credential("tls wrong token", ("certs",), "tcp", "wrong"),
    Credential("tls no token", ("certs",), "tcp"),
]


def expected(cred: Credential, prefix: str, model: str) -> str | None:
    """The tenant the daemon must put the session in, or None for PERMISSION_DENIED."""
    for tenant in cred.tenants:
        patterns, models = RIGHTS[tenant]
        prefix_ok = any(prefix == p or (p.endswith("*") and prefix.startswith(p[:-1])) for p in patterns)
        key = model.rstrip("/").split("/")[-1]  # what keys carry of the model
        model_ok = models is None or any(key == m or (m.endswith("*") and key.startswith(m[:-1])) for m in models)
        if prefix_ok and model_ok:
            return tenant
    return None


class Daemon:
    """A daemon with a tenants file on a Unix socket and a TLS listener requiring client certificates."""

    def __init__(self, workdir, pki, master: str) -> None:
        tenants = workdir / "tenants.toml"
        tenants.write_text(
            f'[tenants.alpha]\ntokens = ["{hash_token(TOKEN_A)}"]\nprefixes = ["team-a", "team-a/*"]\n\n'
            f'[tenants.beta]\ntokens = ["{hash_token(TOKEN_B)}"]\nprefixes = ["team-b"]\nmodels = ["beta-*"]\n\n'
            f'[tenants.local]\nuids = [{UID}]\nprefixes = ["local", "shared-*"]\n\n'
            f'[tenants.certs]\ncert_subjects = ["CN=client"]\nprefixes = ["cert-only"]\n'
        )
        port = free_port()
        # No segment of its own: this daemon shares the fuzz master, and a segment that goes away with it at the end
        # of the module would take with it whatever the master had placed there for the other fuzz daemon's clients.
        self.proc = DaemonProcess(
            workdir, master=master, segment_size="0",
            extra=("--tenants", str(tenants), "--listen", f"127.0.0.1:{port}", "--tls-cert", str(pki.server_cert),
                   "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)),
        ).start()  # fmt: skip
        self.unix = grpc.insecure_channel(self.proc.target)
        auth = {
            c.name: TcpAuth(pki.ca.read_bytes(), pki.client_cert.read_bytes(), pki.client_key.read_bytes(), c.token)
            for c in CREDENTIALS
            if c.transport == "tcp"
        }
        self.tcp = {name: grpc.secure_channel(f"127.0.0.1:{port}", a.credentials()) for name, a in auth.items()}
        side = side_socket_for(self.proc.target)
        assert side is not None
        self.side = side
        self.opened: dict[str, list[str]] = {}  # credential -> session ids it opened

    def call(self, cred: Credential, method: str, request):
        channel = self.unix if cred.transport == "unix" else self.tcp[cred.name]
        metadata = ()
        if cred.ticket == "fresh":
            metadata = ((TICKET_METADATA, self.side.ticket(5)),)
        elif cred.ticket == "used":
            used = self.side.ticket(5)
            pb_grpc.SidecarStub(self.unix).Stats(pb.StatsRequest(), metadata=((TICKET_METADATA, used),), timeout=10)
            metadata = ((TICKET_METADATA, used),)
        elif cred.ticket == "forged":
            metadata = ((TICKET_METADATA, secrets.token_urlsafe(24)),)
        return getattr(pb_grpc.SidecarStub(channel), method)(request, metadata=metadata or None, timeout=10)

    def open(self, cred: Credential, prefix: str, model: str) -> None:
        want = expected(cred, prefix, model)
        request = open_request([group("full_attention", 16)], model=model, prefix=prefix, role=pb.ROLE_SCHEDULER)
        what = f"{cred.name} opening {prefix!r} for {model!r}"
        try:
            reply = self.call(cred, "OpenSession", request)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details():
                return  # the request's own fault (checked before rights, so it tells nothing about them)
            assert want is None, f"{what}: refused ({err.code().name}: {err.details()}), tenant {want} grants it"
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, f"{what}: {err.code().name}: {err.details()}"
            assert "no tenant's credential" in err.details() or "may not open sessions" in err.details(), what
            return
        assert want is not None, f"{what}: opened as tenant {reply.tenant!r}, no tenant grants it"
        assert reply.tenant == want, f"{what}: tenant {reply.tenant!r}, expected {want!r}"
        pb_grpc.SidecarStub(self.unix).CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=10)

    def refused(self, tenant: str) -> float:
        body = urllib.request.urlopen(self.proc.metrics_url, timeout=10).read().decode()
        return sum(
            s.value
            for f in text_string_to_metric_families(body)
            for s in f.samples
            if s.name == "kvsidecar_tenant_refused_total" and s.labels == {"tenant": tenant, "reason": "permission"}
        )

    def close(self) -> int:
        self.unix.close()
        for c in self.tcp.values():
            c.close()
        return self.proc.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, fuzz_master) -> Iterator[Daemon]:
    pki = make_pki(tmp_path_factory.mktemp("fuzz-pki"))
    d = Daemon(tmp_path_factory.mktemp("fuzz-tenants"), pki, fuzz_master.address)
    try:
        yield d
    finally:
        alive = d.proc.proc is not None and d.proc.proc.poll() is None
        code = d.close()
    assert alive and code == 0, d.proc.log()[-4000:]


def test_every_prefix_under_every_credential(daemon):
    refused_before = daemon.refused("none")
    refused = 0
    for cred in CREDENTIALS:
        for prefix in PREFIXES:
            for model in MODELS:
                daemon.open(cred, prefix, model)
                refused += expected(cred, prefix, model) is None and not cred.tenants
    # Refusals of callers that are nobody's are counted under "none", each once.
    assert daemon.refused("none") - refused_before == refused


@given(
    cred=st.sampled_from(CREDENTIALS),
    prefix=st.one_of(
        st.sampled_from(PREFIXES),
        st.builds(lambda p, s: p + s, st.sampled_from(PREFIXES), st.text("ab/-*x", max_size=4)),
        st.text(st.characters(codec="utf-8", exclude_characters="@\x00"), max_size=12),
    ),
    model=st.one_of(
        st.sampled_from(MODELS), st.builds(lambda s: "org/" + s, st.text("beta-1", min_size=1, max_size=8))
    ),
)
@fuzz_settings(150)
def test_random_prefixes_and_models_under_every_credential(daemon, cred, prefix, model):
    daemon.open(cred, prefix, model)


def test_stats_show_each_credential_its_own_tenants_sessions(daemon):
    held = []
    for cred, prefix, model in (
        (CREDENTIALS[1], "local", "m"),
        (CREDENTIALS[4], "team-a", "m"),
        (CREDENTIALS[5], "team-b", "org/beta-1"),
    ):
        request = open_request([group("full_attention", 16)], model=model, prefix=prefix, role=pb.ROLE_SCHEDULER)
        held.append(daemon.call(cred, "OpenSession", request).session_id)
    try:
        for cred in CREDENTIALS:
            try:
                stats = daemon.call(cred, "Stats", pb.StatsRequest())
            except grpc.RpcError as err:
                assert not cred.tenants and err.code() == grpc.StatusCode.PERMISSION_DENIED, cred.name
                continue
            assert cred.tenants, f"{cred.name} is nobody's credential, yet Stats answered"
            seen = {s.tenant for s in stats.sessions}
            assert seen <= set(cred.tenants), f"{cred.name} sees {seen}"
            assert set(stats.caller_tenant.split(",")) == set(cred.tenants)
    finally:
        for sid in held:
            pb_grpc.SidecarStub(daemon.unix).CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
