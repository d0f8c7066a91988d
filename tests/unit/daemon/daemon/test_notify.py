"""sd_notify against a real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Iterator

import pytest

from kvsidecar.daemon import notify


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


@pytest.fixture
def path_socket(tmp_path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    path = str(tmp_path / "notify.sock")
    with _listener(path) as sock:
        yield sock, {"NOTIFY_SOCKET": path}


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, dict[str, str]]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("abstract AF_UNIX sockets exist only on Linux")
    name = f"kvsidecar-test-{os.getpid()}-{uuid.uuid4().hex}"
    with _listener("\0" + name) as sock:
        yield sock, {"NOTIFY_SOCKET": "@" + name}


def test_notify_sends_the_state_verbatim_to_a_path_socket(path_socket):
    sock, env = path_socket
    assert notify.notify("READY=1\nSTATUS=up", env=env) is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=up"


def test_notify_reaches_an_abstract_socket_named_with_at(abstract_socket):
    sock, env = abstract_socket
    assert notify.notify("WATCHDOG=1", env=env) is True
    assert sock.recv(4096) == b"WATCHDOG=1"


@pytest.mark.parametrize("kind", ["path_socket", "abstract_socket"])
def test_helpers_send_exact_datagrams(kind, request):
    sock, env = request.getfixturevalue(kind)
    assert notify.ready(env=env)
    assert sock.recv(4096) == b"READY=1"
    assert notify.ready("serving on /run/kvsidecar/kvsidecar.sock", env=env)
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving on /run/kvsidecar/kvsidecar.sock"
    assert notify.status("master at 10.0.0.5:50051 unreachable", env=env)
    assert sock.recv(4096) == b"STATUS=master at 10.0.0.5:50051 unreachable"
    assert notify.stopping(env=env)
    assert sock.recv(4096) == b"STOPPING=1"


def test_status_text_cannot_smuggle_another_assignment(path_socket):
    sock, env = path_socket
    assert notify.status("draining\nREADY=1", env=env)
    assert sock.recv(4096) == b"STATUS=draining READY=1"


def test_utf8_status_is_sent_as_utf8(path_socket):
    sock, env = path_socket
    assert notify.status("hit ratio ≥ 90%", env=env)
    assert sock.recv(4096) == "STATUS=hit ratio ≥ 90%".encode()


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "relative/notify.sock"}])
def test_no_usable_notify_socket_returns_false(env):
    assert notify.notify("READY=1", env=env) is False
    assert notify.ready("x", env=env) is False
    assert notify.stopping(env=env) is False


def test_missing_socket_path_returns_false_without_raising(tmp_path):
    env = {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens-here.sock")}
    assert notify.notify("READY=1", env=env) is False


def test_unbound_abstract_socket_returns_false():
    env = {"NOTIFY_SOCKET": f"@kvsidecar-test-unbound-{uuid.uuid4().hex}"}
    assert notify.stopping(env=env) is False


def test_a_path_that_is_not_a_socket_returns_false(tmp_path):
    plain = tmp_path / "plain-file"
    plain.write_text("")
    assert notify.notify("READY=1", env={"NOTIFY_SOCKET": str(plain)}) is False


def test_empty_state_is_rejected(path_socket):
    _, env = path_socket
    with pytest.raises(ValueError, match="empty"):
        notify.notify("", env=env)


def test_default_environment_is_read_at_call_time(path_socket, monkeypatch):
    sock, env = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", env["NOTIFY_SOCKET"])
    assert notify.ready()
    assert sock.recv(4096) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify.ready() is False
