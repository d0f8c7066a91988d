"""Configuration: flags over the file over the defaults, and precise errors."""

import argparse

import pytest

from kvsidecar.config import Config, add_flags, from_args
from kvsidecar.errors import ConfigError
from kvsidecar.parsing import parse_size
from kvsidecar_contract.paths import default_socket_path


def parse(*argv: str) -> Config:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return from_args(parser.parse_args(argv))


def test_defaults_run_on_a_laptop():
    cfg = parse()
    assert cfg.master == "" and cfg.metadata_server == "P2PHANDSHAKE" and cfg.protocol == "tcp"
    assert cfg.segment_size == 1 << 30
    assert cfg.metrics_address.startswith("127.0.0.1:")
    assert cfg.listen == ""
    assert cfg.socket == default_socket_path()


def test_default_socket_path():
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"}) == "/run/user/7/kvsidecar/kvsidecar.sock"
    assert default_socket_path({}).startswith("/tmp/kvsidecar-")


def test_file_then_flags(tmp_path):
    f = tmp_path / "kvsidecar.toml"
    f.write_text(
        'segment-size = "2GiB"\nmaster = "10.0.0.1:50051"\nsocket_mode = "0600"\nworkers = 3\n'
        'peer-network = ["10.0.0.0/16", "fd00::/8"]\n'
    )
    cfg = parse("--config", str(f), "--workers", "5")
    assert (cfg.segment_size, cfg.master, cfg.socket_mode, cfg.workers) == (2 << 30, "10.0.0.1:50051", 0o600, 5)
    assert cfg.peer_network == ("10.0.0.0/16", "fd00::/8")
    # flags replace the file's list
    assert parse("--config", str(f), "--peer-network", "10.9.0.0/16").peer_network == ("10.9.0.0/16",)


@pytest.mark.parametrize(
    ("text", "value"), [("1GiB", 1 << 30), ("512MiB", 512 << 20), ("64M", 64 << 20), ("4096", 4096), ("1.5g", 3 << 29)]
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("nonsense = 1\n", "unknown key 'nonsense'"),
        ("segment-size = 'lots'\n", "not a size"),
        ("workers = 'many'\n", "bad value for 'workers': not a whole number: 'many'"),
        ("x = [\n", "not valid TOML"),
    ],
)
def test_bad_files(tmp_path, content, reason):
    f = tmp_path / "c.toml"
    f.write_text(content)
    with pytest.raises(ConfigError, match=reason):
        parse("--config", str(f))


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("--protocol", "udp"), "protocol must be tcp or rdma"),
        (("--segment-size", "1MiB"), "segment-size must be 0 or >= 16MiB"),
        (("--master", "nohost"), "not a host:port"),
        (("--session-ttl", "0"), "session-ttl must be > 0"),
        (("--replicas", "0"), "replicas must be >= 1"),
        (("--gpu", "on"), "gpu must be auto, off or cpu, got 'on'"),
        (("--gpu-staging-size", "1MiB"), "gpu-staging-size must be at least 16MiB"),
        (("--gpu-bounce-size", "8MiB"), "gpu-bounce-size must be at least 16MiB"),
        (("--log-level", "verbose"), "log-level must be debug, info, warning or error, got 'verbose'"),
        (("--log-level", "10"), "log-level must be debug, info, warning or error, got '10'"),
        (("--socket", "k.sock"), "socket must be an absolute path, got 'k.sock'"),
        (("--socket", "/tmp/" + "x" * 93 + ".sock"), r"too long: a Unix socket path holds at most 107 bytes"),
        (("--master-timeout", "0"), "master-timeout must be > 0 seconds"),
        # A daemon whose store holds nothing would say healthy and fail every save.
        (("--segment-size", "0"), "segment-size 0 with the embedded master stores nothing"),
    ],
)
def test_bad_flags(argv, reason):
    with pytest.raises(ConfigError, match=reason):
        parse(*argv)


def test_what_is_refused_alone_is_fine_where_it_can_do_something():
    assert parse("--socket", "/tmp/" + "x" * 92 + ".sock").socket.endswith(".sock")  # its data socket: 107 bytes
    assert parse("--segment-size", "0", "--master", "127.0.0.1:50051").segment_size == 0
    assert parse("--log-level", "WARNING").log_level == "WARNING"
    assert parse("--ssd-dir", "/nvme/kv", "--ssd-size", "1GiB").ssd_size == 1 << 30


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        parse("--config", str(tmp_path / "absent.toml"))


def test_a_cluster_master_needs_peer_networks():
    with pytest.raises(ConfigError, match="--peer-network CIDR"):
        parse("--master", "10.0.0.1:50051")
    cfg = parse("--master", "10.0.0.1:50051", "--peer-network", "10.0.0.0/16", "--peer-network", "fd00:1::/32")
    assert cfg.peer_network == ("10.0.0.0/16", "fd00:1::/32")
    # a master on loopback has only this host's processes as peers, and loopback is always allowed
    assert parse("--master", "127.0.0.1:50051").peer_network == ()
    assert parse("--master", "localhost:50051").peer_network == ()


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("--peer-network", "10.0.0.0/16"), "only applies with --master"),
        (("--master", "10.0.0.1:1", "--peer-network", "10.0.0.0/33"), "peer-network: not a network: '10.0.0.0/33'"),
        (("--master", "10.0.0.1:1", "--peer-network", "nonsense"), "not a network"),
    ],
)
def test_bad_peer_networks(argv, reason):
    with pytest.raises(ConfigError, match=reason):
        parse(*argv)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("--kv-events-endpoint", "tcp://0.0.0.0:5557"), "not a loopback address.*--kv-events-remote"),
        (("--kv-events-endpoint", "tcp://*:5557"), "not a loopback address"),
        (("--kv-events-endpoint", "udp://127.0.0.1:5557"), "must be tcp://host:port or ipc://path"),
        (("--kv-events-endpoint", "tcp://127.0.0.1"), "not a tcp://host:port endpoint"),
        (("--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"), "set that too"),
        (
            ("--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-replay-endpoint", "tcp://10.0.0.1:5558"),
            "--kv-events-replay-endpoint tcp://10.0.0.1:5558 is not a loopback address",
        ),
    ],
)
def test_bad_kv_events_flags(argv, reason):
    with pytest.raises(ConfigError, match=reason):
        parse(*argv)


def test_kv_events_endpoints_off_loopback_only_when_asked():
    assert parse("--kv-events-endpoint", "ipc:///run/kvsidecar/events").kv_events_endpoint.startswith("ipc://")
    remote = parse("--kv-events-endpoint", "tcp://0.0.0.0:5557", "--kv-events-remote")
    assert remote.kv_events_remote and remote.kv_events_topic == "kvsidecar"
    with pytest.raises(SystemExit):  # a switch takes no value
        parse("--kv-events-remote", "maybe")
