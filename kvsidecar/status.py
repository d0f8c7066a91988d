"""`kvsidecar status`: ask a running daemon for health, sessions, store health and counters."""

from __future__ import annotations

import json
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsidecar.server import SERVICE_NAME
from kvsidecar_client import TcpAuth
from kvsidecar_client._channel import make_channel
from kvsidecar_contract.proto import sidecar_pb2, sidecar_pb2_grpc

EXIT_HEALTHY, EXIT_STORE_DOWN, EXIT_UNREACHABLE = 0, 1, 2


def query(target: str, timeout: float, auth: TcpAuth | None = None) -> dict[str, Any]:
    """Health of the daemon and of its store, and its stats; raises grpc.RpcError when unreachable."""
    with make_channel(target, auth=auth) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        daemon = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        sidecar = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
        stats = sidecar_pb2_grpc.SidecarStub(channel).Stats(sidecar_pb2.StatsRequest(), timeout=timeout)
    serving = health_pb2.HealthCheckResponse.SERVING
    return {
        "address": target,
        "serving": daemon.status == serving,
        "store_serving": sidecar.status == serving,
        **MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
    }


def render(info: dict[str, Any]) -> str:
    """A short human summary."""
    lines = [
        f"kvsidecar {info['daemon_version']} at {info['address']}: "
        + ("serving" if info["serving"] else "NOT serving")
        + f", up {info['uptime_seconds']:.0f}s",
        f"store: {'healthy' if info['store_healthy'] else 'UNHEALTHY'} ({info['store_detail']}), "
        f"master {info['master_address'] or '-'}",
        f"sessions: {len(info['sessions'])}",
    ]
    for s in info["sessions"]:
        p = s["parallel"]
        lines.append(
            f"  {s['session_id_prefix']}  {s['role'].removeprefix('ROLE_').lower():9}  {s['model']}"
            f"  tp {p['tp_rank']}/{p['tp_size']} pp {p['pp_rank']}/{p['pp_size']}"
            f"  {int(s['mapped_bytes']) / 2**20:.1f} MiB  {s['client_name']}"
        )
    if info.get("listeners"):
        lines.append("listeners:")
        for item in info["listeners"]:
            drops = int(item["dropped_packets"])
            refused = f", refused {drops} packets" if drops else ""
            lines.append(f"  {item['role']:18} {item['address']:28} allowed: {item['allowed']}{refused}")
    if info["counters"]:
        lines.append("counters:")
        lines += [f"  {k} {v:g}" for k, v in sorted(info["counters"].items())]
    return "\n".join(lines)


def run(
    target: str, *, timeout: float, as_json: bool, quiet: bool, live_only: bool, auth: TcpAuth | None = None
) -> int:
    """Print the status; the exit code says whether the daemon (and, unless live_only, its store) is healthy."""
    try:
        info = query(target, timeout, auth)
    except grpc.RpcError as exc:
        if not quiet:
            print(f"kvsidecar status: no daemon answers at {target}: {exc.code().name}: {exc.details()}")
        return EXIT_UNREACHABLE
    if not quiet:
        print(json.dumps(info, indent=2) if as_json else render(info))
    if not info["serving"]:
        return EXIT_UNREACHABLE
    if live_only or (info["store_healthy"] and info["store_serving"]):
        return EXIT_HEALTHY
    return EXIT_STORE_DOWN
