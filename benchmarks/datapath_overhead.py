"""The daemon's own CPU per request: DataPath save, load and lookup over a store stub that answers at once.

    python benchmarks/datapath_overhead.py [--repeat 41]

Everything a real request costs minus Mooncake's work and gRPC: placement plans, one address per region and block,
result bookkeeping and metrics. Shapes as `kvsidecar bench` has them; lookups at T=8 with [mla, full_attention,
mamba], all keys present (hit) or none (miss).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.memory.mappings import Opener
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.movers.trailer import ChecksumSettings
from kvsidecar.rpc import wire
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store import Presence, StoreCode, StoreHealth
from kvsidecar.store.base import check_batch_shapes
from kvsidecar.values import LoadArgs, LookupArgs, Role, SaveArgs
from kvsidecar_bench.lookup import _layout
from kvsidecar_bench.shapes import GQA, MLA, EngineMemory, Request, hashes_for
from kvsidecar_client.descriptions import describe_regions


class StubStore:
    """Answers every call at once: existence is `present`, transfers succeed; shapes are checked like Mooncake's."""

    def __init__(self, present: bool) -> None:
        self.present = present

    def exists(self, keys: Sequence[str]) -> list[Presence]:
        return [Presence.PRESENT if self.present else Presence.ABSENT] * len(keys)

    def put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        device: bool = False,
        pin: object = None,
    ):
        check_batch_shapes(keys, addresses, sizes)
        return [StoreCode.OK] * len(keys)

    def get_into(self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]):
        return self.put_from(keys, addresses, sizes)

    def register_buffer(self, address: int, size: int) -> None:
        pass

    def unregister_buffer(self, address: int) -> None:
        pass

    def tiers(self, keys: Sequence[str]) -> list[str]:
        return ["memory" if self.present else ""] * len(keys)

    def health(self) -> StoreHealth:
        return StoreHealth(True, "stub")


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=41)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    movers = Movers(StubStore(False), checksums=ChecksumSettings("off"))  # the stub writes no trailers
    sessions = SessionRegistry(60, movers)
    print("| request | ms (median) |")
    print("| --- | --- |")
    for shape in (MLA, GQA):
        for n in (8, 32, 128):
            memory = EngineMemory.shared(shape, 2 * n)
            session = sessions.open(Role.RANK, shape.layout("bench/x"), 32, "x")
            fds: list[int] = []  # the memfds a rank would pass over the side socket, handed over directly here
            regions = describe_regions([(t, (0,), None) for t in memory.tensors], fds)
            session.memory = SessionMemory(wire.regions(regions), 1, Opener(fds))
            session.mover = movers.mover(session.memory)
            request = Request.of(shape, "overhead", n, n)
            datapath = DataPath(StubStore(False), Metrics())
            ids, tokens = [request.save_ids], request.num_tokens
            save = median_ms(partial(datapath.save, session, SaveArgs(request.hashes, ids, tokens, 0)), args.repeat)
            ids, hit = [request.load_ids], n * 16
            load = median_ms(partial(datapath.load, session, LoadArgs(request.hashes, ids, hit, [hit], 0)), args.repeat)
            print(f"| {shape.name} save, {n} blocks ({shape.regions} slices each) | {save:.3f} |")
            print(f"| {shape.name} load, {n} blocks | {load:.3f} |")
    scheduler = sessions.open(Role.SCHEDULER, _layout(0), 32, "x")
    for present, what in ((True, "hit"), (False, "miss")):
        datapath = DataPath(StubStore(present), Metrics())
        for tokens in (4096, 32768, 131072):
            hashes = hashes_for("overhead", tokens // 16)
            lookup = partial(datapath.lookup, scheduler, LookupArgs(hashes, tokens, False))
            ms = median_ms(lookup, max(5, args.repeat // 4))
            print(f"| lookup {tokens // 1024}k tokens, {what} | {ms:.3f} |")


if __name__ == "__main__":
    main()
