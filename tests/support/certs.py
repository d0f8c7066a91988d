"""A throwaway certificate authority made with the openssl command, for TLS tests."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    """Paths of a CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA nobody trusts
    other_client_cert: Path
    other_client_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
         "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)  # fmt: skip


def _leaf(d: Path, ca: str, name: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
         "-out", f"{name}.csr", cwd=d)  # fmt: skip
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
         "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)  # fmt: skip


def make_pki(d: Path) -> Pki:
    """Create the CAs and certificates in d."""
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "ca", "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "ca", "client", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "other-ca", "intruder", "extendedKeyUsage=clientAuth\n")
    return Pki(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
        d / "other-ca.pem", d / "intruder.pem", d / "intruder.key",
    )  # fmt: skip
