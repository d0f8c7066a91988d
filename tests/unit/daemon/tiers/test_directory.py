"""The disk tier's pure parts: bucket sizing, the TTL wait, bucket metadata, the directory lock, the flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsidecar.config import build
from kvsidecar.errors import ConfigError, DiskDirBusy
from kvsidecar.tiers.directory import (
    LOCK_NAME,
    SsdDirLock,
    bucket_size_for,
    inventory,
    meta_keys,
    offload_environment,
    ttl_wait_seconds,
)

MiB = 1 << 20


def test_buckets_are_small_against_the_segment_and_the_buffer():
    assert bucket_size_for(16 * MiB, 64 * MiB) == 1 * MiB
    assert bucket_size_for(1024 * MiB, 64 * MiB) == 32 * MiB
    assert bucket_size_for(100 * 1024 * MiB, 1280 * MiB) == 256 * MiB  # Mooncake's default at most
    assert bucket_size_for(100 * 1024 * MiB, 64 * MiB) == 32 * MiB  # half the staging buffer


def test_offload_environment_uses_the_recovering_backend_capped_at_size():
    env = offload_environment("/nvme/kv", 8 << 30, 64 * MiB, 64 * MiB)
    assert env["MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR"] == "bucket_storage_backend"
    assert env["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"] == "/nvme/kv"
    for cap in ("TOTAL_SIZE_LIMIT_BYTES", "BUCKET_MAX_TOTAL_SIZE", "BUCKET_MAX_PHYSICAL_BYTES"):
        assert env[f"MOONCAKE_OFFLOAD_{cap}"] == str(8 << 30)
    assert env["MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY"] == "fifo"


def test_ttl_wait():
    assert ttl_wait_seconds(None, None, 10, 1000.0) == 0  # a fresh directory
    # A recent owner, stopped or killed, may have pinged the master until just now: a whole TTL + 4 s from now.
    assert ttl_wait_seconds(999.0, 995.0, 10, 1000.0) == pytest.approx(14.0)
    assert ttl_wait_seconds(995.0, None, 10, 1000.0) == pytest.approx(14.0)
    assert ttl_wait_seconds(900.0, 900.0, 10, 1000.0) == 0  # gone for long
    assert ttl_wait_seconds(999.0, None, 0, 1000.0) == 0  # told not to wait


def _meta(keys: list[str]) -> bytes:
    out = bytearray(b"\x08\xac\x80\x80\x02")  # field 1 varint: the data size
    for k in keys:
        raw = b"default\x00" + k.encode()
        out += bytes([0x12, len(raw)]) + raw
    out += b"\x1a\x06\x10\x0b\x18\x80\x80\x40"  # field 3: an offsets message
    return bytes(out)


def test_bucket_metadata_lists_its_keys(tmp_path):
    assert meta_keys(_meta(["k41", "k50"])) == ["k41", "k50"]
    with pytest.raises(ValueError):
        meta_keys(_meta(["k41"])[:-3])
    (tmp_path / "1.meta").write_bytes(_meta(["a", "b", "c"]))
    (tmp_path / "1.bucket").write_bytes(b"x" * 10000)
    (tmp_path / "2.meta").write_bytes(b"\xff\xff")  # unreadable: counts no keys
    inv = inventory(tmp_path)
    assert (inv.buckets, inv.keys) == (1, 3)
    assert inv.bytes >= 10000


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
        build({"ssd_dir": "/nvme/kv", "segment_size": 0})
