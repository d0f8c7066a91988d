"""Section 4: bytes written per distinct byte of KV, through the daemon and by a per-rank writer that dedups nothing.

Eight TP ranks save the same request at once. Ranks of one replication set hold byte-identical blocks (every rank's
MLA latent; the ranks sharing a KV head under GQA with H < T), so the distinct KV is one copy per shard. The daemon
stripes each set's chunks over its ranks and skips values that exist; the per-rank writer stores every rank's blocks
under that rank's own key, as an engine without shared placement does. Bytes are counted twice: as the writers report
them and as the Mooncake master's allocated bytes grow.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvsidecar.movers.trailer import TRAILER_BYTES, chosen
from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.mooncake_direct import DirectClient
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.shapes import BLOCK_TOKENS, GQA, MLA, EngineMemory, ModelShape, Request
from kvsidecar_contract.placement import Geometry, save_plan
from kvsidecar_contract.placement.keys import block_key, namespace_prefix
from kvsidecar_testing.processes import DaemonProcess

__all__ = ["CASES", "VolumeResult", "master_allocated_bytes", "measure_volume"]

TP = 8
CASES = (
    ("MLA, T=8", dataclasses.replace(MLA, name="mla-tp8", tp_size=TP)),
    (
        "GQA, T=8, H=2",
        dataclasses.replace(GQA, name="gqa-tp8-h2", token_dims=(1, 128), kv_heads=2, tp_size=TP),
    ),
)


@dataclass
class VolumeResult:
    """One case's byte counts."""

    case: str
    blocks: int
    factor: int  # ranks holding each byte
    distinct_bytes: int
    daemon_written: int  # what the daemon's SaveResults report, all ranks
    daemon_stored: int  # growth of the master's allocated bytes
    daemon_trailers: int  # of those, the checksum trailers of the values chosen for one (kvsidecar/movers/trailer.py)
    resave_written: int  # the same request saved again by every rank
    naive_written: int
    naive_stored: int
    naive_rewritten: int

    @property
    def daemon_ratio(self) -> float:
        """Bytes written per distinct byte through the daemon (1.0: no duplicate write)."""
        return self.daemon_written / self.distinct_bytes

    @property
    def daemon_stored_ratio(self) -> float:
        """Store-side: allocated bytes of KV (trailers aside) per distinct byte."""
        return (self.daemon_stored - self.daemon_trailers) / self.distinct_bytes

    @property
    def naive_ratio(self) -> float:
        """Bytes written per distinct byte by the per-rank writer."""
        return self.naive_written / self.distinct_bytes


def master_allocated_bytes(metrics_url: str) -> int:
    """`master_allocated_bytes` from a mooncake_master's admin /metrics."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(metrics_url + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("master_allocated_bytes "):
                return int(float(line.split()[1]))
    raise BenchError(f"{metrics_url}/metrics has no master_allocated_bytes")


def _rank_memories(shape: ModelShape, blocks: int) -> list[tuple[ModelShape, Geometry, EngineMemory]]:
    out = []
    for rank in range(TP):
        rank_shape = dataclasses.replace(shape, tp_rank=rank)
        geo = Geometry.of(rank_shape.layout(f"bench/{shape.name}"))
        # Ranks of one shard hold the same bytes: seed the pattern with the shard id.
        out.append((rank_shape, geo, EngineMemory.shared(rank_shape, blocks, seed=geo.groups[0].shard + 1)))
    return out


def _trailer_bytes(ranks: list[tuple[ModelShape, Geometry, EngineMemory]], request: Request) -> int:
    """The checksum trailers the daemon's rule (its default, the layouts' own) adds to the request's values."""
    keys = {
        chunk.key
        for _, geo, _ in ranks
        for chunk in save_plan(geo, request.hashes, [request.save_ids], request.num_tokens).chunks
    }
    every = ranks[0][1].layout.checksum_every
    return TRAILER_BYTES * sum(chosen(key, every) for key in keys)


class _Counts(NamedTuple):
    written: int  # as the writers report it
    stored: int  # growth of the master's allocated bytes
    rewritten: int  # the same request saved again


def _daemon_saves(
    daemon: DaemonProcess,
    ranks: list[tuple[ModelShape, Geometry, EngineMemory]],
    request: Request,
    allocated: Callable[[], int],
) -> _Counts:
    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

    clients = []
    try:
        for shape, _, memory in ranks:
            client = SidecarClient.connect(
                daemon.target,
                model=f"bench/{ranks[0][0].name}",
                layout=EngineLayout(tp_size=shape.tp_size, tp_rank=shape.tp_rank),
                num_kv_heads=shape.kv_heads,
                hash_block_size=BLOCK_TOKENS,
                groups=[GroupSpec(shape.group, BLOCK_TOKENS)],
                client_name="kvsidecar-bench",
            )
            clients.append(client)
            client.register(memory.tensors, [(0,)] * len(memory.tensors))
        before = allocated()
        written = []
        for _ in range(2):  # every rank at once, then the same save again
            jobs = [c.save(request.hashes, [request.save_ids], request.num_tokens) for c in clients]
            results = [job.result() for job in jobs]
            if any(r.failed for r in results):
                raise BenchError(f"write-volume saves failed: {results}")
            written.append(sum(r.bytes_written for r in results))
        stored = allocated() - before
        clients[0].reset()
        return _Counts(written[0], stored, written[1])
    finally:
        for client in clients:
            client.close()


def _naive_saves(
    store: DirectClient,
    ranks: list[tuple[ModelShape, Geometry, EngineMemory]],
    request: Request,
    allocated: Callable[[], int],
) -> _Counts:
    model_key = ranks[0][1].layout.model_key
    before = allocated()
    written = []
    for _ in range(2):
        total = 0
        for shape, _, memory in ranks:
            # Every rank its own namespace (its TP rank in the key), the whole request, existence checked per rank.
            prefix = namespace_prefix(model_key, "", shape.tp_rank, 0, 0, 0, 0)
            keys = [block_key(prefix, h) for h in request.hashes]
            put, codes = store.put_missing(keys, [memory.addresses(i) for i in request.save_ids], memory.sizes)
            if any(codes):
                raise BenchError(f"per-rank writer: put returned {sorted(set(codes))}")
            total += put * shape.value_bytes
        written.append(total)
    stored = allocated() - before
    store.remove_model(ranks[0][1].layout.model)
    return _Counts(written[0], stored, written[1])


def measure_volume(
    daemon: DaemonProcess,
    daemon_allocated: Callable[[], int],
    naive_store: DirectClient,
    naive_allocated: Callable[[], int],
    blocks: int,
    progress: Progress,
    nonce: str,
) -> list[VolumeResult]:
    """Both cases, each through the daemon and through the per-rank writer."""
    out = []
    for case, shape in CASES:
        ranks = _rank_memories(shape, blocks)
        request = Request.of(shape, f"{nonce}/volume/{shape.name}", blocks, 0)
        factor = ranks[0][1].groups[0].factor
        distinct = (TP // factor) * blocks * shape.value_bytes
        daemon_counts = _daemon_saves(daemon, ranks, request, daemon_allocated)
        naive = _naive_saves(naive_store, ranks, request, naive_allocated)
        out.append(
            VolumeResult(
                case,
                blocks,
                factor,
                distinct,
                daemon_counts.written,
                daemon_counts.stored,
                _trailer_bytes(ranks, request),
                daemon_counts.rewritten,
                naive.written,
                naive.stored,
                naive.rewritten,
            )
        )
        progress.step(f"write volume {case}")
    return out
