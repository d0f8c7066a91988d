"""The disk tier's directory lock and its flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsidecar.config import build
from kvsidecar.errors import ConfigError, DiskDirBusy
from kvsidecar.tiers.directory import LOCK_NAME, SsdDirLock

MiB = 1 << 20


def test_a_directory_has_one_owner_and_is_free_again_when_it_dies(tmp_path):
    first = SsdDirLock.claim(tmp_path / "ssd")
    assert first.last_alive is None
    with pytest.raises(DiskDirBusy, match=r"in use by another running kvsidecar .*\"pid\""):
        SsdDirLock.claim(tmp_path / "ssd")
    first.release()
    again = SsdDirLock.claim(tmp_path / "ssd")
    assert again.last_alive is not None and again.stopped is not None  # a clean stop says when
    again.release()
    # A process killed outright leaves the file, never the lock.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvsidecar.tiers.directory import SsdDirLock; "
         "held = SsdDirLock.claim(sys.argv[1]); print('ok', flush=True); sys.stdin.read()", str(tmp_path / "ssd")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        with pytest.raises(DiskDirBusy, match=str(holder.pid)):
            SsdDirLock.claim(tmp_path / "ssd")
    finally:
        holder.kill()
        holder.wait()
    after_kill = SsdDirLock.claim(tmp_path / "ssd")
    assert after_kill.stopped is None  # killed: no stop time
    after_kill.release()
    assert (tmp_path / "ssd" / LOCK_NAME).exists()


def test_flags():
    assert build({}).ssd_dir == ""  # no disk tier unless asked
    assert build({"ssd_dir": "/nvme/kv", "ssd_size": 64 * MiB}).ssd_size == 64 * MiB
    with pytest.raises(ConfigError, match="absolute"):
        build({"ssd_dir": "relative/dir"})
    with pytest.raises(ConfigError, match="at least 64MiB"):
        build({"ssd_dir": "/nvme/kv", "ssd_size": MiB})
    with pytest.raises(ConfigError, match="needs a segment"):
        build({"ssd_dir": "/nvme/kv", "segment_size": 0, "master": "127.0.0.1:5000"})
    # Disk-tier settings without the disk tier would do nothing: refused, not ignored.
    with pytest.raises(ConfigError, match=r"^--ssd-size applies only with --ssd-dir"):
        build({"ssd_size": 64 * MiB})
    with pytest.raises(ConfigError, match=r"^--master-client-ttl, --ssd-buffer-size apply only with --ssd-dir"):
        build({"ssd_buffer_size": 64 * MiB, "master_client_ttl": 5.0})


def test_the_next_owner_knows_whether_a_killed_owner_used_the_same_external_master(tmp_path):
    ssd = tmp_path / "ssd"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvsidecar.tiers.directory import SsdDirLock; "
         "held = SsdDirLock.claim(sys.argv[1], master='127.0.0.1:5000'); print('ok', flush=True); sys.stdin.read()",
         str(ssd)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
    finally:
        holder.kill()
        holder.wait()
    after_kill = SsdDirLock.claim(ssd, master="127.0.0.1:5000")
    assert after_kill.previous_master == "127.0.0.1:5000" and after_kill.last_alive is not None
    until = after_kill.dead_segment_until(30)
    assert until >= after_kill.last_alive + 30  # that master lists the dead owner's segment for its client TTL
    after_kill.release()
    # Another master never knew it; an embedded one died with its daemon.
    for master in ("127.0.0.1:6000", ""):
        other = SsdDirLock.claim(ssd, master=master)
        assert other.dead_segment_until(30) == 0
        other.release()
    # An owner that stopped cleanly passes on what it knew of the killed one.
    knew = SsdDirLock.claim(ssd, master="127.0.0.1:5000")
    assert knew.dead_segment_until(30) == 0  # the last owner (another master) stopped cleanly and knew nothing
    knew.record_dead_until(until)
    knew.release()
    clean = SsdDirLock.claim(ssd, master="127.0.0.1:5000")
    assert clean.stopped is not None and clean.dead_segment_until(30) == until
    clean.release()
