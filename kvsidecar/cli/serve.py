"""`kvsidecar serve`: run the daemon with the configuration its flags and config file give."""

from __future__ import annotations

import argparse
import sys

from kvsidecar.errors import ConfigError, DaemonError, StoreError


def run(args: argparse.Namespace) -> int:
    import faulthandler
    import logging

    import uvloop

    from kvsidecar.config import from_args, settings_of
    from kvsidecar.daemon.process import serve

    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"kvsidecar serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # A crash inside native code (Mooncake) leaves every thread's Python stack in the log, not silence.
    faulthandler.enable()
    try:
        uvloop.run(serve(settings_of(config)))
    except (DaemonError, StoreError, ConfigError, OSError) as exc:
        logging.getLogger("kvsidecar").error("cannot start: %s", exc)
        return 1
    return 0


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvsidecar.config import add_flags

    p = sub.add_parser(
        "serve",
        help="run the daemon",
        usage="%(prog)s [--config FILE] [OPTION ...]",
        description="Run the node daemon. With no flags it starts an embedded Mooncake master on loopback, "
        "contributes a 1 GiB segment over TCP with P2PHANDSHAKE metadata, listens on a Unix socket and serves "
        "Prometheus metrics on loopback. Flags override the --config file, which overrides the defaults.",
    )
    add_flags(p)
    p.set_defaults(func=run)
