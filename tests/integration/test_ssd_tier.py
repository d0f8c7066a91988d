"""The disk tier (--ssd-dir): capacity beyond DRAM, restarts that keep the cache, one owner per directory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.tiers.directory import inventory, listed_keys
from support import ssd_rank
from support.processes import DaemonProcess, free_port

pytestmark = pytest.mark.integration

SEGMENT = 16 << 20
TP = 2
# Four times the DRAM segment, over both ranks: every prompt is 2 groups x 4 blocks of 256 KiB per rank.
PROMPTS = 4 * SEGMENT // (TP * 2 * ssd_rank.BLOCKS_PER_PROMPT * ssd_rank.BLOCK)
# The external-master test stores three times the segment: with two, one rank can finish before the other starts,
# keep nothing of its own in DRAM... and leave the other rank's blocks all in DRAM: no prompt whole on disk (seen).
EXTERNAL_PROMPTS = 3 * PROMPTS // 4
TESTS = Path(__file__).resolve().parents[1]


def ssd_daemon(workdir: Path, ssd_dir: Path, *, master: str = "", ttl: float | None = None) -> DaemonProcess:
    extra = ("--segment-size", "16MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "256MiB", "--ssd-buffer-size", "8MiB")
    if ttl is not None:
        extra += ("--master-client-ttl", str(ttl))
    return DaemonProcess(workdir, master=master, extra=extra)


def start(daemon: DaemonProcess) -> str:
    """Start the daemon; return what this start wrote to its log file (restarts append to the same one)."""
    before = len(daemon.log())
    daemon.start()
    return daemon.log()[before:]


def run_ranks(daemon: DaemonProcess, what: str, prompts: int = PROMPTS) -> list[dict]:
    """Both TP ranks as their own processes, at once; their JSON results."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "support.ssd_rank", daemon.target, str(TP), str(r), str(prompts), what],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=TESTS,
        )
        for r in range(TP)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err + "\n" + daemon.log()[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def metric_samples(daemon: DaemonProcess) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(daemon.metrics_url, timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def status(daemon: DaemonProcess) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "status", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout + out.stderr


def servable(ssd: Path, prompts: int) -> int:
    """Prompt loads (over all ranks) that the blocks listed on disk can serve whole, by the daemon's lookup rules.

    A lookup needs a block in every rank's namespace (PLACEMENT rule 7), so a prompt missing one rank's block on
    disk is a miss for every rank: the count depends on how eviction split the ranks' blocks, not on recovery.
    """
    return TP * ssd_rank.servable_prompts(listed_keys(ssd, 1 << 20), TP, prompts)


def master_keys(master: EmbeddedMaster) -> set[str]:
    """Every key the master maps, from its admin HTTP server."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{master.metrics_url}/get_all_keys", timeout=10) as r:
        return set(r.read().decode().split())


def assert_exact(results: list[dict], *, at_least: int) -> int:
    for res in results:
        assert res["wrong"] == [], res  # never wrong bytes, whatever the tier
    exact = sum(res["exact"] for res in results)
    assert exact >= at_least, results
    return exact


def test_four_times_dram_then_restarts_keep_the_disk_blocks(tmp_path):
    ssd = tmp_path / "ssd"
    daemon = ssd_daemon(tmp_path, ssd).start()
    try:
        saved = run_ranks(daemon, "save")
        assert sum(s["bytes"] for s in saved) == 4 * SEGMENT
        # Every block comes back, most from disk: DRAM holds a quarter at most.
        assert_exact(run_ranks(daemon, "verify"), at_least=TP * PROMPTS)
        m = metric_samples(daemon)
        disk_hits = m[("kvsidecar_tier_hits_total", (("tier", "disk"),))]
        assert disk_hits >= TP * PROMPTS * 5 // 2, m  # 5 blocks loaded per prompt and rank, over half from disk
        assert m[("kvsidecar_tier_hit_bytes_total", (("tier", "disk"),))] == disk_hits * ssd_rank.BLOCK
        time.sleep(5.5)  # the tier gauges refresh every 5 s
        m = metric_samples(daemon)
        assert m[("kvsidecar_tier_bytes", (("tier", "disk"),))] >= 2 * SEGMENT
        assert m[("kvsidecar_tier_blocks", (("tier", "disk"),))] >= 2 * SEGMENT // ssd_rank.BLOCK
        assert m[("kvsidecar_tier_capacity_bytes", (("tier", "disk"),))] == 256 << 20
        # A second daemon cannot take the directory while this one lives.
        other = ssd_daemon(tmp_path / "other", ssd)
        (tmp_path / "other").mkdir()
        with pytest.raises(RuntimeError, match=r"ssd-dir .* is in use by another running kvsidecar \(\{\"pid\": "):
            other.start(timeout=30)
    finally:
        assert daemon.stop() == 0, daemon.log()
    on_disk = inventory(ssd).keys
    assert on_disk >= 3 * SEGMENT // ssd_rank.BLOCK  # all but at most the DRAM segment's worth
    whole = servable(ssd, PROMPTS)
    assert whole >= TP * PROMPTS // 2

    for stop in ("SIGTERM", "SIGKILL"):
        daemon = ssd_daemon(tmp_path, ssd)
        log = start(daemon)
        try:
            assert f"recovered {on_disk} of {on_disk} blocks on disk" in log, log[-3000:]
            assert f"recovered {on_disk} of {on_disk} blocks" in status(daemon)
            # Every prompt whole on disk comes back; the blocks that were only in DRAM are gone.
            assert_exact(run_ranks(daemon, "verify"), at_least=whole)
            m = metric_samples(daemon)
            assert m[("kvsidecar_disk_tier_recovered_blocks_total", ())] == on_disk
            assert m.get(("kvsidecar_tier_hits_total", (("tier", "memory"),)), 0) == 0  # all from disk
        finally:
            if stop == "SIGTERM":
                assert daemon.stop() == 0, daemon.log()
            else:
                daemon.kill()
        assert inventory(ssd).keys >= on_disk  # reading never lost a block


def test_external_master_quick_restart_waits_out_the_client_ttl(tmp_path):
    """Upstream #3052: an owner back within the master's client TTL recovers nothing; one that waits, all."""
    ttl = 3
    master = EmbeddedMaster(offload=True, client_ttl_s=ttl, rpc_port=free_port(), metrics_port=free_port()).start()
    ssd = tmp_path / "ssd"
    try:
        daemon = ssd_daemon(tmp_path, ssd, master=master.address, ttl=ttl).start()
        try:
            run_ranks(daemon, "save", EXTERNAL_PROMPTS)
        finally:
            daemon.kill()
        on_disk = inventory(ssd).keys
        assert on_disk >= 2 * SEGMENT // ssd_rank.BLOCK  # all but at most the DRAM segment's worth
        whole = servable(ssd, EXTERNAL_PROMPTS)
        assert whole >= TP, "no prompt is whole on disk: the test would prove nothing"

        # Killed, then stopped cleanly: each restart waits out the TTL, reports what it found, and serves all of it.
        for stop in ("SIGTERM", "SIGKILL"):
            began = time.monotonic()
            daemon = ssd_daemon(tmp_path, ssd, master=master.address, ttl=ttl)
            log = start(daemon)
            try:
                assert time.monotonic() - began >= ttl, "the restart should have waited out the master's client TTL"
                assert "waiting" in log and f"recovered {on_disk} of {on_disk} blocks on disk" in log, daemon.log()
                assert f"recovered {on_disk} of {on_disk} blocks" in status(daemon)
                assert_exact(run_ranks(daemon, "verify", EXTERNAL_PROMPTS), at_least=whole)
                # ...and the master still maps every block on disk, after the reads too.
                assert set(listed_keys(ssd, on_disk)) <= master_keys(master)
            finally:
                if stop == "SIGTERM":
                    assert daemon.stop() == 0, daemon.log()
                else:
                    daemon.kill()
            assert inventory(ssd).keys == on_disk

        # Told the TTL is 0, the daemon mounts at once: the master still maps the blocks to the dead owner. The
        # daemon says so, and the ranks get misses, never wrong bytes.
        daemon = ssd_daemon(tmp_path, ssd, master=master.address, ttl=0)
        log = start(daemon)
        try:
            assert "cannot serve them" in log and f"recovered 0 of {on_disk}" in log, daemon.log()
            assert_exact(run_ranks(daemon, "verify", EXTERNAL_PROMPTS), at_least=0)
        finally:
            assert daemon.stop() == 0, daemon.log()
        # ...and, as that warning says, the next restart that waits out the TTL gets them all back.
        daemon = ssd_daemon(tmp_path, ssd, master=master.address, ttl=ttl)
        log = start(daemon)
        try:
            assert "waiting" in log and f"recovered {on_disk} of {on_disk} blocks on disk" in log, log
            assert_exact(run_ranks(daemon, "verify", EXTERNAL_PROMPTS), at_least=whole)
        finally:
            assert daemon.stop() == 0, daemon.log()
    finally:
        master.stop()
