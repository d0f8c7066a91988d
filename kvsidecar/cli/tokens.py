"""`kvsidecar hash-token`: the tenants-file form of a bearer token."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from kvsidecar.tenancy.table import hash_token

    token = sys.stdin.readline().strip()
    if not token:
        print("kvsidecar hash-token: error: no token on stdin", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "hash-token",
        help="print the tenants-file form of a bearer token read from stdin",
        description="Read a bearer token from stdin (one line) and print `sha256:<hex>`, the form a tenants file "
        "stores it in: the daemon keeps only hashes and compares them in constant time.",
    )
    p.set_defaults(func=run)
