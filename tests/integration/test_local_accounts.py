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
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvsidecar_testing.processes import DaemonProcess
from support.localusers import for_other_accounts, other_accounts, shared_dir

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
    with other_accounts(2, "kvsl") as made:
        yield made


@pytest.fixture
def sockdir():
    """A directory other uids can reach (pytest's tmp_path is private to root)."""
    with shared_dir("kvsl-", 0o777) as d:
        yield d


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
    out = subprocess.run(for_other_accounts([sys.executable, str(ENGINE), body(d, user, steps, model)]),
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def attacker(d: DaemonProcess, user: pwd.struct_passwd, *steps) -> subprocess.Popen[str]:
    argv = for_other_accounts([sys.executable, str(ENGINE), body(d, user, steps)])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


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


def test_a_private_directory_is_lent_to_a_throwaway_account_in_its_process_alone(users, tmp_path):
    """What lets these tests run from a private checkout (support/localusers.py): a process started through
    for_other_accounts still reads what it needs under a directory others may not enter after it drops to a throwaway
    account; nothing else of that directory shows, and nothing changes outside that process."""
    a, _ = users
    tmp_path.chmod(0o700)
    inner = tmp_path / "lent"
    inner.mkdir(mode=0o755)
    (inner / "note").write_text("lent")
    (inner / "note").chmod(0o644)
    (tmp_path / "secret").write_text("not lent")
    read = (
        "import json, os, sys\n"
        "os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))\n"
        "try:\n    note = open(sys.argv[1]).read()\nexcept PermissionError as exc:\n    note = exc.strerror\n"
        "print(json.dumps([note, os.path.exists(sys.argv[4])]))\n"
    )
    argv = [sys.executable, "-c", read, str(inner / "note"), str(a.pw_uid), str(a.pw_gid), str(tmp_path / "secret")]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    lent = subprocess.run(for_other_accounts(argv, also=[inner]), capture_output=True, text=True, timeout=60)
    assert json.loads(plain.stdout) == ["Permission denied", False], plain.stderr
    assert json.loads(lent.stdout) == ["lent", False], lent.stderr
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    assert "kvsidecar-test" not in Path("/proc/self/mountinfo").read_text()


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


# Another uid knocks on host:port targets; HTTP ones are asked for every key. One JSON list of outcomes.
KNOCK = """
import encodings.idna, json, os, socket, sys  # idna: imported while the interpreter is still readable
uid, gid = int(sys.argv[2]), int(sys.argv[3])
if uid >= 0:  # dropped here: the throwaway user may not be able to run this interpreter from where it is installed
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
out = []
for target in json.loads(sys.argv[1]):
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as conn:
            conn.sendall(b"GET /get_all_keys HTTP/1.0\\r\\n\\r\\n")
            conn.settimeout(5)
            try:
                answer = conn.recv(64).decode("latin-1")
            except OSError:
                answer = ""
            out.append({"target": target, "outcome": "connected", "answer": answer})
    except TimeoutError:
        out.append({"target": target, "outcome": "timed out"})
    except OSError as exc:
        out.append({"target": target, "outcome": exc.strerror})
print(json.dumps(out))
"""


def knock(targets: list[str], user: pwd.struct_passwd | None = None, netns_of: int | None = None) -> list[dict]:
    """Connect to each target as user (another local account), or as root inside a process's network namespace."""
    ids = ("-1", "-1") if user is None else (str(user.pw_uid), str(user.pw_gid))
    argv = [sys.executable, "-c", KNOCK, json.dumps(targets), *ids]
    if netns_of is not None:
        argv = ["nsenter", f"--net=/proc/{netns_of}/ns/net", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def listener_info(d: DaemonProcess) -> dict[str, tuple[str, str]]:
    """role -> (address, allowed), from kvsidecar_listener_info on the daemon's metrics endpoint."""
    import re
    import urllib.request

    with urllib.request.urlopen(d.metrics_url, timeout=30) as reply:
        text = reply.read().decode()
    pattern = r'kvsidecar_listener_info\{address="([^"]*)",allowed="([^"]*)",role="([^"]*)"\}'
    return {role: (address, allowed) for address, allowed, role in re.findall(pattern, text)}


def loopback_targets(info: dict[str, tuple[str, str]]) -> list[str]:
    """The master's ports and Mooncake's, on 127.0.0.1 and (for those bound on every address) on ::1."""
    targets = []
    for role in ("master-rpc", "master-http", "mooncake-transfer", "mooncake-handshake"):
        address = info[role][0]
        host, _, port = address.rpartition(":")
        targets.append(f"127.0.0.1:{port}")
        if host == "[::]":
            targets.append(f"[::1]:{port}")
    return targets


def test_other_accounts_reach_neither_the_embedded_master_nor_mooncakes_ports(users, sockdir):
    """Issue 22 item 5: the daemon's loopback guard (a private network namespace) keeps the master's RPC and HTTP
    ports and Mooncake's transfer and handshake ports away from every other local account, while saves and loads go
    on byte-exact; status (kvsidecar_listener_info) says what guards them."""
    a, b = users
    d = start(sockdir, a, b, "")  # no --master: the embedded one
    try:
        info = listener_info(d)
        for role in ("master-rpc", "master-http"):
            assert info[role][1] == "this daemon only (a private network namespace)", info
        assert info["mooncake-transfer"][1] == info["mooncake-handshake"][1] == "nobody", info
        assert "loopback guard: a private network namespace" in d.log()
        targets = loopback_targets(info)
        assert len(targets) == 5, targets  # the transfer port is dual-stack, the handshake port IPv4
        seen = knock(targets, user=a)
        assert all(item["outcome"] == "Connection refused" for item in seen), seen
        # The same knock from inside the daemon's namespace (root only) reaches the master: the probe works, and
        # what keeps the other account out is the namespace.
        inside = knock(targets[:2], netns_of=d.pid)
        assert all(item["outcome"] == "connected" for item in inside), inside
        assert inside[1]["answer"].startswith("HTTP/1."), inside
        assert_unharmed(d, engine(d, b, *good_steps()))
    finally:
        assert d.stop() == 0, d.log()


def test_without_cap_sys_admin_tenants_need_trust_local_accounts_and_status_says_nothing_guards(users, sockdir):
    """A daemon that cannot make a private network namespace (no CAP_SYS_ADMIN: setpriv drops it from the bounding
    set) refuses --tenants with the reason unless --trust-local-accounts; then it runs, and says nothing guards the
    master's loopback ports, which another local account indeed reaches."""
    a, b = users
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to start the daemon without CAP_SYS_ADMIN")
    python = sockdir / "python-without-sys-admin"
    python.write_text(f'#!/bin/sh\nexec setpriv --bounding-set -sys_admin {sys.executable} "$@"\n')
    python.chmod(0o755)
    args = ("--tenants", str(tenants(sockdir / "tenants.toml", a, b)), "--socket-mode", "0666")
    refused = DaemonProcess(sockdir, extra=args, python=python)
    with pytest.raises(Exception, match="exited"):
        refused.start()
    log = refused.log()
    assert "refusing --tenants: nothing guards the embedded master's loopback ports" in log, log
    assert "Operation not permitted; a private network namespace needs CAP_SYS_ADMIN" in log, log
    assert "--trust-local-accounts" in log, log

    d = DaemonProcess(sockdir, extra=(*args, "--trust-local-accounts"), python=python).start()
    try:
        info = listener_info(d)
        for role in ("master-rpc", "master-http"):
            assert info[role][1].startswith("local accounts (loopback): nothing (unshare(CLONE_NEWNET)"), info
        assert "loopback guard: nothing" in d.log()
        seen = knock(loopback_targets(info)[:2], user=a)
        assert [item["outcome"] for item in seen] == ["connected", "connected"], seen
        assert seen[1]["answer"].startswith("HTTP/1."), seen
        assert_unharmed(d, engine(d, b, *good_steps()))
    finally:
        assert d.stop() == 0, d.log()
