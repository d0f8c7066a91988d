"""The `kvsidecar` command line: one module per subcommand, each with `add(subparsers)`."""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvsidecar import __version__
from kvsidecar.cli import bench, demo, handover, layout, retention, serve, status, tokens

__all__ = ["EXIT_OUTPUT_CLOSED", "EXIT_USAGE", "build_parser", "main"]

EXIT_USAGE = 2
# What a shell reports for a tool its reader left (`seq 100000 | head`): killed by SIGPIPE, 128 + 13.
EXIT_OUTPUT_CLOSED = 141


class _Parser(argparse.ArgumentParser):
    """A usage error in one line: what is wrong and where the help is (serve's usage alone is 37 lines).

    No prefix matching: `--segment 2GiB` is an unknown flag, not --segment-size (a typo must not set something).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _Command(_Parser):
    """A subcommand's parser: an argument it does not know is its own error, not the top-level parser's."""

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on the namespace type
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = _Parser(prog="kvsidecar", description="Node-local KV-cache store daemon.")
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Command)
    for command in (serve, status, retention, layout, tokens, demo, bench):
        command.add(sub)
    return parser


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end is closed: poll reports an error on it."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), 0)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in handover.TOOLS:
        return handover.run(argv[0], argv[1:])
    args: Any = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's flush at exit
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # `kvsidecar layout ... | head`: the reader has what it wanted. Stop quietly, and keep the interpreter's own
        # flush at exit from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OUTPUT_CLOSED
    return code


if __name__ == "__main__":
    sys.exit(main())
