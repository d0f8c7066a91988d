"""End-to-end checksums against a real mooncake_master and a real daemon: bytes that are not the ones saved (another
writer under the key, a copy the disk tier summed after it went bad) are never served; the block is reported failed
(the engine recomputes it), counted, logged with the key, and removed, so the engine's next save writes it again.

Each test has a master of its own: a raw Mooncake client without a segment of its own overwrites a value (Mooncake's
upsert, with other bytes and the old trailer), so the new bytes land in the daemon's own segment, where a device
load copies from.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.movers.trailer import TRAILER_BYTES
from kvsidecar.rpc import wire
from kvsidecar.store.native import ensure_native_libs
from kvsidecar.tiers.records import PUT, Record, decode, encode, segment_numbers, value_checksum
from kvsidecar_client import EngineLayout, SidecarClient, shared_tensor
from kvsidecar_client import GroupSpec as ClientGroup
from kvsidecar_contract.placement import Geometry, save_plan
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.processes import DaemonProcess

pytestmark = pytest.mark.integration

U = 16
BLOCKS = 4
ROWS = 64  # fp16 values per token: a block of 2 KiB


@contextmanager
def raw_client(master: EmbeddedMaster) -> Iterator[Any]:
    """Mooncake's own client, without a segment: what another writer of the cluster would use."""
    ensure_native_libs()
    from mooncake.store import MooncakeDistributedStore

    native = MooncakeDistributedStore()
    assert native.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    try:
        yield native
    finally:
        native.close()


@contextmanager
def rank(daemon: DaemonProcess, tag: str) -> Iterator[tuple[SidecarClient, torch.Tensor]]:
    """An engine rank of the daemon: its KV cache (2 x BLOCKS blocks) registered; closed before the daemon stops."""
    kv = shared_tensor((2 * BLOCKS, U, ROWS), torch.float16)
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(len(tag))).to(torch.float16))
    client = SidecarClient.connect(
        daemon.target, model=f"org/{tag}", layout=EngineLayout(), num_kv_heads=1, hash_block_size=U,
        groups=[ClientGroup("full_attention", block_size=U)],
    )  # fmt: skip
    try:
        client.register([kv], groups_of_tensor=[(0,)])
        yield client, kv
    finally:
        client.close()


def keys_of(client: SidecarClient, hashes: list[bytes], every: int) -> list[str]:
    """The keys the daemon writes the request under: its layout, with its --checksums rule."""
    layout = dataclasses.replace(wire.open_request(client.spec.to_proto())[1], checksum_every=every)
    return [c.key for c in save_plan(Geometry.of(layout), hashes, [list(range(len(hashes)))], len(hashes) * U).chunks]


def overwrite_one_byte(raw: Any, key: str, value_bytes: int) -> None:
    """Another writer's bytes under key: the stored value with one byte of its block changed, its trailer kept."""
    buffer = (ctypes.c_uint8 * (value_bytes + TRAILER_BYTES))()
    address = ctypes.addressof(buffer)
    assert raw.get_into(key, address, len(buffer)) == len(buffer)
    buffer[value_bytes // 2] ^= 0x40
    assert raw.upsert_from(key, address, len(buffer)) == 0


def mismatches(daemon: DaemonProcess) -> tuple[float, float]:
    """Values whose checksum failed, and blocks failed for it."""
    found = daemon.metric_samples("kvsidecar_value_checksums_total", "outcome").get("mismatch", 0.0)
    failed = daemon.metric_samples("kvsidecar_load_failed_blocks_total", "reason").get("checksum_mismatch", 0.0)
    return found, failed


def load_back(client: SidecarClient, hashes: list[bytes]) -> set[int]:
    hit = client.lookup(hashes, len(hashes) * U + 1)
    assert hit.hit_tokens == len(hashes) * U
    return client.load(hashes, [list(range(BLOCKS, 2 * BLOCKS))], hit)


def recomputed_then_saved_again(client: SidecarClient, kv: torch.Tensor, hashes: list[bytes]) -> None:
    """The engine recomputes the failed block and saves it again: the next load is whole and exact."""
    assert client.save(hashes, [list(range(BLOCKS))], BLOCKS * U).result().written == 1
    kv[BLOCKS:] = 0
    assert load_back(client, hashes) == set()
    assert torch.equal(kv[BLOCKS:], kv[:BLOCKS])


@pytest.mark.parametrize("path", ["host", "device"])
def test_another_writers_bytes_in_the_segment_are_recomputed_counted_and_never_served(
    mooncake_client_env, tmp_path, path
):
    extra = ("--checksums", "all", *(("--gpu", "cpu") if path == "device" else ()))
    with EmbeddedMaster(lease_ttl_ms=200) as master, raw_client(master) as raw:
        daemon = DaemonProcess(tmp_path, master=master.address, extra=extra).start()
        try:
            with rank(daemon, path) as (client, kv):
                hashes = chained_hashes(path, BLOCKS)
                assert client.save(hashes, [list(range(BLOCKS))], BLOCKS * U).result().written == BLOCKS
                keys = keys_of(client, hashes, every=1)
                overwrite_one_byte(raw, keys[2], kv[0].numel() * kv.element_size())
                assert load_back(client, hashes) == {BLOCKS + 2}
                assert all(torch.equal(kv[BLOCKS + b], kv[b]) for b in (0, 1, 3))
                assert mismatches(daemon) == (1, 1)
                assert keys[2] in daemon.log() and "failed their checksum" in daemon.log()
                assert raw.is_exist(keys[2]) == 0  # removed: a put never replaces, the engine's save writes it again
                recomputed_then_saved_again(client, kv, hashes)
        finally:
            assert daemon.stop() == 0, daemon.log()


def test_bytes_the_disk_tier_summed_after_they_went_bad_fail_after_a_restart(mooncake_client_env, tmp_path):
    # The disk tier checks its own records (a flipped byte on disk is its miss: tests/integration/test_ssd_tier.py);
    # what went bad before the tier summed it (its copy, the DRAM it copied from) passes that check, and only the
    # daemon's checksum from the bytes put catches it: here, a value rewritten on disk with its record's sum redone.
    ssd = tmp_path / "ssd"
    extra = ("--checksums", "all", "--ssd-dir", str(ssd), "--ssd-size", "64MiB", "--segment-size", "16MiB")
    daemon = DaemonProcess(tmp_path, extra=extra).start()
    try:
        with rank(daemon, "disk") as (client, kv):
            hashes = chained_hashes("disk", BLOCKS)
            assert client.save(hashes, [list(range(BLOCKS))], BLOCKS * U).result().written == BLOCKS
            keys = keys_of(client, hashes, every=1)
            saved = kv[:BLOCKS].clone()
    finally:
        assert daemon.stop() == 0, daemon.log()  # the write queue is written out before it exits
    rewrite_on_disk(ssd, keys[1])
    daemon = DaemonProcess(tmp_path, extra=extra).start()  # its embedded master is a new one: DRAM is empty
    try:
        with rank(daemon, "disk") as (client, kv):
            assert load_back(client, hashes) == {BLOCKS + 1}
            assert all(torch.equal(kv[BLOCKS + b], saved[b]) for b in (0, 2, 3))
            assert mismatches(daemon) == (1, 1)
    finally:
        assert daemon.stop() == 0, daemon.log()


def rewrite_on_disk(ssd: Path, key: str) -> None:
    """Change one byte of key's value in its segment file and append its record again with the tier's checksum of
    the changed bytes (the index's last record of a key wins at recovery)."""
    for number in segment_numbers(ssd):
        idx, seg = ssd / f"{number:08d}.idx", ssd / f"{number:08d}.seg"
        for record in decode(idx.read_bytes())[0]:
            if record.kind == PUT and record.key == key:
                with open(seg, "r+b") as f:
                    f.seek(record.offset)
                    value = bytearray(f.read(record.length))
                    value[len(value) // 3] ^= 0x01
                    f.seek(record.offset)
                    f.write(value)
                with open(idx, "ab") as f:
                    f.write(encode(Record(PUT, key, record.offset, record.length, value_checksum([memoryview(value)]))))
                return
    raise AssertionError(f"{key} is on no segment file of {ssd}")
