"""The disk engine on real files: write-behind, reads into caller memory, recovery, torn tails, corruption, eviction,
the queue bound and a full filesystem."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvsidecar.tiers.engine import DiskEngine
from kvsidecar.tiers.files import accepts_direct
from kvsidecar.tiers.records import indexed_keys
from kvsidecar.tiers.results import ReadResult

MiB = 1 << 20
VALUE = 256 << 10


def pattern(tag: str, size: int = VALUE) -> bytes:
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Buffer:
    """Caller memory at an unaligned address, as an engine's blocks are."""

    def __init__(self, size: int) -> None:
        self._raw = ctypes.create_string_buffer(size + 64)
        self.address = ctypes.addressof(self._raw) + 24
        self.size = size

    def fill(self, data: bytes) -> Buffer:
        ctypes.memmove(self.address, data, len(data))
        return self

    def bytes(self) -> bytes:
        return ctypes.string_at(self.address, self.size)


def put(engine: DiskEngine, key: str, data: bytes, parts: int = 1) -> bool:
    """Enqueue data as `parts` buffers; the buffers are scribbled over at once (the engine must have copied)."""
    cuts = [len(data) * i // parts for i in range(parts + 1)]
    bufs = [Buffer(cuts[i + 1] - cuts[i]).fill(data[cuts[i] : cuts[i + 1]]) for i in range(parts)]
    ok = engine.enqueue(key, [b.address for b in bufs], [b.size for b in bufs])
    for b in bufs:
        b.fill(b"\xee" * b.size)
    return ok


def get(engine: DiskEngine, key: str, size: int = VALUE, parts: int = 1) -> tuple[ReadResult, bytes]:
    cuts = [size * i // parts for i in range(parts + 1)]
    bufs = [Buffer(cuts[i + 1] - cuts[i]) for i in range(parts)]
    (result,) = engine.read_into([key], [[b.address for b in bufs]], [[b.size for b in bufs]])
    return result, b"".join(b.bytes() for b in bufs)


MODES = [False] + ([True] if accepts_direct(Path("/tmp")) else [])


@pytest.fixture(params=MODES, ids=lambda d: "direct" if d else "buffered")
def direct(request):
    return request.param


def open_engine(directory: Path, direct: bool, capacity: int = 64 * MiB, **kw) -> DiskEngine:
    kw.setdefault("queue_bytes", 16 * MiB)
    kw.setdefault("file_size", 4 * MiB)
    return DiskEngine(directory, capacity, direct=direct, **kw)


def test_values_written_behind_read_back_exactly_and_survive_a_restart(tmp_path, direct):
    engine = open_engine(tmp_path, direct)
    try:
        for i in range(20):
            assert put(engine, f"k{i}", pattern(f"v{i}"), parts=1 + i % 3)
        assert put(engine, "odd", pattern("odd", 5000))  # not a multiple of 4 KiB
        assert engine.flush(60)
        assert engine.contains(["k0", "k19", "odd", "nope"]) == [True, True, True, False]
        # A batch read, a few at once, into buffers split differently from the save's.
        bufs = [[Buffer(VALUE // 2), Buffer(VALUE // 2)] for _ in range(20)]
        results = engine.read_into(
            [f"k{i}" for i in range(20)],
            [[b.address for b in bs] for bs in bufs],
            [[b.size for b in bs] for bs in bufs],
        )
        assert results == [ReadResult.OK] * 20
        for i, bs in enumerate(bufs):
            assert b"".join(b.bytes() for b in bs) == pattern(f"v{i}")
        assert get(engine, "odd", 5000) == (ReadResult.OK, pattern("odd", 5000))
        assert get(engine, "k0", VALUE - 1)[0] is ReadResult.SIZE_MISMATCH
        assert get(engine, "nope")[0] is ReadResult.MISSING
        stats = engine.snapshot()
        assert (stats.blocks, stats.written_blocks, stats.bytes) == (21, 21, 20 * VALUE + 5000)
    finally:
        engine.close()
    engine = open_engine(tmp_path, direct)
    try:
        assert engine.recovery.blocks == 21 and engine.recovery.bytes == 20 * VALUE + 5000
        assert engine.recovery.cut_tails == 0
        for i in range(20):
            assert get(engine, f"k{i}", parts=4) == (ReadResult.OK, pattern(f"v{i}"))
        # New writes go on in the newest recovered file: a restart costs no room.
        assert put(engine, "after", pattern("after"))
        assert engine.flush(60)
        assert get(engine, "after") == (ReadResult.OK, pattern("after"))
    finally:
        engine.close()


def test_close_writes_out_what_is_queued(tmp_path, direct):
    engine = open_engine(tmp_path, direct)
    for i in range(30):
        assert put(engine, f"k{i}", pattern(f"v{i}"))
    engine.close()  # as on SIGTERM: nothing queued is lost
    engine = open_engine(tmp_path, direct)
    try:
        assert engine.recovery.blocks == 30
        assert all(get(engine, f"k{i}") == (ReadResult.OK, pattern(f"v{i}")) for i in range(30))
    finally:
        engine.close()


def _index_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.idx"))


def test_a_torn_index_tail_is_cut_and_never_served(tmp_path):
    engine = open_engine(tmp_path, False)
    for i in range(8):
        put(engine, f"k{i}", pattern(f"v{i}"))
        engine.flush(60)  # one record per write, so the last one can be torn alone
    engine.close()
    (idx,) = _index_files(tmp_path)
    whole = idx.stat().st_size
    with open(idx, "r+b") as f:
        f.truncate(whole - 5)  # the last record torn, as by a crash mid-append
    engine = open_engine(tmp_path, False)
    try:
        assert engine.recovery.cut_tails == 1 and engine.recovery.blocks == 7
        assert get(engine, "k7")[0] is ReadResult.MISSING
        assert all(get(engine, f"k{i}") == (ReadResult.OK, pattern(f"v{i}")) for i in range(7))
    finally:
        engine.close()
    assert idx.stat().st_size < whole - 5  # the cut is made on disk


def test_a_corrupted_index_record_ends_that_file_s_log(tmp_path):
    engine = open_engine(tmp_path, False)
    for i in range(4):
        put(engine, f"k{i}", pattern(f"v{i}"))
        engine.flush(60)
    engine.close()
    (idx,) = _index_files(tmp_path)
    data = bytearray(idx.read_bytes())
    record = len(data) // 4
    data[2 * record + 30] ^= 0xFF  # inside the third record
    idx.write_bytes(bytes(data))
    engine = open_engine(tmp_path, False)
    try:
        assert engine.contains([f"k{i}" for i in range(4)]) == [True, True, False, False]
        assert engine.recovery.cut_tails == 1
    finally:
        engine.close()


def test_corrupted_value_bytes_are_a_counted_miss_never_wrong_bytes(tmp_path, direct):
    engine = open_engine(tmp_path, direct)
    for i in range(4):
        put(engine, f"k{i}", pattern(f"v{i}"))
    engine.close()
    (seg,) = sorted(tmp_path.glob("*.seg"))
    with open(seg, "r+b") as f:  # k1 is the second value, 4 KiB aligned
        f.seek(VALUE + 1000)
        f.write(b"\x00\x01\x02")
    engine = open_engine(tmp_path, direct)
    try:
        assert engine.contains(["k1"]) == [True]  # only a read can tell
        assert get(engine, "k1")[0] is ReadResult.CORRUPT
        assert engine.snapshot().corrupt_reads == 1
        assert engine.contains(["k1"]) == [False]  # forgotten: the next lookup misses
        assert get(engine, "k1")[0] is ReadResult.MISSING
        for i in (0, 2, 3):
            assert get(engine, f"k{i}") == (ReadResult.OK, pattern(f"v{i}"))
    finally:
        engine.close()


def test_a_truncated_segment_keeps_the_values_before_the_cut(tmp_path):
    engine = open_engine(tmp_path, False)
    for i in range(4):
        put(engine, f"k{i}", pattern(f"v{i}"))
    engine.close()
    (seg,) = sorted(tmp_path.glob("*.seg"))
    os.truncate(seg, 2 * VALUE + 100)
    engine = open_engine(tmp_path, False)
    try:
        assert engine.contains([f"k{i}" for i in range(4)]) == [True, True, False, False]
        assert get(engine, "k1") == (ReadResult.OK, pattern("v1"))
    finally:
        engine.close()


def on_disk(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.glob("*.seg"))


def test_the_oldest_file_goes_first_when_the_tier_is_full(tmp_path, direct, caplog):
    # 4 MiB, in files of 1 MiB: 4 values each; 40 values written, the last 12-16 fit.
    engine = open_engine(tmp_path, direct, capacity=4 * MiB, file_size=1 * MiB)
    try:
        with caplog.at_level(logging.INFO, logger="kvsidecar.tiers"):
            for i in range(40):
                assert put(engine, f"k{i}", pattern(f"v{i}"))
                engine.flush(60)
                assert on_disk(tmp_path) <= 4 * MiB  # the capacity counts bytes on disk
        present = engine.contains([f"k{i}" for i in range(40)])
        assert present[:24] == [False] * 24 and present[-12:] == [True] * 12
        assert len(list(tmp_path.glob("*.seg"))) <= 4
        stats = engine.snapshot()
        assert stats.files <= 4 and stats.evicted_blocks >= 24 and stats.evicted_bytes == stats.evicted_blocks * VALUE
        # Every drop is told, with what it cost.
        drops = [r.getMessage() for r in caplog.records if "dropped file" in r.getMessage()]
        assert len(drops) == stats.evicted_blocks // 4, drops
        assert "dropped file 00000001 (4 blocks, 1.0 MiB) to make room for a new file; 3.0 of 4.0 MiB" in drops[0]
        for i in range(40):
            if present[i]:
                assert get(engine, f"k{i}") == (ReadResult.OK, pattern(f"v{i}"))
    finally:
        engine.close()
    engine = open_engine(tmp_path, direct, capacity=4 * MiB, file_size=1 * MiB)
    try:
        assert engine.contains([f"k{i}" for i in range(40)]) == present
    finally:
        engine.close()


def test_restarts_go_on_in_the_newest_file_and_keep_the_first_values(tmp_path, direct):
    """A crash-looping daemon that saves a little at each start: the tier keeps it all (bytes, not files, count)."""
    for i in range(12):  # as many starts as the tier has room for files of 2 MiB, and more
        engine = open_engine(tmp_path, direct, capacity=16 * MiB, file_size=2 * MiB)
        try:
            assert engine.recovery.blocks == i
            assert put(engine, f"k{i}", pattern(f"v{i}", 64 << 10))
            assert engine.flush(60)
        finally:
            engine.close()
    engine = open_engine(tmp_path, direct, capacity=16 * MiB, file_size=2 * MiB)
    try:
        assert engine.contains([f"k{i}" for i in range(12)]) == [True] * 12
        assert get(engine, "k0", 64 << 10) == (ReadResult.OK, pattern("v0", 64 << 10))
        assert engine.snapshot().evicted_blocks == 0
        assert len(list(tmp_path.glob("*.seg"))) == 1
    finally:
        engine.close()


def test_past_the_queue_bound_writes_are_skipped_and_counted(tmp_path):
    engine = open_engine(tmp_path, False, queue_bytes=VALUE - 1)
    try:
        assert not put(engine, "big", pattern("big"))
        assert put(engine, "small", pattern("small", VALUE // 2))
        engine.flush(60)
        assert engine.snapshot().skipped["queue_full"] == 1
        assert engine.contains(["big", "small"]) == [False, True]
    finally:
        engine.close()


def test_removals_are_durable_and_cancel_queued_writes(tmp_path, direct):
    engine = open_engine(tmp_path, direct)
    for i in range(6):
        put(engine, f"t1/k{i}", pattern(f"v{i}"))
    put(engine, "t2/k", pattern("t2"))
    engine.flush(60)
    assert engine.remove(["t1/k0", "absent"]) == [True, False]
    assert engine.remove_prefix("t1/", r"k[12]") == 2
    put(engine, "t1/queued", pattern("q"))
    assert engine.remove(["t1/queued"]) == [True]  # written or still queued: gone either way
    engine.flush(60)
    expected = [False, False, False, True, True, True, True, False]
    keys = [f"t1/k{i}" for i in range(6)] + ["t2/k", "t1/queued"]
    assert engine.contains(keys) == expected
    engine.close()
    engine = open_engine(tmp_path, direct)
    try:
        assert engine.contains(keys) == expected
        assert get(engine, "t1/k3") == (ReadResult.OK, pattern("v3"))
    finally:
        engine.close()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, capture_output=True
        )
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_filesystem_gives_back_old_files_then_keeps_writing(tmp_path):
    # Room for two 4 MiB files though the tier may hold 16: ENOSPC at the third is met by dropping the oldest.
    with small_tmpfs(tmp_path / "fs", "9m") as fs:
        engine = open_engine(fs, None)
        try:
            for i in range(48):
                put(engine, f"k{i}", pattern(f"v{i}"))
                engine.flush(60)
            present = engine.contains([f"k{i}" for i in range(48)])
            assert present[-8:] == [True] * 8 and not present[0]
            for i in range(48):
                if present[i]:
                    assert get(engine, f"k{i}") == (ReadResult.OK, pattern(f"v{i}"))
            assert engine.snapshot().skipped["no_space"] == 0
        finally:
            engine.close()


def test_a_filesystem_with_no_room_skips_every_write_and_counts_it_and_says_so_once(tmp_path, caplog):
    with small_tmpfs(tmp_path / "fs", "2m") as fs:
        engine = open_engine(fs, None)
        try:
            with caplog.at_level(logging.INFO, logger="kvsidecar"):
                for i in range(3):
                    assert put(engine, f"k{i}", pattern(f"v{i}"))  # queued: the failure comes at write time
                    engine.flush(60)
                assert engine.snapshot().skipped["no_space"] == 3
                assert engine.contains(["k0", "k1", "k2"]) == [False] * 3
                assert get(engine, "k0")[0] is ReadResult.MISSING
                assert engine.not_writing().startswith("disk tier NOT WRITING for ")
                assert "the filesystem is full (No space left on device) (3 values not written)" in engine.not_writing()
                # Room again: the next write lands (a new file is tried once a second meanwhile).
                subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)
                deadline = time.monotonic() + 60
                i = 3
                while not engine.contains([f"k{i - 1}"])[0] and time.monotonic() < deadline:
                    assert put(engine, f"k{i}", pattern(f"v{i}"))
                    engine.flush(60)
                    i += 1
                assert engine.contains([f"k{i - 1}"]) == [True] and engine.not_writing() == ""
            said = [r.getMessage() for r in caplog.records if r.name == "kvsidecar"]
            assert len(said) == 2, said  # one line when it stops writing, one when it writes again
            assert said[0].startswith(f"disk tier {fs}: not writing: the filesystem is full (No space left on device);")
            assert said[1].startswith(f"disk tier {fs}: writing again after ")
            assert said[1].endswith(f"; {i - 1} values were not written meanwhile")
        finally:
            engine.close()


def test_removals_the_full_filesystem_would_not_record_are_never_served_again_after_a_restart(tmp_path):
    # Every removal record past what the index file's last page holds meets ENOSPC: a removal that is not on disk
    # would bring its value back at the next start (a save revoked past its deadline holds bytes nobody may read).
    small = 4 << 10
    keys = [f"k{i:03d}" for i in range(200)]
    with small_tmpfs(tmp_path / "fs", "8m") as fs:
        engine = open_engine(fs, False)
        try:
            for key in keys:
                put(engine, key, pattern(key, small))
            engine.flush(60)
            assert engine.contains(keys) == [True] * len(keys)
            with open(fs / "filler", "wb") as filler, contextlib.suppress(OSError):  # the rest of the filesystem
                while True:
                    filler.write(b"\0" * (64 << 10))
                    filler.flush()
            engine.remove(keys)
            engine.flush(60)
            assert engine.contains(keys) == [False] * len(keys)
        finally:
            engine.close()
        (fs / "filler").unlink()
        engine = open_engine(fs, False)
        try:
            served = [key for key in keys if get(engine, key, small)[0] is ReadResult.OK]
            assert served == [], f"{len(served)} removed values served after the restart"
        finally:
            engine.close()


def test_a_key_written_removed_and_written_again_counts_once_after_recovery(tmp_path):
    engine = open_engine(tmp_path, False)
    put(engine, "k", pattern("first"))
    engine.flush(60)
    engine.remove(["k"])
    put(engine, "k", pattern("second"))
    put(engine, "other", pattern("other"))
    engine.close()
    engine = open_engine(tmp_path, False)
    try:
        assert (engine.recovery.blocks, engine.recovery.bytes) == (2, 2 * VALUE)
        assert get(engine, "k") == (ReadResult.OK, pattern("second"))
    finally:
        engine.close()


@contextlib.contextmanager
def failing_disk(tmp_path: Path):
    """ext4 on a loop device; the callable it yields takes the device away (capacity 0: every I/O fails)."""
    image, mount = tmp_path / "disk.img", tmp_path / "mnt"
    mount.mkdir()
    image.touch()
    os.truncate(image, 64 * MiB)
    try:
        loop = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"no loop device here (needs root): {exc}")
    device = loop.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", device], check=True, capture_output=True)
        subprocess.run(["mount", device, str(mount)], check=True, capture_output=True)

        def fail() -> None:
            os.truncate(image, 0)
            subprocess.run(["losetup", "-c", device], check=True, capture_output=True)

        try:
            yield mount, fail
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


def test_a_failing_disk_costs_misses_and_counted_skips_never_wrong_bytes(tmp_path):
    with failing_disk(tmp_path) as (mount, fail):
        engine = open_engine(mount / "ssd", None, capacity=32 * MiB)
        try:
            for i in range(8):
                put(engine, f"k{i}", pattern(f"v{i}"))
            engine.flush(60)
            assert all(get(engine, f"k{i}") == (ReadResult.OK, pattern(f"v{i}")) for i in range(8))
            fail()
            for seg in (mount / "ssd").glob("*.seg"):  # what the reads above cached must come from the device again
                fd = os.open(seg, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            for i in range(8, 16):
                assert put(engine, f"k{i}", pattern(f"v{i}"))  # queued: the failure comes at write time
            engine.flush(60)
            stats = engine.snapshot()
            assert stats.skipped["io_error"] + stats.skipped["no_space"] == 8, stats
            assert engine.contains([f"k{i}" for i in range(8, 16)]) == [False] * 8
            for i in range(8):
                result, data = get(engine, f"k{i}")
                assert result in (ReadResult.IO_ERROR, ReadResult.OK)
                assert result is ReadResult.IO_ERROR or data == pattern(f"v{i}")
            assert engine.snapshot().read_errors >= 1
        finally:
            engine.close()


WRITER = """
import ctypes, hashlib, sys
from kvsidecar.tiers.engine import DiskEngine
engine = DiskEngine(sys.argv[1], 64 << 20, queue_bytes=8 << 20, file_size=4 << 20)
print("ready", flush=True)
i = int(sys.argv[2])
while True:
    seed = hashlib.sha256(f"v{i}".encode()).digest()
    data = (seed * (65536 // 32))[: 65536 - 1000 * (i % 7)]
    buf = ctypes.create_string_buffer(data, len(data))
    engine.enqueue(f"k{i}", [ctypes.addressof(buf)], [len(data)])
    i += 1
"""


def test_killed_at_any_moment_it_serves_only_whole_values(tmp_path):
    """kill -9 a writing engine again and again: everything indexed reads back exact, nothing else is claimed."""
    start = 0
    for round_ in range(6):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(start)], stdout=subprocess.PIPE)
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        time.sleep(0.05 + 0.1 * round_)  # somewhere in the middle of batches, files and evictions
        child.kill()
        child.wait()
        engine = open_engine(tmp_path, None, file_size=4 * MiB)
        try:
            keys = indexed_keys(tmp_path)
            assert engine.recovery.blocks == len(keys)
            for key in keys:
                i = int(key[1:])
                seed = hashlib.sha256(f"v{i}".encode()).digest()
                want = (seed * (65536 // 32))[: 65536 - 1000 * (i % 7)]
                assert get(engine, key, len(want)) == (ReadResult.OK, want), key
            start = max((int(k[1:]) for k in keys), default=start) + 1_000_000
        finally:
            engine.close()


def test_prefetch_hands_adjacent_values_to_readahead_as_one_range_and_reads_stay_exact(tmp_path, monkeypatch):
    engine = open_engine(tmp_path, False)
    try:
        keys = [f"p{i}" for i in range(8)]
        for key in keys:
            assert put(engine, key, pattern(key))
        assert engine.flush(60)
        hints: list[tuple[int, int, int]] = []
        real = os.posix_fadvise

        def recorded(fd: int, offset: int, length: int, advice: int) -> None:
            if advice == os.POSIX_FADV_WILLNEED:
                hints.append((fd, offset, length))
            real(fd, offset, length, advice)  # the kernel still gets the hint

        monkeypatch.setattr(os, "posix_fadvise", recorded)
        engine.prefetch([*keys[::-1], "unknown"])  # any order; an unknown key is skipped
        engine._prefetcher.submit(lambda: None).result(timeout=60)  # the prefetch thread is done
        assert [(offset, length) for _, offset, length in hints] == [(0, 8 * VALUE)]  # one range, one file
        for key in keys:
            assert get(engine, key) == (ReadResult.OK, pattern(key))
    finally:
        engine.close()
    engine.prefetch(keys)  # after close: nothing to do, no error
