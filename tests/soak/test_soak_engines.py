"""A bounded soak: two engines, eight rank processes, faults and hostile traffic against one real daemon and master.

Engine A: TP=4, groups [mla/32, mamba/64] (fine-grained hits, a two-region recurrent value). Engine B: TP=4, H=2,
groups [full_attention/32 (K and V regions), sliding_window:64/16]. Same model, different cache prefixes, prompts
from one pool with shared prefixes. Each request: the engine's scheduler looks the prompt up, the four ranks load
the hit into poisoned blocks and verify every byte against the engine-side oracle, then compute and save the
prompt. Faults, in turn: a rank SIGKILLed mid-request and restarted, a rank's session closed and reopened, a rank
stalled past its lease (its liveness connection keeps its session; a client without one would re-open). A hostile
client sends bad requests all along.

Length: KVSIDECAR_SOAK_SECONDS of traffic (default 20, about 40 s in all); e.g. KVSIDECAR_SOAK_SECONDS=600 for the
long soak. KVSIDECAR_SOAK_REPORT=<path> also writes the report as JSON.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections import Counter

import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from support.fuzzdaemon import FuzzDaemon
from support.soakengine import ENGINE_A, ENGINE_B, EngineLoop, Faults, Prompts, Tally, kill_leftovers
from support.soakhostile import Hostile

SOAK_SECONDS = float(os.environ.get("KVSIDECAR_SOAK_SECONDS", "20"))
TTL = 3.0

pytestmark = [pytest.mark.integration, pytest.mark.timeout(int(SOAK_SECONDS) + 300)]


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sum_of(counts: Counter, suffix: str) -> int:
    return sum(v for k, v in counts.items() if k.endswith(suffix))


def by_prefix(counts: Counter, marker: str) -> dict[str, int]:
    return {k: v for k, v in sorted(counts.items()) if marker in k}


def test_soak_two_engines_eight_ranks_with_faults(tmp_path, record_property):
    import random

    tally = Tally()
    stop = threading.Event()
    with EmbeddedMaster() as master:
        daemon = FuzzDaemon(tmp_path, master=master.address, session_ttl=TTL, extra=("--segment-size", "512MiB"))
        daemon.start()
        prompts = Prompts(random.Random(f"soak-{os.getpid()}"))
        engines = [EngineLoop(daemon.target, e, prompts, tally, stop) for e in (ENGINE_A, ENGINE_B)]
        hostile = Hostile(daemon.target, tally, stop)
        faults = Faults(engines, tally, stop, interval=min(10.0, max(3.0, SOAK_SECONDS / 6)), ttl=TTL)
        deaths: list[str] = []
        leaks: dict[str, object] = {}
        metrics: dict[str, float] = {}
        traffic = 0.0
        rss_start = rss_end = 0
        started = time.monotonic()
        try:
            for engine in engines:
                engine.spawn_ranks()
            for engine in engines:
                engine.wait_ranks()
            ready = time.monotonic()
            rss_start = daemon.rss_bytes()
            for thread in (*engines, hostile, faults):
                thread.start()
            while time.monotonic() - ready < SOAK_SECONDS:
                time.sleep(1.0)
                try:
                    daemon.check()
                except AssertionError as exc:
                    deaths.append(str(exc))
                    break
                if any(e.error for e in engines) or hostile.error:
                    break
            traffic = time.monotonic() - ready
            stop.set()
            for thread in (*engines, faults, hostile):
                thread.join(120)
            for engine in engines:
                engine.close()
            leaks = wait_for_release(daemon)
            rss_end = daemon.rss_bytes() if daemon.alive() else 0
            metrics = scrape(daemon.metrics_url) if daemon.alive() else {}
        finally:
            stop.set()
            kill_leftovers(engines)
            alive = daemon.alive()
            code = daemon.stop()
    counts = tally.counts
    report = {
        "seconds_of_traffic": round(traffic, 1),
        "seconds_in_all": round(time.monotonic() - started, 1),
        "requests": {
            e.engine.name: {
                "completed": counts[f"{e.engine.name}:requests_completed"],
                "cut_by_a_fault": counts[f"{e.engine.name}:requests_cut_by_a_fault"],
                "lookups": counts[f"{e.engine.name}:lookups"],
                "hit_tokens": counts[f"{e.engine.name}:lookup_hit_tokens"],
                "prompt_tokens": counts[f"{e.engine.name}:prompt_tokens"],
                "saves": counts[f"{e.engine.name}:saves"],
                "loads": counts[f"{e.engine.name}:loads"],
                "rank_restarts": counts[f"{e.engine.name}:rank_restarts"],
            }
            for e in engines
        },
        "blocks": {
            "written": sum_of(counts, ":blocks_written"),
            "skipped_already_stored": sum_of(counts, ":blocks_skipped"),
            "striped_to_other_ranks": sum_of(counts, ":blocks_striped_to_others"),
            "verified_byte_for_byte": sum_of(counts, ":blocks_verified"),
            "bytes_verified": sum_of(counts, ":bytes_verified"),
            "corrupted": sum_of(counts, ":blocks_corrupted"),
            "foreign": sum_of(counts, ":blocks_foreign"),
            "stray_writes": sum_of(counts, ":stray_writes"),
            "canary_bytes_damaged": sum_of(counts, ":canary_damage"),
            "load_plan_mismatches": sum_of(counts, ":load_plan_mismatch"),
        },
        "failures_by_cause": {
            **by_prefix(counts, "save_failed:"),
            **by_prefix(counts, "load_failed:"),
            **by_prefix(counts, "rank_error:"),
            **by_prefix(counts, "lookups_degraded"),
        },
        "faults_injected": by_prefix(counts, "fault:"),
        "hostile_requests": by_prefix(counts, "hostile:"),
        "daemon": {
            "alive_at_end": alive,
            "exit_code": code,
            "deaths": deaths,
            "leaks_after_close": leaks,
            "rss_mib_start_end": [rss_start >> 20, rss_end >> 20],
            # Sessions released by the daemon itself: killed ranks (their liveness connections closed) and any
            # client without one whose lease ran out.
            "sessions_expired": daemon.log().count(": releasing its memory"),
            "requests_rejected": {
                k: v for k, v in metrics.items() if k.startswith("kvsidecar_requests_rejected_total")
            },
            "saved_bytes": metrics.get("kvsidecar_saved_bytes_total"),
            "loaded_bytes": metrics.get("kvsidecar_loaded_bytes_total"),
        },
        "samples": tally.samples,
    }
    text = json.dumps(report, indent=2, default=str)
    print("\n--- soak report ---\n" + text)
    record_property("soak_report", text)
    if os.environ.get("KVSIDECAR_SOAK_REPORT"):
        with open(os.environ["KVSIDECAR_SOAK_REPORT"], "w") as out:
            out.write(text)

    errors = [e.error for e in engines if e.error] + ([hostile.error] if hostile.error else [])
    assert not errors, errors[0]
    assert not deaths and alive and code == 0, f"the daemon died or did not stop cleanly: {deaths} exit {code}"
    blocks = report["blocks"]
    for key in ("corrupted", "foreign", "stray_writes", "canary_bytes_damaged", "load_plan_mismatches"):
        assert blocks[key] == 0, f"{key}: {blocks[key]}\n{text}"
    assert not counts["hostile:unclean_answers"], tally.samples.get("hostile:unclean_answers")
    assert not counts["hostile:memory_violations"], tally.samples.get("hostile:memory_violations")
    rank_errors = by_prefix(counts, "rank_error:")
    assert not rank_errors, f"well-behaved ranks got errors: {rank_errors}\n{tally.samples}"
    assert not leaks, f"the daemon still holds memory of closed or dead sessions: {leaks}"
    for e in engines:
        assert counts[f"{e.engine.name}:requests_completed"] >= 5, f"engine {e.engine.name} barely ran\n{text}"
    assert blocks["verified_byte_for_byte"] > 0, text


def wait_for_release(daemon: FuzzDaemon, timeout: float = TTL + 8) -> dict[str, object]:
    """After every client closed (and the killed ranks' leases ran out), the daemon maps no engine memory and holds
    no session; returns what it still holds after `timeout` (empty: nothing leaked)."""
    deadline = time.monotonic() + timeout
    held: dict[str, object] = {}
    while time.monotonic() < deadline:
        if not daemon.alive():
            return {"daemon": "dead"}
        mapped = sorted(n for n in daemon.mapped_shm() if n.startswith("kvsidecar-"))
        stats = daemon.stats()
        sessions = [f"{s.client_name} ({s.session_id_prefix})" for s in stats.sessions]
        held = {"mapped_segments": mapped, "sessions": sessions} if mapped or sessions else {}
        if not held:
            return {}
        time.sleep(0.5)
    return held
