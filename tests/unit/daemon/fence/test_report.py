"""What operators see: every listener with who may reach it, in /metrics, in Stats and in `kvsidecar status`."""

import socket

from kvsidecar.cli.status import render
from kvsidecar.config import Config
from kvsidecar.fence import guard
from kvsidecar.fence.daemon import DaemonFence
from kvsidecar.metrics import Metrics


def test_listeners_reach_metrics_stats_and_status(tmp_path):
    fence = DaemonFence(guard.Policy.nobody())
    held: list[socket.socket] = []

    def connect() -> str:
        s = socket.socket(socket.AF_INET6)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        s.listen()
        held.append(s)
        return "store"

    try:
        fence.open_store(connect, lambda store: None)
        port = held[0].getsockname()[1]
        # The metrics read the fence's drops through the source they were built with, as the daemon builds them.
        metrics = Metrics(listener_drops=fence.dropped)
        config = Config(socket=str(tmp_path / "k.sock"), socket_group="kv")
        fence.report(config, [f"unix://{config.socket}"], 9469, metrics)
        with socket.socket() as knock:  # one refused connection attempt
            knock.settimeout(0.3)
            assert knock.connect_ex(("127.0.0.1", port)) != 0

        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.registry.collect() for s in f.samples
        }
        info = {dict(k[1])["role"]: dict(k[1]) for k in samples if k[0] == "kvsidecar_listener_info"}
        assert info["mooncake-transfer"] == {
            "role": "mooncake-transfer",
            "address": f"[::]:{port}",
            "allowed": "nobody",
        }
        assert info["metrics"]["allowed"] == "local accounts (loopback)"
        assert "group kv" in info["grpc-unix"]["allowed"]
        drops = [v for k, v in samples.items() if k[0] == "kvsidecar_listener_dropped_packets_total"]
        assert drops and drops[0] >= 1

        report = fence.listeners_with_drops()  # what the servicer's Stats answers with
        assert [(item.role, drops) for item, drops in report][-1][0] == "mooncake-transfer"
        text = render(
            {
                "daemon_version": "x",
                "address": "unix://k",
                "serving": True,
                "uptime_seconds": 1.0,
                "store_healthy": True,
                "store_detail": "ok",
                "master_address": "m",
                "sessions": [],
                "counters": {},
                "listeners": [
                    {"role": i.role, "address": i.address, "allowed": i.allowed, "dropped_packets": str(d)}
                    for i, d in report
                ],
            }
        )
        assert f"mooncake-transfer  [::]:{port}" in text and "allowed: nobody, refused" in text
    finally:
        fence.release()
        for s in held:
            s.close()
