"""Issue 22's attacks by a local account, each as real processes: a real daemon, engines of throwaway uids.

Each attacker is tests/support/tenant_engine.py dropped to its own uid; the well-behaved engine of another uid runs
next to it and must be unharmed. What each row shows is in docs/security.md (the threat table).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.processes import DaemonProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"), reason="needs root and useradd (CI has both)"),
]

ENGINE = Path(__file__).resolve().parents[1] / "support" / "tenant_engine.py"


def good_steps() -> tuple[tuple[object, ...], ...]:
    """The well-behaved engine's steps, on a prompt of its own: the master is shared by every test of the run, and a
    prompt an earlier test stored would be found, not written."""
    tag = f"good-{secrets.token_hex(6)}"
    return (("open", "team-b"), ("save", tag, 4), ("load", tag, 4))


@pytest.fixture(scope="module")
def users():
    """Two throwaway system users, removed at the end."""
    made = []
    try:
        for _ in range(2):
            name = f"kvsl{secrets.token_hex(3)}"
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True, timeout=30)  # fmt: skip
            made.append(name)
        yield [pwd.getpwnam(n) for n in made]
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=30)


@pytest.fixture
def sockdir():
    """A directory other uids can reach (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="kvsl-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def tenants(path: Path, a: pwd.struct_passwd, b: pwd.struct_passwd) -> Path:
    path.write_text(
        f'[tenants.alpha]\nuids = [{a.pw_uid}]\nprefixes = ["team-a"]\n\n'
        f'[tenants.beta]\nuids = [{b.pw_uid}]\nprefixes = ["team-b"]\n'
    )
    return path


def start(sockdir: Path, a, b, master: str, *extra: str) -> DaemonProcess:
    args = ("--tenants", str(tenants(sockdir / "tenants.toml", a, b)), "--socket-mode", "0666", *extra)
    return DaemonProcess(sockdir, master=master, extra=args).start()


def body(d: DaemonProcess, user: pwd.struct_passwd, steps, model: str = "org/model") -> str:
    spec = {"target": d.target, "uid": user.pw_uid, "gid": user.pw_gid, "steps": [list(s) for s in steps]}
    return json.dumps({**spec, "model": model})


def engine(d: DaemonProcess, user: pwd.struct_passwd, *steps, model: str = "org/model") -> list[dict]:
    out = subprocess.run([sys.executable, str(ENGINE), body(d, user, steps, model)], capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def attacker(d: DaemonProcess, user: pwd.struct_passwd, *steps) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(ENGINE), body(d, user, steps)], stdout=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 180) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, f"the attacker ended early: {proc.communicate()[0]}"
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.1)


def answers(proc: subprocess.Popen[str]) -> list[dict]:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def assert_unharmed(d: DaemonProcess, good: list[dict]) -> None:
    """The well-behaved engine saved and loaded its blocks whole, and the daemon serves on."""
    assert all(a.get("ok") for a in good), good
    assert good[1]["written"] == 4 and good[2]["hit_blocks"] == 4 and good[2]["bytes_match"], good
    assert d.alive() and d.serving(), d.log()


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Callable[[int], None]]:
    """A memory cgroup limited to `limit` bytes (v2, else v1); yields a function moving a pid into it."""
    name = f"kvsl-{secrets.token_hex(4)}"
    v2 = Path("/sys/fs/cgroup")
    if "memory" in (v2 / "cgroup.controllers").read_text() if (v2 / "cgroup.controllers").exists() else False:
        path, limit_file = v2 / name, "memory.max"
        with contextlib.suppress(OSError):
            (v2 / "cgroup.subtree_control").write_text("+memory")
    elif (Path("/sys/fs/cgroup/memory") / "memory.limit_in_bytes").exists():
        path, limit_file = Path("/sys/fs/cgroup/memory") / name, "memory.limit_in_bytes"
    else:
        pytest.skip("no memory cgroup controller on this kernel (neither cgroup v2 memory nor v1 memory)")
    try:
        path.mkdir()
        (path / limit_file).write_text(str(limit))
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        pytest.skip(f"cannot make a memory cgroup here ({path}): {exc.strerror}")
    try:
        yield lambda pid: (path / "cgroup.procs").write_text(str(pid))
    finally:
        for _ in range(50):  # the daemon has stopped; its cgroup empties as it exits
            with contextlib.suppress(OSError):
                path.rmdir()
                break
            time.sleep(0.1)


def test_a_sparse_memfd_is_refused_and_the_daemon_in_a_1gib_memory_cgroup_lives(users, sockdir, mooncake_master):
    """Row 1: 2 GiB made with ftruncate only, daemon in a 1 GiB memory cgroup: refused, nothing allocated."""
    a, b = users
    with memory_cgroup(1 << 30) as join:
        d = start(sockdir, a, b, mooncake_master.address)
        try:
            join(d.pid)
            crafted = engine(d, a, ("open_crafted", "team-a", "sparse", 2048))[0]
            assert crafted.get("code") == "INVALID_ARGUMENT", crafted
            assert "is not fully backed: 0 of its 2147483648 bytes" in crafted["reason"], crafted
            assert "posix_fallocate" in crafted["reason"], crafted  # the fix, in the reason
            assert_unharmed(d, engine(d, b, *good_steps()))
        finally:
            assert d.stop() == 0, d.log()


def test_a_hugetlb_memfd_is_refused(users, sockdir, mooncake_master):
    """Row 2: a sealed hugetlb memfd (whose punched holes fault from the huge-page pool) is never mapped."""
    try:
        os.close(os.memfd_create("probe", os.MFD_HUGETLB))
    except OSError as exc:
        pytest.skip(f"this kernel makes no hugetlb memfd: {exc.strerror}")
    a, b = users
    d = start(sockdir, a, b, mooncake_master.address)
    try:
        crafted = engine(d, a, ("open_crafted", "team-a", "hugetlb", 2))[0]
        assert crafted.get("code") == "INVALID_ARGUMENT", crafted
        assert "is on hugetlbfs, not shmem" in crafted["reason"], crafted
        assert_unharmed(d, engine(d, b, *good_steps()))
    finally:
        assert d.stop() == 0, d.log()


def test_a_hole_punched_after_registration_refuses_that_session_only(users, sockdir, mooncake_master):
    """Row 2, shmem: holes punched in a registered memfd refuse its session's next call; the daemon is untouched."""
    a, b = users
    d = start(sockdir, a, b, mooncake_master.address)
    try:
        punched = engine(d, a, ("open", "team-a"), ("save", "mine", 2), ("punch",))
        assert punched[1]["written"] == 2, punched
        assert punched[2].get("code") == "INVALID_ARGUMENT", punched
        assert "memfd #0 lost pages after registration" in punched[2]["reason"], punched
        assert_unharmed(d, engine(d, b, *good_steps()))
    finally:
        assert d.stop() == 0, d.log()


def test_named_dev_shm_segments_are_refused_by_a_default_daemon(users, sockdir, mooncake_master):
    """Row 3: a default (single-tenant) daemon takes no /dev/shm names, which a rank can truncate mid-transfer."""
    a, _ = users
    d = DaemonProcess(sockdir, master=mooncake_master.address, extra=("--socket-mode", "0666")).start()
    try:
        named = engine(d, a, ("open_named", "team-a"))[0]
        assert named.get("code") == "PERMISSION_DENIED", named
        assert "/dev/shm names are for trusted ranks only" in named["reason"], named
        assert d.alive()
    finally:
        assert d.stop() == 0, d.log()


def test_one_account_parking_memfds_leaves_the_others_their_share(users, sockdir, mooncake_master):
    """Row 4: sessions of one uid parking 253 memfds each stop at its share; another uid registers as usual."""
    a, b = users
    d = start(sockdir, a, b, mooncake_master.address, "--max-memfds-per-account", "1024")
    parked, release = sockdir / "parked", sockdir / "release"
    try:
        proc = attacker(d, a, ("park", "team-a", 8), ("touch", str(parked)), ("wait_for", str(release), 300))
        wait_for(parked, proc)
        good = engine(d, b, *good_steps())
        release.touch()
        park = answers(proc)[0]
        assert park["parked"] == 4 * 253 and park["code"] == "RESOURCE_EXHAUSTED", park
        assert "memfds held: tenant alpha holds 1012 and asks for 253 more" in park["reason"], park
        assert "--max-memfds-per-account" in park["reason"], park
        assert_unharmed(d, good)
    finally:
        assert d.stop() == 0, d.log()


def test_one_uid_minting_tickets_and_holding_side_connections_leaves_another_its_share(users, sockdir, mooncake_master):
    """Row 5: one uid mints tickets in a loop and holds 40 side-socket connections; another uid opens every time."""
    a, b = users
    d = start(sockdir, a, b, mooncake_master.address)
    minted = sockdir / "minted"
    try:
        proc = attacker(d, a, ("tickets", 5000), ("touch", str(minted)), ("hold_side", 40, 40))
        wait_for(minted, proc)
        run = secrets.token_hex(6)
        rounds = [step for i in range(10) for step in (("open", "team-b"), ("save", f"good-{run}-{i}", 4))]
        good = engine(d, b, *rounds)
        held = answers(proc)
        assert held[0]["minted"] == 256 and held[0]["code"] == "RESOURCE_EXHAUSTED", held
        assert f"uid {a.pw_uid} has 256 outstanding" in held[0]["reason"], held
        assert held[2]["busy"] > 0, held  # its connections past its share were turned away
        assert all(g.get("ok") for g in good), good
        assert all(g["written"] == 4 for g in good[1::2]), good
        assert d.alive() and d.serving()
    finally:
        assert d.stop() == 0, d.log()


def test_two_tenants_sharing_a_prefix_are_granted_by_what_keys_carry(users, sockdir, mooncake_master):
    """Row 6: models `org-a/*` and `org-b/*` under one prefix cannot be told apart by keys (they carry `Llama`):
    such a file is refused; rights on what keys carry keep A from B's values and its Reset from removing them."""
    a, b = users
    bad = sockdir / "bad.toml"
    bad.write_text(
        f'[tenants.alpha]\nuids = [{a.pw_uid}]\nprefixes = ["shared"]\nmodels = ["org-a/*"]\n\n'
        f'[tenants.beta]\nuids = [{b.pw_uid}]\nprefixes = ["shared"]\nmodels = ["org-b/*"]\n'
    )
    refused = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "serve", "--tenants", str(bad), "--socket", str(sockdir / "bad.sock"),
         "--master", mooncake_master.address, "--metrics-address", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "model pattern 'org-a/*': models match what keys carry" in refused.stdout + refused.stderr

    good = sockdir / "tenants.toml"
    good.write_text(
        f'[tenants.alpha]\nuids = [{a.pw_uid}]\nprefixes = ["shared"]\nmodels = ["Llama*"]\n\n'
        f'[tenants.beta]\nuids = [{b.pw_uid}]\nprefixes = ["shared"]\nmodels = ["Qwen*"]\n'
    )
    d = DaemonProcess(
        sockdir, master=mooncake_master.address, extra=("--tenants", str(good), "--socket-mode", "0666")
    ).start()
    try:
        mine = engine(d, b, ("open", "shared"), ("save", "b-secret", 4), model="org-b/Qwen")
        assert mine[1]["written"] == 4, mine
        # A asks for the same model name of its own org: the same keys, so the same rule, which A does not hold.
        probe = engine(d, a, ("open", "shared"), model="org-a/Qwen")[0]
        assert probe.get("code") == "PERMISSION_DENIED", probe
        assert (
            "tenant alpha may not open sessions under cache prefix 'shared' for model 'org-a/Qwen'" in probe["reason"]
        )
        own = engine(d, a, ("open", "shared"), ("hits", "b-secret", 4), ("reset",), model="org-a/Llama")
        assert own[1]["hit_blocks"] == 0 and own[2]["ok"], own
        after = engine(d, b, ("open", "shared"), ("hits", "b-secret", 4), model="org-b/Qwen")
        assert after[1]["hit_blocks"] == 4, after  # A's Reset removed none of B's values
    finally:
        assert d.stop() == 0, d.log()
