"""`kvsidecar retention`: what each tenant keeps ahead of ordinary cache, and an operator's drop (docs/retention.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any

EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE = 0, 1, 2


def render(usage: list[dict[str, Any]]) -> str:
    """One line per tenant: retained of budget, values, hard pins."""
    if not usage:
        return "retention: nothing this caller may see"
    lines = ["retention:"]
    for u in usage:
        name = u["tenant"] or "(single tenant)"
        lines.append(
            f"  {name}: {_mib(u['retained_bytes'])} of {_mib(u['budget_bytes'])} retained, "
            f"{u['values']} value{'' if int(u['values']) == 1 else 's'}, {_mib(u['hard_pinned_bytes'])} hard-pinned"
        )
    return "\n".join(lines)


def _mib(n: Any) -> str:
    return f"{int(n) / 2**20:.1f} MiB"


def run(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from kvsidecar_client import DaemonProbe, PermissionDenied, SidecarError

    target = f"unix://{args.socket}"
    with DaemonProbe(target) as probe:
        try:
            if args.drop is not None:
                dropped = probe.drop_retention(args.drop, args.timeout)
                gone = f"; {dropped.failed} were gone meanwhile and no longer count" if dropped.failed else ""
                print(
                    f"dropped the retention of {dropped.values} values ({_mib(dropped.bytes)}) of tenant "
                    f"{args.drop or '(single tenant)'}: ordinary cache again{gone}"
                )
            stats = probe.stats(args.timeout)
        except PermissionDenied as exc:
            print(f"kvsidecar retention: refused: {exc.reason}")
            return EXIT_REFUSED
        except SidecarError as exc:
            print(f"kvsidecar retention: no daemon answers at {target}: {exc.reason}")
            return EXIT_UNREACHABLE
    usage = [
        MessageToDict(u, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for u in stats.retention
    ]
    print(json.dumps(usage, indent=2) if args.json else render(usage))
    return EXIT_OK


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvsidecar_contract.paths import default_socket_path

    p = sub.add_parser(
        "retention",
        help="what each tenant keeps ahead of ordinary cache; --drop TENANT for operators",
        description="Each tenant's retained bytes against its retention budget, and its operators' hard pins "
        "(docs/retention.md). With --drop, an operator credential makes every value the tenant retains ordinary "
        "cache again, bytes kept. Exit 0: done; 1: refused; 2: no daemon answers.",
    )
    p.add_argument("--socket", default=default_socket_path(), help="the daemon's Unix socket (default: %(default)s)")
    p.add_argument(
        "--drop",
        nargs="?",
        const="",
        default=None,
        metavar="TENANT",
        help="make the tenant's retained values ordinary cache (no name: a daemon without a tenants file)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon (default 30)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
