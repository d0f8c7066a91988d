"""PackedHashes is a Sequence of bytes like a list of the same hashes (test_staged checks that lookups of packed hashes
ask the same keys and answer the same)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar_contract.placement import PackedHashes
from kvsidecar_contract.placement.keys import hash_suffixes


@given(st.integers(1, 40), st.integers(0, 50), st.data())
def test_indexing_slicing_and_iterating_match_the_list(width, n, data):
    hashes = [data.draw(st.binary(min_size=width, max_size=width)) for _ in range(n)]
    packed = PackedHashes.of(hashes, width)
    assert len(packed) == n and list(packed) == hashes
    assert hash_suffixes(packed) == hash_suffixes(hashes) == ["@" + h.hex() for h in hashes]
    if n:
        i = data.draw(st.integers(-n, n - 1))
        assert packed[i] == hashes[i]
    start, stop = data.draw(st.integers(-n - 2, n + 2)), data.draw(st.integers(-n - 2, n + 2))
    step = data.draw(st.sampled_from([None, 1, 2, 3, -1]))
    part = packed[start:stop:step]
    assert isinstance(part, PackedHashes) and list(part) == hashes[start:stop:step]
    assert part == PackedHashes.of(hashes[start:stop:step], width)


def test_out_of_range_and_misaligned_input_are_refused():
    packed = PackedHashes(b"ab" * 3, 2)
    with pytest.raises(IndexError, match="hash index 3 out of range for 3 hashes"):
        packed[3]
    with pytest.raises(IndexError):
        packed[-4]
    with pytest.raises(ValueError, match="5 bytes are not a whole number of 2-byte hashes"):
        PackedHashes(b"abcde", 2)
    with pytest.raises(ValueError, match="at least 1 byte"):
        PackedHashes(b"", 0)
    # One short and one long hash add up to the right length: still named, by the first that is wrong.
    with pytest.raises(ValueError, match="block hash 1 has 31 bytes, the session declared 32"):
        PackedHashes.of([b"a" * 32, b"b" * 31, b"c" * 33], 32)
    with pytest.raises(TypeError):
        PackedHashes.of(["not bytes"], 9)  # type: ignore[list-item]
    assert len(PackedHashes.of([], 32)) == 0
