"""`kvsidecar status`: ask a running daemon for health, sessions, store health and counters."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsidecar.cli.retention import render as render_retention
from kvsidecar.rpc.servers import SERVICE_NAME
from kvsidecar_client import PermissionDenied, SidecarError, TcpAuth
from kvsidecar_client.probe import DaemonProbe
from kvsidecar_contract.paths import default_socket_path
from kvsidecar_contract.proto import sidecar_pb2

EXIT_HEALTHY, EXIT_STORE_DOWN, EXIT_UNREACHABLE = 0, 1, 2  # 1: the store is down, or the GPU path failed


def query(target: str, timeout: float, auth: TcpAuth | None = None) -> dict[str, Any]:
    """Health of the daemon and of its store, and its stats; raises grpc.RpcError or SidecarError when unreachable."""
    with DaemonProbe(target, auth) as probe:
        health = health_pb2_grpc.HealthStub(probe.channel)
        daemon = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        sidecar = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
        serving = health_pb2.HealthCheckResponse.SERVING
        try:
            # Over the Unix socket, the probe proves our uid: a tenant sees its own sessions.
            stats = probe.stats(timeout)
        except PermissionDenied as exc:
            if exc.code is not grpc.StatusCode.PERMISSION_DENIED:
                raise  # UNAUTHENTICATED: a TCP caller without its token learns nothing more
            # A caller that is no tenant's (a probe under another uid) still learns the daemon's health.
            stats = sidecar_pb2.StatsResponse(
                daemon_version="?",
                store_healthy=sidecar.status == serving,
                store_detail="from the health service",
                tenancy=f"multi-tenant (Stats refused: {exc.reason})",
            )
    return {
        "address": target,
        "serving": daemon.status == serving,
        "store_serving": sidecar.status == serving,
        **MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
    }


def render(info: dict[str, Any]) -> str:
    """A short human summary."""
    master = info["master_address"] or "-"
    detail = info["store_detail"]
    lines = [
        f"kvsidecar {info['daemon_version']} at {info['address']}: "
        + ("serving" if info["serving"] else "NOT serving")
        + f", up {info['uptime_seconds']:.0f}s",
        f"store: {'healthy' if info['store_healthy'] else 'UNHEALTHY'} ({detail})"
        + ("" if master in detail else f", master {master}"),
        f"tenancy: {info.get('tenancy') or 'single-tenant'}"
        + (f" (you: tenant {info['caller_tenant']})" if info.get("caller_tenant") else ""),
        f"gpu: {info.get('gpu') or 'off'}",
        f"sessions: {len(info['sessions'])}",
    ]
    for s in info["sessions"]:
        p = s["parallel"]
        lines.append(
            f"  {s['session_id_prefix']}  {s['role'].removeprefix('ROLE_').lower():9}  {s['model']}"
            f"  tp {p['tp_rank']}/{p['tp_size']} pp {p['pp_rank']}/{p['pp_size']}"
            f"  {int(s['mapped_bytes']) / 2**20:.1f} MiB"
            + (f"  {s['data_connections']} data conn" if s.get("data_connections") else "")
            + f"  {s['client_name']}"
            + (f"  tenant {s['tenant']}" if s.get("tenant") else "")
        )
    if info.get("retention"):
        lines.append(render_retention(info["retention"]))
    if info.get("listeners"):
        lines.append("listeners:")
        role = max(len(item["role"]) for item in info["listeners"])
        address = max(len(item["address"]) for item in info["listeners"])
        for item in info["listeners"]:
            drops = int(item["dropped_packets"])
            refused = f", refused {drops} {_plural(drops, 'packet')}" if drops else ""
            lines.append(f"  {item['role']:{role}}  {item['address']:{address}}  allowed: {item['allowed']}{refused}")
    if info["counters"]:
        lines.append("counters:")
        lines += [f"  {k} {v:g}" for k, v in sorted(info["counters"].items())]
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return word if n == 1 else f"{word}s"


def nobody_at(path: str, timeout: float) -> str:
    """Why no daemon can answer on the Unix socket at path ("" when something accepts connections there)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0  # connect says why
    if mode and not stat.S_ISSOCK(mode):
        return f"{_kind(mode)}, not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(path)
        except FileNotFoundError:
            return "no socket there"
        except ConnectionRefusedError:
            return "a socket file nobody listens on, left by a daemon that is gone"
        except PermissionError:
            return "permission denied: the socket's mode and group (--socket-mode, --socket-group) decide who connects"
        except OSError as exc:
            return exc.strerror or type(exc).__name__
    return ""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def unreachable(target: str, why: str) -> str:
    """One line: no daemon at target, why, and how to start one there."""
    if not target.startswith("unix://"):
        return f"kvsidecar status: no daemon answers at {target} ({why})"
    path = target.removeprefix("unix://")
    start = "kvsidecar serve" + ("" if path == default_socket_path() else f" --socket {path}")
    return f"kvsidecar status: no daemon at {path} ({why}); start one with: {start}"


def run(
    target: str, *, timeout: float, as_json: bool, quiet: bool, live_only: bool, auth: TcpAuth | None = None
) -> int:
    """Print the status; the exit code says whether the daemon (and, unless live_only, its store) is healthy."""
    # A socket nobody listens on answers at once; gRPC would retry it for seconds and then say so at length.
    why = nobody_at(target.removeprefix("unix://"), timeout) if target.startswith("unix://") else ""
    if not why:
        try:
            info = query(target, timeout, auth)
        except grpc.RpcError as exc:
            why = _failed(exc.code(), exc.details())
        except SidecarError as exc:
            why = _failed(exc.code or grpc.StatusCode.UNAVAILABLE, exc.reason)
    if why:
        if as_json and not quiet:
            # A script reads the same shape whether or not a daemon answered: `jq .serving` is false here.
            print(json.dumps({"address": target, "serving": False, "unreachable": why}, indent=2))
        elif not quiet:
            print(unreachable(target, why))
        return EXIT_UNREACHABLE
    if not quiet:
        print(json.dumps(info, indent=2) if as_json else render(info))
    return exit_code(info, live_only)


def exit_code(info: dict[str, Any], live_only: bool = False) -> int:
    """What `status` exits with for what the daemon said: its store down or its GPU path failed is 1."""
    if not info["serving"]:
        return EXIT_UNREACHABLE
    if live_only or (info["store_healthy"] and info["store_serving"] and not info.get("gpu_failure")):
        return EXIT_HEALTHY
    return EXIT_STORE_DOWN


def _failed(code: grpc.StatusCode, details: str | None) -> str:
    lines = (details or "").splitlines()
    return f"gRPC {code.name}: {lines[0][:160] if lines else ''}"


def command(args: argparse.Namespace) -> int:
    from kvsidecar_client import TcpAuth

    target = args.address or f"unix://{args.socket}"
    auth = None
    if args.address and (args.tls_ca or args.tls_cert or args.token_file):
        auth = TcpAuth.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.token_file)
    return run(target, timeout=args.timeout, as_json=args.json, quiet=args.quiet, live_only=args.live, auth=auth)


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvsidecar_contract.paths import default_socket_path

    p = sub.add_parser(
        "status",
        help="ask a running daemon how it is",
        description="Health, sessions, store health and counters of a running daemon. Exit 0: healthy; "
        "1: the daemon answers but its store does not, or its GPU path failed; 2: no daemon answers.",
    )
    p.add_argument("--socket", default=default_socket_path(), help="the daemon's Unix socket (default: %(default)s)")
    p.add_argument("--address", default="", help="the daemon's TCP listener instead of the socket, e.g. 10.0.0.5:50070")
    p.add_argument("--tls-ca", default="", help="with --address: PEM CA that signed the daemon's certificate")
    p.add_argument("--tls-cert", default="", help="with --address: PEM client certificate")
    p.add_argument("--tls-key", default="", help="with --address: PEM client key")
    p.add_argument("--token-file", default="", help="with --address: file holding the bearer token")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for answers (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--quiet", action="store_true", help="print nothing; only the exit code")
    p.add_argument("--live", action="store_true", help="healthy when the daemon answers, even if its store does not")
    p.set_defaults(func=command)
