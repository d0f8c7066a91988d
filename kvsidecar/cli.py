"""The `kvsidecar` command: `serve`, `status` and operator tools; each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from kvsidecar import __version__
from kvsidecar_contract.placement import PlacementError


def _layout(args: argparse.Namespace) -> int:
    from kvsidecar.layout_view import build_layout, describe, render_table

    try:
        layout = build_layout(
            tp=args.tp,
            kv_heads=args.kv_heads,
            groups=args.groups,
            dcp=args.dcp,
            pp=args.pp,
            pcp=args.pcp,
            model=args.model,
            cache_prefix=args.cache_prefix,
            value_identity=args.value_identity,
            block_size=args.block_size,
            hash_block_size=args.hash_block_size or args.block_size,
        )
        info = describe(layout)
    except PlacementError as exc:
        print(f"kvsidecar layout: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else render_table(info))
    return 0


def _add_layout(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "layout",
        help="show which rank writes which KV block under which key",
        description="Show the placement of a layout: replication factor, shard ids, quorum and keys per group.",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size T (default 1)")
    p.add_argument("--kv-heads", type=int, default=1, help="total KV heads H of ordinary attention (default 1)")
    p.add_argument(
        "--groups",
        default="full_attention",
        help="comma-separated group kinds: full_attention, sliding_window:W, mla, sliding_window_mla:W, mamba, "
        "uniform(a+b); append /N for a block size of N tokens (default full_attention)",
    )
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size D (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size P (default 1)")
    p.add_argument("--pcp", type=int, default=1, help="prefill-context-parallel size C (default 1)")
    p.add_argument("--model", default="model", help="model name; keys use its last path component")
    p.add_argument("--cache-prefix", default="", help="tenant/deployment namespace prepended to every key")
    p.add_argument(
        "--value-identity",
        default="",
        help="the engine's value identity (its connector logs it; docs/values.md), which keys carry as the value id",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per physical block (default 16)")
    p.add_argument("--hash-block-size", type=int, default=0, help="U, tokens per block hash (default: block size)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_layout)


def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvloop

    from kvsidecar.config import ConfigError, from_args
    from kvsidecar.server import DaemonError, serve
    from kvsidecar.store import StoreError

    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"kvsidecar serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        uvloop.run(serve(config))
    except (DaemonError, StoreError, ConfigError, OSError) as exc:
        logging.getLogger("kvsidecar").error("cannot start: %s", exc)
        return 1
    return 0


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvsidecar.config import add_flags

    p = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Run the node daemon. With no flags it starts an embedded Mooncake master on loopback, "
        "contributes a 1 GiB segment over TCP with P2PHANDSHAKE metadata, listens on a Unix socket and serves "
        "Prometheus metrics on loopback. Flags override the --config file, which overrides the defaults.",
    )
    add_flags(p)
    p.set_defaults(func=_serve)


def _status(args: argparse.Namespace) -> int:
    from kvsidecar.status import run
    from kvsidecar_client import TcpAuth

    target = args.address or f"unix://{args.socket}"
    auth = None
    if args.address and (args.tls_ca or args.tls_cert or args.token_file):
        auth = TcpAuth.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.token_file)
    return run(target, timeout=args.timeout, as_json=args.json, quiet=args.quiet, live_only=args.live, auth=auth)


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvsidecar_contract.paths import default_socket_path

    p = sub.add_parser(
        "status",
        help="ask a running daemon how it is",
        description="Health, sessions, store health and counters of a running daemon. Exit 0: healthy; "
        "1: the daemon answers but its store does not; 2: no daemon answers.",
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
    p.set_defaults(func=_status)


def _add_tool(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_: str, text: str) -> None:
    """A subcommand whose module `kvsidecar.<name>` has add_arguments(parser) and run(args) -> int."""
    module = importlib.import_module(f"kvsidecar.{name}")
    p = sub.add_parser(name, help=help_, description=text)
    module.add_arguments(p)
    p.set_defaults(func=module.run)


def _bench(argv: list[str]) -> int:
    import importlib.util

    if importlib.util.find_spec("kvsidecar_bench") is None:
        print("kvsidecar bench: the bench is not installed: pip install -e ./benchmarks", file=sys.stderr)
        return 2
    runner = importlib.import_module("kvsidecar_bench.runner")
    code: int = runner.main(argv)
    return code


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvsidecar bench ...` hands every argument to the kvsidecar-bench tool, imported only when it runs."""
    p = sub.add_parser(
        "bench",
        add_help=False,  # its --help is the bench's own
        help="measure the daemon's data path against in-process Mooncake, its real client and memcpy",
        description="Runs kvsidecar-bench (benchmarks/): --quick for a run under a minute, --help for its flags.",
    )
    # main() hands `kvsidecar bench ...` over before parsing; this entry only lists the command.
    p.set_defaults(func=lambda _: _bench([]))


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(prog="kvsidecar", description="Node-local KV-cache store daemon.")
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_status(sub)
    _add_layout(sub)
    _add_tool(
        sub,
        "demo",
        "save and load a prompt with simulated ranks, checking every byte",
        "Simulated ranks of a small hybrid model (MLA + sliding window + Mamba) save a prompt, clear their cache and "
        "load it back through the daemon at --socket (or one started for the demo if none answers there), checking "
        "every byte. Exit 0 only with zero mismatches and zero failed loads.",
    )
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
