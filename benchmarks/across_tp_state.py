"""A hybrid's recurrent state across TP sizes (docs/placement.md rule 12): write volume and load rate, one run.

    python benchmarks/across_tp_state.py [--blocks 4] [--mamba-layers 36] [--attention-layers 4] [--heads 128]
                                         [--n-groups 1] [--conv-ds] [--writer-tp 2] [--rounds 25]

One real daemon with its embedded Mooncake master, as `benchmarks/across_tp.py` (whose save and load helpers this
uses). A Granite-4-like hybrid: Mamba2 layers of `heads` heads of 64 x state 128, `n-groups` B/C groups, conv
kernel 4 (its state (window, channels), vLLM's default "SD", or with --conv-ds "DS"), conv and temporal state 2
bytes (bf16, vLLM's default state dtype for such a model), one page per layer and block as vLLM 0.33 holds it
(conv state then temporal state, `kvsidecar_testing.states.Mamba2` has the oracle); and attention layers of 8 KV
heads of 128 fp16, 16-token blocks, head-major. A writer engine of TP `writer-tp` (each rank a client session, all
ranks at once) saves the prompt three times: per layout (`share_across_tp` off, the state one opaque value per
rank and block), per head (`true`: the state in one piece per head and per B/C group, the repeated group written
once) and cut as a TP=`writer-tp` engine holds its heads (`writer-tp`). Then readers load it, all their ranks at
once, rounds interleaved: a same-TP reader of the per-layout values (the baseline), same-TP, TP=1 and TP=4 readers
of the per-head values, and same-TP and TP=1 readers of the values cut at the writer's TP.

A hit loads attention for every block of the prompt and the state only at the hit (the last block), as vLLM
resumes a recurrent layer from its state there; the load rate is over those bytes. Prints bytes written per
distinct byte of the model (each B/C group counted once), the values per block and the state values' sizes, and each
reader's GiB/s with the ratio to the same-TP per-layout reader, median of the rounds.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from across_tp import BLOCK, HEAD_SIZE, report_loads, save_all

from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor
from kvsidecar_contract.placement import share_tp_size_of
from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.states import Mamba2

KV_HEADS = 8
MIB = 1 << 20


def mamba(args: argparse.Namespace) -> Mamba2:
    return Mamba2(args.heads, 64, args.n_groups, 128, conv_kernel=4, conv_bytes=2, ssm_bytes=2, dim_first=args.conv_ds)


def state_values(args: argparse.Namespace, share: bool | int) -> str:
    """The size of one block's state values in KiB, as the contract cuts them: per layout one per rank, else one per
    piece (heads' pieces, then the B/C groups')."""
    state = mamba(args).state()
    if not share:
        return f"{args.mamba_layers * state.layer_bytes(args.writer_tp) / 1024:.0f} (whole rank)"
    n = share_tp_size_of(share, KV_HEADS, [GroupSpec("mamba", BLOCK, state=state)])
    sizes = {state.axes[p.axis].name: args.mamba_layers * state.piece_bytes(p) / 1024 for p in state.pieces(n)}
    return ", ".join(f"{size:.1f} ({name})" for name, size in sizes.items())


class HybridRank:
    """One engine rank: its session, its attention K and V, and one state page per Mamba2 layer and block."""

    def __init__(self, target: str, tp: int, r: int, args: argparse.Namespace, share: bool | int, prefix: str) -> None:
        state = mamba(args).state()
        # As the connector: the state's layout is described only when shared; otherwise it is opaque, per layout.
        groups = [GroupSpec("full_attention", BLOCK), GroupSpec("mamba", BLOCK, state=state if share else None)]
        self.client = SidecarClient.connect(
            target, model="bench/Granite", layout=EngineLayout(tp_size=tp, tp_rank=r), num_kv_heads=KV_HEADS,
            hash_block_size=BLOCK, groups=groups, cache_prefix=prefix, value_identity="bench", share_across_tp=share,
        )  # fmt: skip
        heads = max(1, KV_HEADS // tp)
        self.kv = shared_tensor((2 * args.attention_layers, args.blocks, heads, BLOCK, HEAD_SIZE), torch.float16)
        self.page = state.layer_bytes(tp)
        conv, _ = state.tensor_bytes(tp)
        self.pages = [shared_tensor((args.blocks, self.page), torch.uint8) for _ in range(args.mamba_layers)]
        # As the connector registers a Mamba layer: its state tensors (conv, then temporal), each a view of the page.
        state_parts = [t for page in self.pages for t in (page[:, :conv], page[:, conv:])]
        kv_parts = [self.kv[i] for i in range(2 * args.attention_layers)]
        self.client.register(
            [*kv_parts, *state_parts],
            groups_of_tensor=[*[(0,)] * len(kv_parts), *[(1,)] * len(state_parts)],
            head_dims=[*[1] * len(kv_parts), *[None] * len(state_parts)],
        )

    def fill(self, seed: int) -> None:
        """Random bytes (so a repeated B/C group differs between ranks here: only the rate is measured; the bytes are
        checked in tests/integration/test_state_sharing.py)."""
        gen = torch.Generator().manual_seed(seed)
        self.kv.copy_(torch.randn(self.kv.shape, generator=gen))
        for page in self.pages:
            page.copy_(torch.randint(0, 256, page.shape, generator=gen, dtype=torch.uint8))

    @property
    def nbytes(self) -> int:
        """What a hit on the whole prompt lands here: K and V of every block, each layer's state at the last."""
        return self.kv.numel() * self.kv.element_size() + len(self.pages) * self.page

    def close(self) -> None:
        self.client.close()


def engine(target: str, tp: int, args: argparse.Namespace, share: bool | int, prefix: str) -> list[HybridRank]:
    return [HybridRank(target, tp, r, args, share, prefix) for r in range(tp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--mamba-layers", type=int, default=36)
    parser.add_argument("--attention-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--n-groups", type=int, default=1)
    parser.add_argument(
        "--conv-ds", action="store_true", help="conv state (channels, window): VLLM_SSM_CONV_STATE_LAYOUT=DS"
    )
    parser.add_argument("--writer-tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=25)  # each load is ~40 MiB: many rounds for a stable median
    args = parser.parse_args()
    hashes = [i.to_bytes(4, "big") * 8 for i in range(1, args.blocks + 1)]
    tokens = BLOCK * args.blocks
    state = mamba(args).state()
    # The model's distinct bytes: at T=1 every head and every B/C group once.
    attention = 2 * args.attention_layers * args.blocks * KV_HEADS * BLOCK * HEAD_SIZE * 2
    distinct = attention + args.mamba_layers * args.blocks * state.layer_bytes(1)
    segment = f"{4 * distinct // MIB + 256}MiB"  # three writers, whole values of up to 36 MiB
    w = args.writer_tp
    with tempfile.TemporaryDirectory() as work:
        daemon = DaemonProcess(Path(work), segment_size=segment, local_buffer_size=None, log_level="warning").start()
        try:
            rows = []
            cut = f"cut at TP={w}"
            shares: dict[str, bool | int] = {"per layout": False, "per head": True, cut: w}
            for i, (name, share) in enumerate(shares.items()):
                ranks = engine(daemon.target, w, args, share, name)
                for r, rank in enumerate(ranks):
                    rank.fill(10 * i + r)
                written, values = save_all(ranks, hashes, tokens, groups=2)
                rows.append((name, written / distinct, values / args.blocks, state_values(args, share)))
                for rank in ranks:
                    rank.close()
            print(
                f"# across TP, hybrid: {args.mamba_layers} Mamba2 layers ({args.heads} heads of 64 x state 128, "
                f"{args.n_groups} B/C group(s), conv 4 {'DS' if args.conv_ds else 'SD'}, 2-byte state) + "
                f"{args.attention_layers} attention layers "
                f"(GQA H={KV_HEADS}), {args.blocks} blocks of {BLOCK} tokens,"
            )
            print(f"# writer TP={w}, {distinct / MIB:.1f} MiB of distinct bytes\n")
            print("| writer | bytes written / distinct bytes | values per block | KiB per state value |")
            print("| --- | --- | --- | --- |")
            for name, ratio, per_block, sizes in rows:
                print(f"| TP={w}, {name} | {ratio:.4f} | {per_block:g} | {sizes} |")
            readers = {
                f"TP={w} reader, per-layout values": engine(daemon.target, w, args, False, "per layout"),
                f"TP={w} reader, per-head values": engine(daemon.target, w, args, True, "per head"),
                "TP=1 reader, per-head values": engine(daemon.target, 1, args, True, "per head"),
                "TP=4 reader, per-head values": engine(daemon.target, 4, args, True, "per head"),
                f"TP={w} reader, values {cut}": engine(daemon.target, w, args, w, cut),
                f"TP=1 reader, values {cut}": engine(daemon.target, 1, args, w, cut),
            }
            report_loads(readers, hashes, tokens, args.rounds, groups=2)
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
