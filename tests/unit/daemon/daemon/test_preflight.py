"""What a start checks before it starts anything: each refusal with its reason, and a wide socket mode warned."""

from __future__ import annotations

import logging
import socket

import pytest

from kvsidecar.config import Config, settings_of
from kvsidecar.daemon.preflight import preflight
from kvsidecar.errors import ConfigError, DaemonError


def check(tmp_path, **settings) -> int | None:
    return preflight(settings_of(Config(socket=str(tmp_path / "k.sock"), **settings)))


def test_everything_that_can_be_checked_first_is(tmp_path):
    with pytest.raises(DaemonError, match="cannot give the sockets to group 'no-such-group-here': no such group"):
        check(tmp_path, socket_group="no-such-group-here")
    tls = {"listen": "127.0.0.1:0", "tls_cert": str(tmp_path / "c.pem"), "tls_key": str(tmp_path / "k.pem")}
    with pytest.raises(ConfigError, match=f"no such file: {tmp_path}/c.pem"):
        check(tmp_path, token_file=str(tmp_path / "t"), **tls)
    (tmp_path / "c.pem").write_text("not a certificate")
    (tmp_path / "k.pem").write_text("")
    (tmp_path / "t").write_text("")
    with pytest.raises(ConfigError, match=r"token file .* is empty"):
        check(tmp_path, token_file=str(tmp_path / "t"), **tls)
    with pytest.raises(DaemonError, match=r"--kv-events-endpoint ipc:///nowhere/at/all/ev: its directory /nowhere/at"):
        check(tmp_path, kv_events_endpoint="ipc:///nowhere/at/all/ev")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(DaemonError, match=f"--kv-events-endpoint {endpoint}: cannot bind it: Address already in"):
            check(tmp_path, kv_events_endpoint=endpoint)
    assert check(tmp_path, kv_events_endpoint=f"ipc://{tmp_path}/ev") is None


def test_a_socket_mode_wider_than_0660_is_warned(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvsidecar"):
        check(tmp_path, socket_mode=0o660)
        check(tmp_path, socket_mode=0o600)
        assert not caplog.records
        check(tmp_path, socket_mode=0o666)
    (record,) = caplog.records
    assert record.getMessage().startswith(
        f"--socket-mode 0666 is wider than 0660: every local account of this node may connect to {tmp_path}/k.sock"
    )
