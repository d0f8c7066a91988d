"""One account's huge lookups against another account's small ones: the victim's lookup latency, side by side.

    flock /tmp/kvsidecar-heavy.lock .venv/bin/python benchmarks/lookup_fairness.py --seconds 20

Runs a real daemon (embedded master) per configuration (daemon flags, `;` between configurations); an attacker
process dropped to uid `nobody` runs two threads of 2^20-hash lookups in a loop (one account flooding the lookups;
a refused call is sent again) while this process (root, another account) times 64-hash lookups. Prints the victim's
p50/p99 alone and under attack, per configuration. Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pwd
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing import get_context
from pathlib import Path

BLOCK = 16


def client(target: str):
    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

    return SidecarClient.connect(
        target, model="org/model", layout=EngineLayout(), num_kv_heads=1, hash_block_size=BLOCK,
        groups=[GroupSpec("full_attention", BLOCK)], cache_prefix="fair",
    )  # fmt: skip


def hashes(seed: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def attack(target: str, n: int, seconds: float, ready) -> None:
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)
    c = client(target)
    big = hashes("attack", n)
    ready.set()
    end = time.monotonic() + seconds

    def loop() -> None:
        from kvsidecar_client import SidecarError

        while time.monotonic() < end:
            with contextlib.suppress(SidecarError):  # refused (the per-call limit): send it again
                c.lookup(big, n * BLOCK + 1, timeout=120)

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.close()


def victim(target: str, seconds: float) -> list[float]:
    c = client(target)
    small = hashes("victim", 64)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        c.lookup(small, 64 * BLOCK + 1)
        out.append((time.perf_counter() - t0) * 1000)
    c.close()
    return out


def summary(ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"p50 {statistics.median(ms):7.1f} ms  p99 {q[98]:7.1f} ms  ({len(ms)} lookups)"


def main() -> None:
    from kvsidecar_testing.processes import DaemonProcess

    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--hashes", type=int, default=1 << 20)
    parser.add_argument(
        "--configs",
        default="--lookups-per-account 2 --max-lookup-hashes 1048576;--lookups-per-account 1 --max-lookup-hashes "
        "1048576;--lookups-per-account 1",
        help="daemon flags of each configuration compared, ';' between them (default: before, gate, gate+limit)",
    )
    args = parser.parse_args()
    for flags in args.configs.split(";"):
        work = Path(tempfile.mkdtemp(prefix="kvs-fair-", dir="/tmp"))
        work.chmod(0o777)
        d = DaemonProcess(work, extra=("--socket-mode", "0666", *flags.split()), log_level="info")
        d.start()
        try:
            alone = victim(d.target, args.seconds / 2)
            ctx = get_context("fork")
            ready = ctx.Event()
            p = ctx.Process(target=attack, args=(d.target, args.hashes, args.seconds, ready))
            p.start()
            ready.wait(120)
            time.sleep(1)
            attacked = victim(d.target, args.seconds - 2)
            p.join(300)
        finally:
            d.stop()
        print(f"[{flags}] alone:        {summary(alone)}")
        print(f"[{flags}] under attack: {summary(attacked)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
