"""A hybrid's recurrent state across TP sizes (docs/placement.md rule 12), through a real daemon and a real master.

Ranks of one TP size hold a Mamba2 + attention hybrid as vLLM 0.33 slices it (every state page built by the byte
oracle, `kvsidecar_testing.states`, padded as vLLM pads Mamba pages to the attention page; attention heads as
vLLM's CPU backend holds them), describe the state through the client (`GroupSpec.state`, the wire's
RecurrentState) and save a prompt; ranks of another TP size look it up from their own sessions and load it: every
byte of the state at the hit is what the reader's own rank holds there, as the oracle says, and nothing else moved.
With n_groups = 1 the one B/C group is repeated on every rank of T = 2 (written once, striped); with n_groups = 2 each
TP=2 rank holds its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvsidecar_client import EngineLayout, GroupSpec, InvalidRequest, SidecarClient, shared_tensor
from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.states import Mamba2

pytestmark = pytest.mark.integration

HEADS = 2  # attention's KV heads
BLOCKS = 4
NUM_BLOCKS = 8
LAYERS = 2  # recurrent layers
PADDING = 24  # bytes past each page: vLLM pads a Mamba page to the attention page; never part of a value
POISON = 0xA5
HASHES = [bytes([7, i]) * 16 for i in range(1, BLOCKS + 1)]  # four blocks of 16 tokens
TOKENS = 16 * BLOCKS


WHOLE = torch.randn((2, BLOCKS, HEADS, 16, 32), generator=torch.Generator().manual_seed(5)).half()


class Rank:
    """One engine rank of TP tp: a session, attention K and V, and a padded state page per layer and block."""

    def __init__(self, daemon: DaemonProcess, prefix: str, layer: Mamba2, tp: int, r: int) -> None:
        self.layer, self.tp, self.r = layer, tp, r
        state = layer.state()
        groups = [GroupSpec("full_attention", 16), GroupSpec("mamba", 16, state=state)]
        self.client = SidecarClient.connect(
            daemon.target, model="org/Granite", layout=EngineLayout(tp_size=tp, tp_rank=r), num_kv_heads=HEADS,
            hash_block_size=16, groups=groups, cache_prefix=prefix, value_identity="w", share_across_tp=True,
        )  # fmt: skip
        self.page = state.layer_bytes(tp)
        conv, _ = state.tensor_bytes(tp)
        self.kv = shared_tensor((2, NUM_BLOCKS, max(1, HEADS // tp), 16, 32), torch.float16)
        self.pages = [shared_tensor((NUM_BLOCKS, self.page + PADDING), torch.uint8) for _ in range(LAYERS)]
        for page in self.pages:
            page.fill_(POISON)
        # As the connector registers a Mamba layer: its state tensors (conv, then temporal), each a view of the page.
        parts = [t for page in self.pages for t in (page[:, :conv], page[:, conv : self.page])]
        self.client.register(
            [self.kv[0], self.kv[1], *parts],
            groups_of_tensor=[(0,), (0,), *[(1,)] * len(parts)],
            head_dims=[1, 1, *[None] * len(parts)],
        )

    def oracle(self, layer: int, block: int) -> bytes:
        """The state this rank holds in a layer after the tokens up to block `block`'s end (its prompt prefix)."""
        return self.layer.page(f"l{layer}|{HASHES[block].hex()}", self.tp, self.r)

    def attention(self) -> torch.Tensor:
        """The prompt's K and V of this rank's KV heads (the whole model's, sliced by head as vLLM does)."""
        per = HEADS // self.tp
        return WHOLE[:, :, self.r * per : (self.r + 1) * per]

    def prefill(self) -> None:
        """Blocks 0-3 hold the prompt: attention of every token (the whole model's, sliced by head) and the state."""
        self.kv[:, :BLOCKS] = self.attention()
        for layer, page in enumerate(self.pages):
            for block in range(BLOCKS):
                page[block, : self.page] = torch.frombuffer(bytearray(self.oracle(layer, block)), dtype=torch.uint8)

    def save(self) -> int:
        ids = list(range(BLOCKS))
        saved = self.client.save(HASHES, [ids, ids], TOKENS).result(timeout=60)
        assert saved.failed == 0, saved
        return int(saved.written)

    def close(self) -> None:
        self.client.close()


@contextlib.contextmanager
def engine(daemon: DaemonProcess, prefix: str, layer: Mamba2, tp: int) -> Iterator[list[Rank]]:
    ranks: list[Rank] = []
    try:
        for r in range(tp):
            ranks.append(Rank(daemon, prefix, layer, tp, r))
        yield ranks
    finally:
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group-repeated", "two-groups"])
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_a_hybrids_state_written_at_one_tp_size_is_read_byte_exact_at_another(
    daemon, key_prefix, writer_tp, reader_tp, groups
):
    layer = Mamba2(8, 4, groups, 8, conv_kernel=4, conv_bytes=2, ssm_bytes=4)
    with engine(daemon, key_prefix, layer, writer_tp) as writers:
        for w in writers:
            w.prefill()
        written = sum(w.save() for w in writers)
        # Every distinct byte once: per block, each attention head (2) and each state piece (8 heads, the groups).
        assert written == BLOCKS * (HEADS + 8 + groups)
        with engine(daemon, key_prefix, layer, reader_tp) as readers:
            for reader in readers:
                hit = reader.client.lookup(HASHES, TOKENS + 1)
                assert hit.hit_tokens == TOKENS
                target = [4, 5, 6, 7]
                assert reader.client.load(HASHES, [target, target], hit) == set()
                assert torch.equal(reader.kv[:, 4:8], reader.attention())
                for layer_index, page in enumerate(reader.pages):
                    # The state at the hit (block 3's end) lands in block 7, exactly as this rank holds it.
                    got = bytes(page[7, : reader.page].numpy())
                    assert got == reader.oracle(layer_index, BLOCKS - 1), (reader.tp, reader.r, layer_index)
                    # No other block, and no padding, was written.
                    assert bytes(page[7, reader.page :].numpy()) == bytes([POISON]) * PADDING
                    assert all(bytes(page[b].numpy()) == bytes([POISON]) * (reader.page + PADDING) for b in (4, 5, 6))


def test_a_state_a_tp_size_cannot_hold_in_whole_pieces_is_refused_at_open_with_the_reason(daemon, key_prefix):
    layer = Mamba2(8, 4, 2, 8)
    with pytest.raises(InvalidRequest, match="state axis groups of 2 cannot be sharded over 4 TP ranks"):
        Rank(daemon, key_prefix, layer, 4, 0)
