"""Recovery on its own: the index a directory's segment files hold, rebuilt without starting an engine."""

from __future__ import annotations

import ctypes
import os

from kvsidecar.tiers.engine import DiskEngine
from kvsidecar.tiers.recovery import Rebuilt, rebuild

MiB = 1 << 20
VALUE = 64 << 10


def put(engine: DiskEngine, key: str) -> None:
    data = ctypes.create_string_buffer(key.encode() * VALUE, VALUE)
    assert engine.enqueue(key, [ctypes.addressof(data)], [VALUE])
    engine.flush(60)  # one record per write, so the last one can be torn alone


def closed(found: Rebuilt) -> Rebuilt:
    for seg in found.segments.values():
        os.close(seg.rfd)
    return found


def test_the_index_replays_removals_and_a_torn_tail_is_cut_on_disk(tmp_path):
    engine = DiskEngine(tmp_path, 64 * MiB, queue_bytes=16 * MiB, file_size=4 * MiB, direct=False)
    for key in ("a", "b", "c"):
        put(engine, key)
    engine.remove(["b"])
    engine.close()
    found = closed(rebuild(tmp_path))
    assert (sorted(found.index), found.bytes, found.cut) == (["a", "c"], 2 * VALUE, 0)
    assert [(n, seg.keys) for n, seg in found.segments.items()] == [(1, {"a", "c"})]
    assert [found.index[k].offset for k in ("a", "c")] == [0, 2 * VALUE]
    (idx,) = tmp_path.glob("*.idx")
    whole = idx.stat().st_size
    with open(idx, "r+b") as f:
        f.truncate(whole - 3)  # the removal's record torn, as by a crash mid-append: it never happened
    found = closed(rebuild(tmp_path))
    assert (sorted(found.index), found.bytes, found.cut) == (["a", "b", "c"], 3 * VALUE, 1)
    assert idx.stat().st_size < whole - 3  # the cut is made on disk
    assert closed(rebuild(tmp_path)).cut == 0
