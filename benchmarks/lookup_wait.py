"""How long vLLM's scheduler is held per request by a lookup: waiting for a Lookup (the connector before 2026-12-02)
against starting one (`SidecarClient.lookup_async`, what the scheduler side does now; it then waits at most 1 ms a
step for answers, 10 ms after an idle step).

The bench's lookup layout (T=8, [mla, full_attention, mamba], 16-token blocks, every block stored: a full hit),
one daemon from the main venv, 10 rounds per length after 2 warm-ups, both calls in each round, answers checked:

    flock /tmp/kvsidecar-heavy.lock .venv/bin/python benchmarks/lookup_wait.py
    flock /tmp/kvsidecar-heavy.lock .venv/bin/python benchmarks/lookup_wait.py --arrivals

`--arrivals`: what the daemon's --lookups-per-account does to one vLLM scheduler (one uid: one account) when
ARRIVALS requests arrive in one step: their lookups started at once (the client runs 4 side by side), the time until
each is answered, with the daemon's lookup threads and an account's share of them set as in each of CONFIGS.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvsidecar_bench.lookup import _client, _populate
from kvsidecar_bench.shapes import BLOCK_TOKENS, hashes_for
from kvsidecar_testing.processes import DaemonProcess

LENGTHS = (1024, 16384, 65536)
ROUNDS = 10
ARRIVALS = 8
ARRIVAL_TOKENS = 16384
# (daemon lookup threads, lookups of one account at once): the default before issue 23 (2, 1), and the default now
# (4, 2) among others.
CONFIGS = ((2, 1), (2, 2), (4, 2), (4, 4))


def arrivals() -> int:
    """ARRIVALS lookups of one scheduler started at once, per daemon config: when the first and the last answer."""
    for workers, per_account in CONFIGS:
        work = Path(tempfile.mkdtemp(prefix="kvsidecar-lookup-arrivals-"))
        flags = ("--lookup-workers", str(workers), "--lookups-per-account", str(per_account))
        daemon = DaemonProcess(work, session_ttl=None, segment_size="512MiB", local_buffer_size=None,
                               log_level="warning", extra=flags)  # fmt: skip
        daemon.start()
        try:
            prompts = [hashes_for(f"arrivals/{i}", ARRIVAL_TOKENS // BLOCK_TOKENS) for i in range(ARRIVALS)]
            for hashes in prompts:
                _populate(daemon, hashes, ARRIVAL_TOKENS)
            first, last = [], []
            with _client(daemon, 0, "scheduler") as scheduler:
                for i in range(ROUNDS + 2):
                    t0 = time.perf_counter()
                    answered: list[float] = []
                    futures = [scheduler.lookup_async(h, ARRIVAL_TOKENS + 1, timeout=60) for h in prompts]
                    for future in concurrent.futures.as_completed(futures):
                        if not future.result().hit_tokens:
                            print(f"FAIL: a stored prompt missed: {future.result()}", file=sys.stderr)
                            return 1
                        answered.append(time.perf_counter() - t0)
                    if i >= 2:
                        first.append(answered[0])
                        last.append(answered[-1])
            print(
                f"{workers} lookup threads, {per_account} per account: {ARRIVALS} x {ARRIVAL_TOKENS}-token lookups "
                f"started at once; first answer p50 {statistics.median(first) * 1e3:.1f} ms, last p50 "
                f"{statistics.median(last) * 1e3:.1f} ms (max {max(last) * 1e3:.1f})",
                flush=True,
            )
        finally:
            daemon.stop()
    return 0


def main() -> int:
    if "--arrivals" in sys.argv[1:]:
        return arrivals()
    work = Path(tempfile.mkdtemp(prefix="kvsidecar-lookup-wait-"))
    daemon = DaemonProcess(work, session_ttl=None, segment_size="256MiB", local_buffer_size=None, log_level="warning")
    daemon.start()
    try:
        for tokens in LENGTHS:
            hashes = hashes_for(f"lookup-wait/{tokens}", tokens // BLOCK_TOKENS)
            _populate(daemon, hashes, tokens)
            waited, started = [], []
            with _client(daemon, 0, "scheduler") as scheduler:
                for i in range(ROUNDS + 2):
                    t0 = time.perf_counter()
                    hit = scheduler.lookup(hashes, tokens + 1, timeout=60)
                    t1 = time.perf_counter()
                    future = scheduler.lookup_async(hashes, tokens + 1, timeout=60)
                    t2 = time.perf_counter()
                    again = future.result(60)
                    if not hit.hit_tokens or again.hit_tokens != hit.hit_tokens:
                        print(f"FAIL: {tokens} tokens: {hit} then {again}", file=sys.stderr)
                        return 1
                    if i >= 2:
                        waited.append(t1 - t0)
                        started.append(t2 - t1)
            wait_ms = statistics.median(waited) * 1e3
            start_us = statistics.median(started) * 1e6
            print(
                f"{tokens} tokens, hit {hit.hit_tokens}: waiting for the lookup p50 {wait_ms:.2f} ms "
                f"(max {max(waited) * 1e3:.2f}); starting it p50 {start_us:.0f} us (max {max(started) * 1e6:.0f})",
                flush=True,
            )
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
