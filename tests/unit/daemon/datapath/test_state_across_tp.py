"""Rule 12 through the daemon's own data path: recurrent state written at one TP size, read at every other.

Writer ranks of TP Tw hold what vLLM 0.33 gives each rank of a hybrid (full attention, MLA and one recurrent layer
kind: Mamba2 with n_groups below, equal to and above T, gated delta net, KDA; conv state in both of vLLM's
layouts), as the byte oracle slices it from the whole model (kvsidecar_testing.states). They save a prompt through
DataPath into one in-memory store; reader ranks of TP Tr look it up and load it into fresh memory. Every reader rank
must get exactly its own bytes in every block it needs, and nothing else touched; every value must be written once.
"""

from __future__ import annotations

import itertools

import pytest

from kvsidecar.movers.trailer import TRAILER_BYTES, chosen
from kvsidecar_contract.placement import DEFAULT_CHECKSUM_EVERY
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.states import GatedDeltaNet, Kda, Mamba2, StateLayer
from support.stateranks import Attention, Engines, Latent, Model

TPS = (1, 2, 4, 8)
TOKENS = 64
WRITER_IDS = [1, 3, 5, 6]
READER_IDS = [7, 2, 0, 4]
LAYERS: dict[str, StateLayer] = {
    "mamba2, n_groups 1 (below T), SD": Mamba2(8, 4, 1, 4),
    "mamba2, n_groups 2, DS": Mamba2(8, 2, 2, 4, dim_first=True),
    "mamba2, n_groups 8 (T and above), SD": Mamba2(16, 2, 8, 2),
    "mamba2, n_groups 16 (above T), DS": Mamba2(16, 2, 16, 2, dim_first=True),
    "gated delta net, SD": GatedDeltaNet(8, 16, 2, 2),
    "gated delta net, DS, fp32 conv": GatedDeltaNet(8, 8, 4, 2, conv_bytes=4, dim_first=True),
    "kda, SD": Kda(8, 2),
}
CASES = [
    pytest.param(name, w, r, id=f"{name}-T{w}-to-T{r}")
    for name, w, r in itertools.product(LAYERS, TPS, TPS)
    if LAYERS[name].supports(w) and LAYERS[name].supports(r)
]


def per_index(model: Model) -> int:
    """share_tp_size giving one value per KV head and per state index (what `true` must send for a hybrid)."""
    sizes = [a.size for g in model.specs() if g.state is not None for a in g.state.axes]
    return max(model.kv_heads, *sizes)


def hashes() -> list[bytes]:
    return chained_hashes("prompt", TOKENS // 16)


@pytest.mark.parametrize(("name", "writer_tp", "reader_tp"), CASES)
def test_every_reader_rank_loads_exactly_its_own_state_from_any_writer_tp(name, writer_tp, reader_tp):
    model = Model((Attention(), Latent(), LAYERS[name]))
    share = per_index(model)
    engines = Engines(model)
    saved = engines.save(engines.ranks(writer_tp, share), hashes(), WRITER_IDS, TOKENS)
    assert all(not s.failures and not s.skipped for s in saved), saved
    # Every value once: no rank found another's value already there, and the store holds each distinct byte once
    # (exactly the bytes a TP=1 engine holds for the prompt, and the checksum trailers of the values chosen for one).
    assert sum(s.written for s in saved) == len(engines.store.keys())
    one = engines.ranks(1, share)[0]
    trailers = TRAILER_BYTES * sum(chosen(key, DEFAULT_CHECKSUM_EVERY) for key in engines.store.keys())
    assert engines.store.used_bytes == len(WRITER_IDS) * sum(r.block_bytes for r in one.regions) + trailers
    for rank in engines.ranks(reader_tp, share):
        hit = engines.lookup(rank, hashes(), TOKENS + 1)
        assert hit.hit_tokens == TOKENS, f"reader rank {rank.rank}: {hit}"
        assert engines.load(rank, hashes(), READER_IDS, hit) == []
        assert engines.expected(rank, hashes(), READER_IDS, TOKENS) == []


@pytest.mark.parametrize("device", [False, True], ids=["host path", "device path"])
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (4, 8), (8, 2)])
def test_a_mix_of_every_layer_kind_and_pieces_of_several_heads(writer_tp, reader_tp, device):
    # share_tp_size 8 is not per index here: pieces of 2 Mamba2 heads, 2 GDN v heads, one k head, one KDA head.
    # The device path (a CPU standing in for the GPU) gathers values of different sizes in one batch.
    model = Model((Attention(), Mamba2(16, 2, 1, 2), Latent(), GatedDeltaNet(8, 16, 2, 2), Kda(8, 2)), kv_heads=8)
    engines = Engines(model, device)
    try:
        writers = engines.ranks(writer_tp, 8)
        movers = {type(w.session.require_mover()).__name__ for w in writers}
        assert movers == {"DeviceMover" if device else "HostMover"}
        saved = engines.save(writers, hashes(), WRITER_IDS, TOKENS)
        assert all(not s.failures and not s.skipped for s in saved)
        for rank in engines.ranks(reader_tp, 8):
            hit = engines.lookup(rank, hashes(), TOKENS + 1)
            assert hit.hit_tokens == TOKENS
            assert engines.load(rank, hashes(), READER_IDS, hit) == []
            assert engines.expected(rank, hashes(), READER_IDS, TOKENS) == []
    finally:
        engines.close()


def test_state_kept_per_layout_is_a_miss_for_another_tp_size_never_its_bytes():
    # Without sharing (today's keys) and with sharing against per-layout values: the reader never finds a value.
    model = Model((Attention(), Mamba2(8, 4, 1, 4)))
    for writer_share, reader_share in ((0, 0), (0, per_index(model)), (per_index(model), 0)):
        engines = Engines(model)
        engines.save(engines.ranks(2, writer_share), hashes(), WRITER_IDS, TOKENS)
        for rank in engines.ranks(4, reader_share):
            assert engines.lookup(rank, hashes(), TOKENS + 1).hit_tokens == 0


def test_one_missing_piece_rejects_the_boundary_for_every_reader():
    # The quorum is every piece: without one head's state at 64, no reader of any TP size hits 64 (it falls to 48).
    model = Model((Attention(), Mamba2(8, 4, 1, 4)))
    share = per_index(model)
    engines = Engines(model)
    engines.save(engines.ranks(2, share), hashes(), WRITER_IDS, TOKENS)
    head5 = [k for k in engines.store.keys() if ".g1@" in k and "@s5." in k and k.endswith(hashes()[3].hex())]
    assert len(head5) == 1
    engines.store.remove(head5)
    for tp in TPS:
        assert {engines.lookup(r, hashes(), TOKENS + 1).hit_tokens for r in engines.ranks(tp, share)} == {48}
