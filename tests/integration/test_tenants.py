"""Tenants as real uids: engine processes of two throwaway users against one daemon with a tenants file.

Each engine is tests/support/tenant_engine.py, dropped to its user's uid before it connects, so the daemon knows it
only by what the kernel reports (SO_PEERCRED through a side-socket ticket).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar_testing.processes import DaemonProcess
from support.localusers import for_other_accounts, other_accounts, shared_dir

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"), reason="needs root and useradd (CI has both)"),
]

ENGINE = Path(__file__).resolve().parents[1] / "support" / "tenant_engine.py"


@pytest.fixture(scope="module")
def users():
    """Two throwaway system users, removed at the end."""
    with other_accounts(2, "kvst") as made:
        yield made


@pytest.fixture
def sockdir():
    """A directory other uids can reach (pytest's tmp_path is private to root)."""
    with shared_dir("kvst-", 0o755) as d:
        yield d


def tenants_file(path: Path, a: pwd.struct_passwd, b: pwd.struct_passwd, *, b_budget: str = "", a_prefix="team-a*"):
    budget = f'write_bytes_per_second = "{b_budget}"\nwrite_burst_bytes = "{b_budget}"\n' if b_budget else ""
    path.write_text(
        f'[tenants.alpha]\nuids = [{a.pw_uid}]\nprefixes = ["{a_prefix}"]\n\n'
        f'[tenants.beta]\nuids = [{b.pw_uid}]\nprefixes = ["team-b"]\n{budget}\n'
        f'[tenants.ops]\nuids = [0]\nprefixes = ["ops"]\nadmin = true\n'
    )
    return path


def start(sockdir: Path, tenants: Path, master: str = "", extra: tuple[str, ...] = ()) -> DaemonProcess:
    return DaemonProcess(
        sockdir, master=master, extra=("--tenants", str(tenants), "--socket-mode", "0666", *extra)
    ).start()


def engine_argv(body: dict) -> list[str]:
    """The engine's command line, able to read this checkout once it has dropped to its user's uid."""
    return for_other_accounts([sys.executable, str(ENGINE), json.dumps(body)])


def engine(daemon: DaemonProcess, user: pwd.struct_passwd | None, *steps, timeout=120, **spec) -> list[dict]:
    """Run one engine process as user (None: as root) through steps; its answers, one per step."""
    body = {"target": daemon.target, "steps": [list(s) for s in steps], **spec}
    if user is not None:
        body.update(uid=user.pw_uid, gid=user.pw_gid)
    out = subprocess.run(engine_argv(body), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def metric(daemon: DaemonProcess, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_the_prompt_probe_and_cross_tenant_reset_are_refused(users, sockdir, mooncake_master):
    a, b = users
    d = start(sockdir, tenants_file(sockdir / "tenants.toml", a, b), mooncake_master.address)
    try:
        assert "multi-tenant: 3 tenants" in d.log()
        first = engine(d, a, ("open", "team-a"), ("save", "secret-prompt", 4), ("hits", "secret-prompt", 4))
        assert first[0] == {"ok": True, "tenant": "alpha"}
        assert first[1]["written"] == 4 and first[2]["hit_blocks"] == 4

        # Tenant beta probes alpha's prompt under alpha's prefix: refused before any existence check runs.
        probe = engine(d, b, ("open", "team-a"), ("open", "team-a-x"), ("open", "team-b"), ("hits", "secret-prompt", 4))
        for refused in probe[:2]:
            assert refused["code"] == "PERMISSION_DENIED", refused
            assert "tenant beta may not open sessions under cache prefix 'team-a" in refused["reason"]
        assert probe[2] == {"ok": True, "tenant": "beta"}
        assert probe[3]["hit_blocks"] == 0  # its own namespace: alpha's prompt is invisible

        # Reset across tenants: beta cannot reach alpha's namespace at all; its own Reset leaves alpha's blocks.
        reset = engine(d, b, ("open", "team-b"), ("reset",))
        assert reset[1]["ok"]
        again = engine(d, a, ("open", "team-a"), ("hits", "secret-prompt", 4))
        assert again[1]["hit_blocks"] == 4
        assert metric(d, "kvsidecar_tenant_refused_total", tenant="beta", reason="permission") == 2
    finally:
        assert d.stop() == 0, d.log()


def test_stats_show_a_tenant_its_own_sessions_and_the_admin_all(users, sockdir, mooncake_master):
    a, b = users
    d = start(sockdir, tenants_file(sockdir / "tenants.toml", a, b), mooncake_master.address)
    hold = None
    try:
        # alpha holds a session open until the test is done asking for Stats.
        done = sockdir / "stats-done"
        body = {"target": d.target, "uid": a.pw_uid, "gid": a.pw_gid,
                "steps": [["open", "team-a"], ["wait_for", str(done), "120"]]}  # fmt: skip
        hold = subprocess.Popen(engine_argv(body), stdout=subprocess.PIPE, text=True)
        seen = engine(d, None, ("open", "ops"), ("stats_until", "alpha", "team-a", "90"))[1]["sessions"]
        assert ["alpha", "team-a"] in seen and ["ops", "ops"] in seen  # the admin sees every tenant
        beta = engine(d, b, ("open", "team-b"), ("stats",))[1]
        assert beta["caller_tenant"] == "beta" and beta["sessions"] == [["beta", "team-b"]]
        assert beta["tenancy"].startswith("multi-tenant")
        # `kvsidecar status` says how the daemon runs.
        status = subprocess.run([sys.executable, "-m", "kvsidecar", "status", "--address", d.target],
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        assert "tenancy: multi-tenant: 3 tenants" in status.stdout and "(you: tenant ops)" in status.stdout
        done.touch()
        out, _ = hold.communicate(timeout=60)
        assert hold.returncode == 0 and json.loads(out.strip().splitlines()[-1])[1] == {"ok": True}, out
    finally:
        if hold is not None and hold.poll() is None:
            hold.kill()
            hold.wait(10)
        assert d.stop() == 0, d.log()


def test_sighup_changes_rights_for_new_sessions(users, sockdir, mooncake_master):
    a, b = users
    path = tenants_file(sockdir / "tenants.toml", a, b)
    d = start(sockdir, path, mooncake_master.address)
    try:
        assert engine(d, a, ("open", "team-a2"))[0]["ok"]
        tenants_file(path, a, b, a_prefix="team-a")  # alpha keeps "team-a" only
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "SIGHUP: tenants reloaded" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        after = engine(d, a, ("open", "team-a2"), ("open", "team-a"))
        assert after[0]["code"] == "PERMISSION_DENIED" and after[1]["ok"]
        path.write_text("[tenants.broken\n")  # a bad file keeps the rights in force
        d.proc.send_signal(signal.SIGHUP)
        while "tenants file not reloaded" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine(d, a, ("open", "team-a"))[0]["ok"]
    finally:
        assert d.stop() == 0, d.log()


def test_a_budgeted_flood_leaves_the_other_tenants_hits(users, sockdir):
    a, b = users
    # Its own embedded master: the store is exactly this daemon's 64 MiB segment, which beta's flood exceeds.
    d = start(sockdir, tenants_file(sockdir / "tenants.toml", a, b, b_budget="1MiB"))
    try:
        spec = {"blocks": 64, "floats": 64 * 1024}  # 256 KiB blocks: 16 MiB of working set
        warm = engine(d, a, ("open", "team-a"), ("save", "working-set", 64), **spec)
        assert warm[1]["written"] == 64
        # beta tries to write 96 x 16 MiB = 1.5 GiB, far past the store; its budget (1 MiB burst, 1 MiB/s) lets
        # through no more than the burst plus the rate over the time the flood took.
        started = time.monotonic()
        flood = engine(d, b, ("open", "team-b"), *[("flood", f"flood-{i}", 64) for i in range(96)], **spec)
        elapsed = time.monotonic() - started
        written = sum(s["written"] for s in flood[1:])
        assert written * (256 << 10) <= (1 << 20) * (1 + elapsed), (written, elapsed)
        assert all(s["reasons"] in ([], ["tenant_budget"]) for s in flood[1:])
        assert metric(d, "kvsidecar_tenant_refused_total", tenant="beta", reason="tenant_budget") > 5000
        assert metric(d, "kvsidecar_save_failed_blocks_total", reason="tenant_budget") > 5000
        after = engine(d, a, ("open", "team-a"), ("load", "working-set", 64), **spec)
        assert after[1] == {"ok": True, "hit_blocks": 64, "failed": 0, "bytes_match": True}
        assert metric(d, "kvsidecar_tenant_lookup_hit_tokens_total", tenant="alpha") == 64 * 16
    finally:
        assert d.stop() == 0, d.log()


def test_a_hostile_rank_cannot_crash_the_daemon_through_its_memory(users, sockdir, mooncake_master):
    a, b = users
    d = start(sockdir, tenants_file(sockdir / "tenants.toml", a, b), mooncake_master.address)
    try:
        body = {"target": d.target, "uid": a.pw_uid, "gid": a.pw_gid, "steps": [["open", "team-a"], ["hostile", "8"]]}
        hostile = subprocess.Popen(engine_argv(body), stdout=subprocess.PIPE, text=True)
        rounds = [("save", f"good-{i}", 8) for i in range(40)] + [("load", f"good-{i}", 8) for i in range(40)]
        good = engine(d, b, ("open", "team-b"), *rounds)
        out, _ = hostile.communicate(timeout=120)
        assert hostile.returncode == 0, out
        attack = json.loads(out.strip().splitlines()[-1])[1]
        # Named /dev/shm memory, which it could truncate under a transfer, is refused to an untrusted tenant.
        named = engine(d, a, ("open_named", "team-a"))[0]
        assert named["code"] == "PERMISSION_DENIED" and "/dev/shm names are for trusted ranks only" in named["reason"]
        # Its own truncates were refused by the kernel (the seals), holes and remaps went through, and the
        # daemon served it on.
        assert attack["refused"]["truncate"] > 10 and attack["refused"]["grow"] > 10, attack
        assert attack["punched"] > 10 and attack["remapped"] > 10 and attack["calls"] > 5, attack
        for answer in good:
            assert answer.get("ok"), answer
        assert all(s["written"] == 8 for s in good[1:41])
        assert all(s["hit_blocks"] == 8 and s["failed"] == 0 and s["bytes_match"] for s in good[41:])
        assert d.proc.poll() is None and d.serving()
    finally:
        assert d.stop() == 0, d.log()


def test_an_engine_started_before_the_daemon_opens_as_its_uid(users, sockdir, mooncake_master):
    a, b = users
    tenants = tenants_file(sockdir / "tenants.toml", a, b)
    d = DaemonProcess(sockdir, master=mooncake_master.address,
                      extra=("--tenants", str(tenants), "--socket-mode", "0666"))  # fmt: skip
    body = {"target": d.target, "uid": a.pw_uid, "gid": a.pw_gid,
            "steps": [["open", "team-a"], ["save", "early", 2], ["load", "early", 2]]}  # fmt: skip
    early = subprocess.Popen(engine_argv(body), stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1)  # the engine is waiting for a daemon that is not there yet (no socket, no side socket)
        d.start()
        out, _ = early.communicate(timeout=120)
        answers = json.loads(out.strip().splitlines()[-1])
        assert answers[0] == {"ok": True, "tenant": "alpha"}, answers
        assert answers[2]["hit_blocks"] == 2 and answers[2]["bytes_match"], answers
    finally:
        early.kill()
        assert d.stop() == 0, d.log()
