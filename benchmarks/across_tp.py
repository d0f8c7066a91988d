"""One cache across TP sizes (docs/placement.md rule 11): write volume and load throughput, side by side in one run.

    python benchmarks/across_tp.py [--blocks 256] [--layers 8] [--heads 8] [--writer-tp 2] [--reader-tp 4]
                                   [--rounds 5]

One real daemon with its embedded Mooncake master. A GQA model (H KV heads of 128 fp16, 16-token blocks, K and V
per layer, head-major like vLLM CPU's cache) is saved by a writer engine of TP `writer-tp`, each rank a client
session of its own, all ranks at once, three times: per layout (share_across_tp off, the default), per KV head
(share_across_tp true) and cut as the writer holds its heads (share_across_tp = writer-tp). Then read by:

- a same-TP reader of the per-layout values (the baseline),
- a same-TP reader and a reader of TP `reader-tp` of the per-head values,
- a same-TP reader and a TP=1 reader of the values cut at the writer's TP,

each reader's ranks loading at once, rounds interleaved. Prints the bytes written per distinct byte (1.0: each
byte once) and the values per save, and the load rate of each reader in GiB/s with the ratio to the same-TP
per-layout reader, median of the rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor
from kvsidecar_testing.processes import DaemonProcess

GIB = 1 << 30
BLOCK = 16
HEAD_SIZE = 128


class Loader(Protocol):
    """An engine rank as save_all and load_all use it (benchmarks/across_tp_state.py has another)."""

    client: SidecarClient

    @property
    def nbytes(self) -> int:
        """Bytes a load of the whole prompt lands on this rank."""
        ...

    def close(self) -> None:
        """End the rank's session."""
        ...


class Rank:
    """One engine rank: its session and its KV cache (2 x layers tensors of (blocks, heads, 16, 128) fp16)."""

    def __init__(self, target: str, tp: int, r: int, args: argparse.Namespace, share: bool | int, prefix: str) -> None:
        heads = max(1, args.heads // tp)
        self.kv = shared_tensor((2 * args.layers, args.blocks, heads, BLOCK, HEAD_SIZE), torch.float16)
        self.client = SidecarClient.connect(
            target, model="bench/Llama", layout=EngineLayout(tp_size=tp, tp_rank=r), num_kv_heads=args.heads,
            hash_block_size=BLOCK, groups=[GroupSpec("full_attention", block_size=BLOCK)], cache_prefix=prefix,
            value_identity="bench", share_across_tp=share,
        )  # fmt: skip
        parts = [self.kv[i] for i in range(2 * args.layers)]
        self.client.register(parts, [(0,)] * len(parts), head_dims=[1] * len(parts))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def close(self) -> None:
        self.client.close()


def engine(target: str, tp: int, args: argparse.Namespace, share: bool | int, prefix: str) -> list[Rank]:
    return [Rank(target, tp, r, args, share, prefix) for r in range(tp)]


def save_all(ranks: Sequence[Loader], hashes: list[bytes], tokens: int, groups: int = 1) -> tuple[int, int]:
    """Every rank saves the prompt at once (block i of every group holds block i): (bytes written, values written)
    summed over ranks."""
    ids = [list(range(len(hashes)))] * groups
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        results = list(pool.map(lambda rank: rank.client.save(hashes, ids, tokens).result(timeout=600), ranks))
    for r in results:
        assert r.failed == 0, r
    return sum(r.bytes_written for r in results), sum(r.written for r in results)


def load_all(ranks: Sequence[Loader], hashes: list[bytes], tokens: int, groups: int = 1) -> float:
    """Every rank looks the prompt up and loads it at once: GiB/s over the bytes every rank received."""
    hits = [rank.client.lookup(hashes, tokens + 1) for rank in ranks]
    assert all(h.hit_tokens == tokens for h in hits), [h.hit_tokens for h in hits]
    ids = [list(range(len(hashes)))] * groups
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        failed = list(pool.map(lambda p: p[0].client.load(hashes, ids, p[1]), zip(ranks, hits, strict=True)))
    elapsed = time.perf_counter() - start
    assert all(not f for f in failed), failed
    return sum(rank.nbytes for rank in ranks) / elapsed / GIB


def report_loads(
    readers: Mapping[str, Sequence[Loader]], hashes: list[bytes], tokens: int, rounds: int, groups: int = 1
) -> None:
    """Load the prompt with every reader, `rounds` times interleaved, print each one's median GiB/s and its ratio to
    the first reader's, then close the readers' ranks."""
    rates: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(rounds):
        for name, ranks in readers.items():
            rates[name].append(load_all(ranks, hashes, tokens, groups))
    base = statistics.median(rates[next(iter(readers))])
    print(f"\n| reader (all ranks loading at once, median of {rounds}) | GiB/s | ratio |")
    print("| --- | --- | --- |")
    for name, measured in rates.items():
        median = statistics.median(measured)
        print(f"| {name} | {median:.2f} | {median / base:.2f}x |")
    for ranks in readers.values():
        for rank in ranks:
            rank.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--writer-tp", type=int, default=2)
    parser.add_argument("--reader-tp", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    hashes = [i.to_bytes(4, "big") * 8 for i in range(1, args.blocks + 1)]
    tokens = BLOCK * args.blocks
    distinct = 2 * args.layers * args.blocks * args.heads * BLOCK * HEAD_SIZE * 2
    segment = f"{max(256, 3 * distinct // (1 << 20) + 64)}MiB"
    with tempfile.TemporaryDirectory() as work:
        daemon = DaemonProcess(Path(work), segment_size=segment, local_buffer_size=None, log_level="warning").start()
        try:
            rows = []
            w, shares = (
                args.writer_tp,
                {"per layout": False, "per KV head": True, f"cut at TP={args.writer_tp}": args.writer_tp},
            )
            writers = {name: engine(daemon.target, w, args, share, name) for name, share in shares.items()}
            for ranks in writers.values():
                for i, rank in enumerate(ranks):
                    rank.kv.copy_(torch.randn(rank.kv.shape, generator=torch.Generator().manual_seed(i)))
            for name, ranks in writers.items():
                written, values = save_all(ranks, hashes, tokens)
                rows.append((name, written / distinct, values / args.blocks))
            print(f"# across TP: GQA H={args.heads}, {args.layers} layers, {args.blocks} blocks of {BLOCK} tokens,")
            print(f"# writer TP={w}, {distinct / (1 << 20):.0f} MiB of distinct KV\n")
            print("| writer | bytes written / distinct bytes | values per block |")
            print("| --- | --- | --- |")
            for name, ratio, per_block in rows:
                print(f"| TP={w}, {name} | {ratio:.3f} | {per_block:g} |")
            for ranks in writers.values():
                for rank in ranks:
                    rank.close()
            cut = f"cut at TP={w}"
            readers = {
                f"TP={w} reader, per-layout values": engine(daemon.target, w, args, False, "per layout"),
                f"TP={w} reader, per-head values": engine(daemon.target, w, args, True, "per KV head"),
                f"TP={args.reader_tp} reader, per-head values": engine(
                    daemon.target, args.reader_tp, args, True, "per KV head"
                ),
                f"TP={w} reader, values {cut}": engine(daemon.target, w, args, w, cut),
                f"TP=1 reader, values {cut}": engine(daemon.target, 1, args, w, cut),
            }
            report_loads(readers, hashes, tokens, args.rounds)
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
