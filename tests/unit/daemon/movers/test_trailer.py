"""The checksum trailer's exact bytes, what passes its check, and the rule that chooses which values carry one."""

from __future__ import annotations

import dataclasses

import pytest
import xxhash

from kvsidecar.movers.trailer import TRAILER_BYTES, ChecksumSettings, chosen, digest, sealed, verdict
from kvsidecar_contract.placement import DEFAULT_CHECKSUM_EVERY, GroupSpec, InvalidLayout, Kind, Layout


def test_a_trailer_is_magic_algorithm_padding_and_the_sum_little_endian():
    assert sealed(0x0102030405060708) == b"kvsT\x01\x00\x00\x00" + bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert len(sealed(0)) == TRAILER_BYTES


def test_the_sum_is_xxh3_over_the_key_then_the_bytes_however_they_are_cut():
    value = bytes(range(256)) * 64
    whole = digest("key", [memoryview(value)])
    assert whole == xxhash.xxh3_64_intdigest(b"key" + value)
    assert digest("key", [memoryview(value)[:7], memoryview(value)[7:4000], memoryview(value)[4000:]]) == whole
    # The same bytes under another key: a value served under a key not its own fails its check.
    assert digest("other", [memoryview(value)]) != whole


@pytest.mark.parametrize(
    "damage",
    [
        lambda t: b"kvsX" + t[4:],  # another magic: no trailer of ours
        lambda t: t[:4] + b"\x02" + t[5:],  # an algorithm this daemon does not know
        lambda t: t[:6] + b"\x01" + t[7:],  # padding that is not zero
        lambda t: t[:8] + bytes([t[8] ^ 1]) + t[9:],  # one bit of the sum flipped
        lambda t: t[:15],  # torn
        lambda t: bytes(16),  # a raw writer's zeros
    ],
    ids=["magic", "algorithm", "padding", "sum", "short", "zeros"],
)
def test_only_the_exact_trailer_of_the_bytes_read_passes(damage):
    total = digest("key", [memoryview(b"value")])
    assert verdict(sealed(total), total)
    assert verdict(memoryview(sealed(total)), total)
    assert not verdict(damage(sealed(total)), total)
    assert not verdict(sealed(total), total ^ 1)  # the bytes read are not the bytes sealed


def test_the_rule_chooses_none_all_or_one_key_in_n_by_the_keys_hash():
    keys = [f"kvs1@@M~id@s0.c0.d0.p0.g0@{i:064x}" for i in range(4096)]
    assert not any(chosen(k, 0) for k in keys)
    assert all(chosen(k, 1) for k in keys)
    picked = [k for k in keys if chosen(k, 16)]
    assert picked == [k for k in keys if xxhash.xxh3_64_intdigest(k.encode()) % 16 == 0]
    assert 4096 / 16 * 0.75 < len(picked) < 4096 / 16 * 1.25
    # Exact, so that every writer and reader of a key agrees (pinned: a change is a change of the value format).
    assert [f"k{i}" for i in range(64) if chosen(f"k{i}", 16)] == ["k6", "k13", "k16", "k25", "k61"]


def test_the_settings_map_onto_the_rule_in_the_value_id():
    assert ChecksumSettings().checksum_every == DEFAULT_CHECKSUM_EVERY == 32
    assert ChecksumSettings("sampled", 4).checksum_every == 4
    assert ChecksumSettings("all", 4).checksum_every == 1
    assert ChecksumSettings("off").checksum_every == 0
    with pytest.raises(ValueError, match="checksums must be one of off, sampled, all"):
        ChecksumSettings("some")
    with pytest.raises(ValueError, match="checksum-every must be >= 1"):
        ChecksumSettings("sampled", 0)


def test_the_rule_is_part_of_the_value_id():
    base = Layout("org/M", (GroupSpec(Kind.FULL_ATTENTION, 16),))
    ids = {dataclasses.replace(base, checksum_every=n).value_id for n in (0, 1, 4, DEFAULT_CHECKSUM_EVERY)}
    assert len(ids) == 4 and base.value_id in ids
    with pytest.raises(InvalidLayout, match="checksum_every must be >= 0"):
        dataclasses.replace(base, checksum_every=-1)
