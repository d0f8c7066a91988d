"""The disk tier (--ssd-dir): capacity beyond DRAM, restarts that keep the cache, one owner per directory,
corruption and a full disk as misses, and no listener opened for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.rpc.servers import DISK_TIER_HEALTH
from kvsidecar.tiers.records import decode, indexed_keys, segment_numbers
from kvsidecar_testing.processes import DaemonProcess, free_port
from kvsidecar_testing.waiting import wait_until
from support import ssd_rank
from support.rawrank import RawRank, group, open_request

pytestmark = pytest.mark.integration

SEGMENT = 16 << 20
TP = 2
# Four times the DRAM segment, over both ranks: every prompt is 2 groups x 4 blocks of 256 KiB per rank.
PROMPTS = 4 * SEGMENT // (TP * 2 * ssd_rank.BLOCKS_PER_PROMPT * ssd_rank.BLOCK)
BLOCKS = TP * PROMPTS * 2 * ssd_rank.BLOCKS_PER_PROMPT  # values saved in all
CORRUPTED = 4  # values overwritten on disk by the corruption test
STARTS = 9  # one more than a 256 MiB tier used to keep files of 32 MiB
TESTS = Path(__file__).resolve().parents[1]


def ssd_daemon(workdir: Path, ssd_dir: Path, *, master: str = "", queue: str = "64MiB") -> DaemonProcess:
    # The write queue holds everything the test saves, so no value is skipped however slow the disk is today. No
    # checksum trailers: the tier's byte counts are exact multiples of a block (test_checksums.py has them on disk).
    extra = ("--segment-size", "16MiB", "--ssd-dir", str(ssd_dir), "--ssd-size", "256MiB", "--ssd-buffer-size", queue)
    extra += ("--checksums", "off")
    return DaemonProcess(workdir, master=master, extra=extra, allow_shm_names=True)  # raw ranks: named segments


def start(daemon: DaemonProcess) -> str:
    """Start the daemon; return what this start wrote to its log file (restarts append to the same one)."""
    before = len(daemon.log())
    daemon.start()
    return daemon.log()[before:]


def rank_procs(daemon: DaemonProcess, what: str, prompts: int = PROMPTS) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "support.ssd_rank", daemon.target, str(TP), str(r), str(prompts), what],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=TESTS,
        )
        for r in range(TP)
    ]


def run_ranks(daemon: DaemonProcess, what: str, prompts: int = PROMPTS) -> list[dict]:
    """Both TP ranks as their own processes, at once; their JSON results."""
    results = []
    for p in rank_procs(daemon, what, prompts):
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


def eventually_metric(daemon: DaemonProcess, key: tuple[str, tuple], at_least: float, within: float = 30) -> dict:
    """The metrics once key reaches at_least, or after `within` s (the disk counters follow once a second)."""
    deadline = time.monotonic() + within
    while True:
        m = metric_samples(daemon)
        if m.get(key, 0) >= at_least or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def status(daemon: DaemonProcess) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "status", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout + out.stderr


def servable(ssd: Path, prompts: int) -> int:
    """Prompt loads (over all ranks) that the blocks indexed on disk can serve whole, by the daemon's lookup rules.

    A lookup needs a block in every rank's namespace (PLACEMENT rule 7), so a prompt missing one rank's block on
    disk is a miss for every rank.
    """
    return TP * ssd_rank.servable_prompts(indexed_keys(ssd), TP, prompts)


def assert_exact(results: list[dict], *, at_least: int) -> int:
    for res in results:
        assert res["wrong"] == [], res  # never wrong bytes, whatever the tier
    exact = sum(res["exact"] for res in results)
    assert exact >= at_least, results
    return exact


def assert_fence_admits_nobody(daemon: DaemonProcess) -> None:
    """The disk tier opens no listener: Mooncake's ports stay closed to everyone, loopback included."""
    m = metric_samples(daemon)
    mooncake = {dict(k[1])["role"]: dict(k[1])["allowed"] for k in m if k[0] == "kvsidecar_listener_info"}
    mooncake = {role: allowed for role, allowed in mooncake.items() if role.startswith("mooncake")}
    assert mooncake and set(mooncake.values()) == {"nobody"}, mooncake


def test_four_times_dram_then_restarts_keep_every_block(tmp_path):
    ssd = tmp_path / "ssd"
    daemon = ssd_daemon(tmp_path, ssd).start()
    try:
        assert_fence_admits_nobody(daemon)
        saved = run_ranks(daemon, "save")
        assert sum(s["bytes"] for s in saved) == 4 * SEGMENT
        # Every block comes back, most from disk: DRAM holds a quarter at most.
        assert_exact(run_ranks(daemon, "verify"), at_least=TP * PROMPTS)
        m = metric_samples(daemon)
        disk_hits = m[("kvsidecar_tier_hits_total", (("tier", "disk"),))]
        assert disk_hits >= TP * PROMPTS * 5 // 2, m  # 5 blocks loaded per prompt and rank, over half from disk
        assert m[("kvsidecar_tier_hit_bytes_total", (("tier", "disk"),))] == disk_hits * ssd_rank.BLOCK
        m = eventually_metric(daemon, ("kvsidecar_tier_blocks", (("tier", "disk"),)), BLOCKS)
        assert m[("kvsidecar_tier_blocks", (("tier", "disk"),))] == BLOCKS  # every value written behind
        assert m[("kvsidecar_tier_bytes", (("tier", "disk"),))] == 4 * SEGMENT
        assert m[("kvsidecar_disk_tier_written_bytes_total", ())] == 4 * SEGMENT
        assert m[("kvsidecar_tier_capacity_bytes", (("tier", "disk"),))] == 256 << 20
        assert sum(v for k, v in m.items() if k[0] == "kvsidecar_disk_tier_skipped_writes_total") == 0
        # A second daemon cannot take the directory while this one lives.
        other = ssd_daemon(tmp_path / "other", ssd)
        (tmp_path / "other").mkdir()
        with pytest.raises(RuntimeError, match=r"ssd-dir .* is in use by another running kvsidecar \(\{\"pid\": "):
            other.start(timeout=30)
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert len(indexed_keys(ssd)) == BLOCKS

    # One restart after the clean stop, ended by kill -9: reading never loses a block. (Restarts after kill -9 are
    # test_restarts_that_each_save_a_little_keep_the_first_prompt's and test_killed_mid_save_...'s.)
    daemon = ssd_daemon(tmp_path, ssd)
    log = start(daemon)
    try:
        assert f"recovered {BLOCKS} blocks on disk" in log, log[-3000:]
        shown = status(daemon)
        assert f"recovered {BLOCKS} blocks" in shown
        assert "kvsidecar_disk_tier_recovered_blocks_total" in shown  # with a disk tier, its counters too
        # Every prompt comes back, all of it from disk: DRAM starts empty.
        assert_exact(run_ranks(daemon, "verify"), at_least=TP * PROMPTS)
        m = metric_samples(daemon)
        assert m[("kvsidecar_disk_tier_recovered_blocks_total", ())] == BLOCKS
        assert m[("kvsidecar_disk_tier_recovered_bytes_total", ())] == 4 * SEGMENT
        assert m.get(("kvsidecar_tier_hits_total", (("tier", "memory"),)), 0) == 0  # all from disk
    finally:
        daemon.kill()
    assert len(indexed_keys(ssd)) == BLOCKS


def test_killed_mid_save_serves_what_was_written_and_nothing_wrong(tmp_path):
    ssd = tmp_path / "ssd"
    daemon = ssd_daemon(tmp_path, ssd).start()
    procs = rank_procs(daemon, "save")
    try:
        # Kill -9 once part of the saves is on disk, while the ranks are still saving.
        deadline = time.monotonic() + 120
        while len(_indexed_or_empty(ssd)) < BLOCKS // 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(daemon.pid, signal.SIGKILL)
    finally:
        daemon.kill()
        for p in procs:
            p.kill()
            p.communicate()
    daemon = ssd_daemon(tmp_path, ssd)
    log = start(daemon)
    try:
        on_disk = len(indexed_keys(ssd))
        assert on_disk >= BLOCKS // 4
        assert f"recovered {on_disk} blocks on disk" in log, log[-3000:]
        # Whatever a lookup finds loads byte-exact; prompts cut short by the kill are misses.
        assert_exact(run_ranks(daemon, "verify"), at_least=servable(ssd, PROMPTS))
    finally:
        assert daemon.stop() == 0, daemon.log()


def _indexed_or_empty(ssd: Path) -> list[str]:
    try:
        return indexed_keys(ssd)
    except FileNotFoundError:
        return []


def test_a_corrupted_file_costs_only_its_own_values_as_counted_misses(tmp_path):
    ssd = tmp_path / "ssd"
    daemon = ssd_daemon(tmp_path, ssd).start()
    try:
        run_ranks(daemon, "save")
    finally:
        assert daemon.stop() == 0, daemon.log()
    # Overwrite the middle of the first few values of the first segment file: its index still names them.
    first = segment_numbers(ssd)[0]
    records = decode((ssd / f"{first:08d}.idx").read_bytes())[0][:CORRUPTED]
    with open(ssd / f"{first:08d}.seg", "r+b") as f:
        for r in records:
            f.seek(r.offset + r.length // 2)
            f.write(b"\x5a" * 64)
    daemon = ssd_daemon(tmp_path, ssd)
    start(daemon)
    try:
        # Never wrong bytes; each corrupted value costs at most its own prompt (for every rank), nothing else.
        exact = assert_exact(run_ranks(daemon, "verify"), at_least=TP * (PROMPTS - CORRUPTED))
        assert exact < TP * PROMPTS  # the corrupted values are misses
        key = ("kvsidecar_disk_tier_corrupt_reads_total", ())
        assert eventually_metric(daemon, key, 1)[key] >= 1
        # Forgotten once found bad: a second pass misses them at lookup.
        # (A rank whose lookup ran before the other rank's load found a value bad may have loaded its own blocks of
        # that prompt in the first pass: the second pass misses that prompt for every rank.)
        again = assert_exact(run_ranks(daemon, "verify"), at_least=TP * (PROMPTS - CORRUPTED))
        assert again < TP * PROMPTS
        # Each bad value is counted once at most, however often it is asked for.
        assert 1 <= eventually_metric(daemon, key, CORRUPTED + 1, within=3)[key] <= CORRUPTED
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_restarts_that_each_save_a_little_keep_the_first_prompt(tmp_path):
    """A crash-looping daemon (kill -9 after each start) saving one small prompt each time: the tier keeps them all,
    in one file, however many starts (with files of 32 MiB it used to keep 8, one per start, and drop the first)."""
    ssd = tmp_path / "ssd"
    block = 64 << 10
    request = open_request([group("full_attention", 16)], model="org/CrashLoop")
    for i in range(STARTS):
        daemon = ssd_daemon(tmp_path, ssd)
        log = start(daemon)
        rank = RawRank(daemon.target, request, num_blocks=1, block_bytes=block)
        try:
            assert f"recovered {i} block{'s' * (i != 1)} on disk" in log, log[-3000:]
            rank.register()
            rank.fill_block(0, 0, ssd_rank.pattern(f"start{i}")[:block])
            assert rank.save([_prompt(i)], [[0]], 16).written == 1
            wait_until(lambda i=i: len(indexed_keys(ssd)) == i + 1, timeout=60, what="written to disk")
            if i < STARTS - 1:
                continue
            # The last start finds the first prompt on disk (DRAM holds only this start's), and one file holds all.
            assert f"({0.0625 * i:.1f} MiB in 1 file," in log, log[-3000:]
            hit = rank.lookup([_prompt(0)], 17)
            assert hit.hit_tokens == 16
            assert not rank.load([_prompt(0)], [[0]], hit).failures
            assert rank.block(0, 0) == ssd_rank.pattern("start0")[:block]
            assert "dropped file" not in daemon.log()
        finally:
            rank.close()
            if i < STARTS - 1:
                daemon.kill()
            else:
                assert daemon.stop() == 0, daemon.log()


def _prompt(i: int) -> bytes:
    return (1000 + i).to_bytes(32, "big")


def test_a_full_disk_skips_writes_counts_them_says_so_once_and_writes_again_when_it_has_room(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(ssd)], check=True)
    try:
        # 2 MiB of filesystem under a 256 MiB tier: no 32 MiB file can be allocated, every write fails ENOSPC.
        daemon = ssd_daemon(tmp_path, ssd)
        log = start(daemon)
        try:
            assert f"disk tier {ssd}: --ssd-size 256 MiB is larger than its filesystem (2 MiB in all" in log, log
            run_ranks(daemon, "save")
            key = ("kvsidecar_disk_tier_skipped_writes_total", (("reason", "no_space"),))
            m = eventually_metric(daemon, key, BLOCKS)
            assert m[key] >= BLOCKS, m
            assert m[("kvsidecar_tier_blocks", (("tier", "disk"),))] == 0
            assert m[("kvsidecar_disk_tier_writing", ())] == 0
            # Said once, not once per value; status and the disk tier's health say it too, and why.
            assert daemon.log().count("not writing: the filesystem is full (No space left on device)") == 1
            said = status(daemon)
            assert "disk tier NOT WRITING for " in said and "the filesystem is full (No space left on device)" in said
            assert disk_health(daemon) == health_pb2.HealthCheckResponse.NOT_SERVING
            # DRAM still serves what it holds (a quarter at most); the rest are misses, nothing wrong.
            exact = assert_exact(run_ranks(daemon, "verify"), at_least=0)
            assert exact < TP * PROMPTS
            # Room again: the next save is written, said in one line.
            subprocess.run(["mount", "-o", "remount,size=64m", str(ssd)], check=True)
            rank = RawRank(daemon.target, open_request([group("full_attention", 16)], model="org/Room"), 1, 4096)
            try:
                rank.register()
                saves = iter(range(1000))

                def written_again() -> bool:
                    rank.save([_prompt(next(saves))], [[0]], 16)
                    return "writing again after" in daemon.log()

                wait_until(written_again, timeout=60, what="the disk tier writing again", detail=daemon.log)
            finally:
                rank.close()
            serving = health_pb2.HealthCheckResponse.SERVING
            wait_until(lambda: disk_health(daemon) == serving, timeout=30, what="the disk tier's health")
            assert metric_samples(daemon)[("kvsidecar_disk_tier_writing", ())] == 1
        finally:
            assert daemon.stop() == 0, daemon.log()
    finally:
        subprocess.run(["umount", "-l", str(ssd)], check=False)


def disk_health(daemon: DaemonProcess) -> int:
    """What the health service says of the disk tier (NOT_SERVING while it does not write)."""
    with grpc.insecure_channel(daemon.target) as channel:
        request = health_pb2.HealthCheckRequest(service=DISK_TIER_HEALTH)
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status)


def test_external_master_restart_recovers_at_once(tmp_path):
    """The disk is the daemon's own: a restart against a running external master needs no wait (upstream #3052),
    after kill -9 as after a clean stop. A killed daemon's segment stays listed by the master until its client TTL:
    until then the restarted daemon serves from its disk alone and sends no read to that segment."""
    ttl = 30
    master = EmbeddedMaster(client_ttl_s=ttl, rpc_port=free_port(), metrics_port=free_port()).start()
    ssd = tmp_path / "ssd"

    def external(queue: str = "64MiB") -> DaemonProcess:
        daemon = ssd_daemon(tmp_path, ssd, master=master.address, queue=queue)
        daemon.extra += ("--master-client-ttl", str(ttl))
        return daemon

    try:
        daemon = external().start()
        try:
            run_ranks(daemon, "save")
            eventually_metric(daemon, ("kvsidecar_tier_blocks", (("tier", "disk"),)), BLOCKS)
        finally:
            daemon.kill()  # its segment (every value it saved) stays listed by the master for `ttl` seconds
        # Killed, killed again, then stopped cleanly: each restart is inside the first daemon's TTL.
        for stop in ("SIGKILL", "SIGTERM", "restart after a clean stop"):
            daemon = external()
            before = daemon.log()
            log = start(daemon)
            try:
                assert "waiting" not in log
                assert f"recovered {BLOCKS} blocks on disk" in log, log[-3000:]
                assert "use the disk alone" in log, log[-3000:]  # a clean stop passes the window on
                # Every block, byte-exact, from disk: no read went to the dead segment.
                assert_exact(run_ranks(daemon, "verify"), at_least=TP * PROMPTS)
                m = metric_samples(daemon)
                assert m.get(("kvsidecar_tier_hits_total", (("tier", "memory"),)), 0) == 0, m
                assert m[("kvsidecar_tier_hits_total", (("tier", "disk"),))] >= TP * PROMPTS
                assert daemon.alive()
                # Mooncake logs each transfer it could not open (a segment nobody serves): there was none.
                assert "Failed to open segment" not in daemon.log()[-len(daemon.log()) + len(before) :], log
            finally:
                if stop == "SIGKILL":
                    daemon.kill()
                else:
                    assert daemon.stop() == 0, daemon.log()
    finally:
        master.stop()
