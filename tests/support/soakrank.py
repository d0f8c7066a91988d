"""One engine rank of the soak, in its own OS process: real client, shared-memory KV tensors with canaries, and a
byte-for-byte check of every block it loads against the engine-side oracle (`kvsidecar_testing.oracle`).

The driver (`kvsidecar_testing.ranks`) sends one command at a time over a pipe and gets one reply dict back:

    {"op": "prefill", "hashes", "tokens", "ids"}  compute every block of the prompt into `ids`, save, wait
    {"op": "load", "hashes", "ids", "hit", "tails"}  poison `ids`, load the hit, verify every block, check canaries
    {"op": "reopen"}  close the client (its session ends) and connect and register again
    {"op": "exit"}    close the client and exit

Tensors: per region, a (blocks + 2, 2, block_bytes) uint8 shared tensor of which the view [1:-1, 0, :] is
registered; rows 0 and -1 and the whole [:, 1, :] half are slack filled with a canary, checked after every load.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_testing import oracle

NUM_BLOCKS = 40


@dataclass(frozen=True)
class EngineDef:
    """An engine of the soak: identity, layout, groups and the bytes of each region of each group."""

    name: str
    model: str
    cache_prefix: str
    tp: int
    heads: int
    groups: tuple[tuple[str, int, int], ...]  # (kind, block_size, window)
    region_bytes: tuple[tuple[int, ...], ...]  # per group, the block bytes of each of its regions
    u: int = 16

    def spec(self, tp_rank: int, role: str = "rank", client_name: str = ""):
        from kvsidecar_client import EngineLayout, GroupSpec, SessionSpec

        return SessionSpec(
            model=self.model,
            layout=EngineLayout(tp_size=self.tp, tp_rank=tp_rank),
            num_kv_heads=self.heads,
            hash_block_size=self.u,
            groups=tuple(GroupSpec(k, b, w) for k, b, w in self.groups),
            cache_prefix=self.cache_prefix,
            role=role,
            client_name=client_name,
        )

    def views(self) -> list[oracle.GroupView]:
        return oracle.views(self.spec(0).to_proto())

    def identities(self, tp_rank: int) -> list[list[bytes]]:
        """Per group, per region: the digest of what this rank holds there."""
        layout = oracle.layout_of(self.spec(tp_rank).to_proto())
        return [
            [
                hashlib.sha256(oracle.identity(self.name, layout, g, tp_rank, 0, 0) + bytes([r])).digest()
                for r in range(len(sizes))
            ]
            for g, sizes in enumerate(self.region_bytes)
        ]


@dataclass
class Tally:
    """What one command did, added up by the driver."""

    counts: Counter = field(default_factory=Counter)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n


def canary(name: str, n: int) -> bytes:
    seed = hashlib.sha256(f"canary/{name}".encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


class SoakRank:
    """The rank's state: its client, its tensors (and canaries), and the oracle's identities."""

    def __init__(self, target: str, engine: EngineDef, tp_rank: int, engines: list[EngineDef]) -> None:
        import numpy as np
        import torch

        from kvsidecar_client import shared_tensor

        self.target, self.engine, self.tp_rank = target, engine, tp_rank
        self.views = engine.views()
        self.idents = engine.identities(tp_rank)
        # Everyone else's identities per group index, to tell a foreign block from a corrupted one.
        self.others = [
            (e.name, r, e.views(), e.identities(r)) for e in engines for r in range(e.tp) if (e, r) != (engine, tp_rank)
        ]
        self.tensors: list[list[Any]] = []  # per group, per region: the (NB + 2, 2, bb) tensor
        self.arrays: list[list[Any]] = []  # numpy views of the same memory
        self.canaries: list[list[bytes]] = []
        for g, sizes in enumerate(engine.region_bytes):
            ts, arrs, cans = [], [], []
            for r, bb in enumerate(sizes):
                t = shared_tensor((NUM_BLOCKS + 2, 2, bb), torch.uint8)
                arr = t.numpy()
                image = canary(f"{engine.name}/{tp_rank}/{g}/{r}/{os.getpid()}", arr.size)
                arr.reshape(-1)[:] = np.frombuffer(image, dtype=np.uint8)
                ts.append(t)
                arrs.append(arr)
                cans.append(image)
            self.tensors.append(ts)
            self.arrays.append(arrs)
            self.canaries.append(cans)
        self.client = self._connect()

    def _connect(self):
        from kvsidecar_client import SidecarClient

        spec = self.engine.spec(self.tp_rank, client_name=f"soak {self.engine.name} rank {self.tp_rank}")
        client = SidecarClient.connect(
            self.target,
            model=spec.model,
            layout=spec.layout,
            num_kv_heads=spec.num_kv_heads,
            hash_block_size=spec.hash_block_size,
            groups=spec.groups,
            cache_prefix=spec.cache_prefix,
            client_name=spec.client_name,
        )
        views = [t[1 : NUM_BLOCKS + 1, 0, :] for ts in self.tensors for t in ts]
        groups_of = [(g,) for g, ts in enumerate(self.tensors) for _ in ts]
        client.register(views, groups_of)
        return client

    # --- commands ---

    def prefill(self, hashes: list[bytes], tokens: int, ids: list[list[int]]) -> dict[str, Any]:
        """Compute every block of the prompt (what this rank truly holds) and save; block until the save is done."""
        import numpy as np

        u = self.engine.u
        for g, view in enumerate(self.views):
            for i, bid in enumerate(ids[g]):
                for r, arr in enumerate(self.arrays[g]):
                    data = oracle.computed_block(self.idents[g][r], view, u, hashes, i, tokens, arr.shape[2])
                    arr[1 + bid, 0, :] = np.frombuffer(data, dtype=np.uint8)
        result = self.client.save(hashes, ids, tokens).result(timeout=120)
        tally = Tally()
        tally.add("saves")
        tally.add("blocks_written", result.written)
        tally.add("blocks_skipped", result.skipped)
        tally.add("blocks_striped_to_others", result.striped_to_others)
        tally.add("bytes_written", result.bytes_written)
        for f in result.failures:
            tally.add(f"save_failed:{f.reason}")
        return dict(tally.counts)

    def load(self, hashes: list[bytes], ids: list[list[int]], hit: int, tails: list[int]) -> dict[str, Any]:
        """Load into poisoned blocks and check every byte the engine will use, and that nothing else moved."""
        from kvsidecar_client import Hit

        poison = bytes([oracle.POISON])
        for g, arrs in enumerate(self.arrays):
            for arr in arrs:
                for bid in ids[g]:
                    arr[1 + bid, 0, :] = oracle.POISON
        result = self.client.load_detailed(hashes, ids, Hit(hit, tuple(tails)))
        tally = Tally()
        tally.add("loads")
        failed = {(f.group, f.block_id): f.reason for f in result.failures}
        for reason in failed.values():
            tally.add(f"load_failed:{reason}")
        needed_total = 0
        u = self.engine.u
        for g, view in enumerate(self.views):
            needed = oracle.needed_blocks(view, hit)
            needed_total += len(needed)
            for i, bid in enumerate(ids[g]):
                blocks = [arr[1 + bid, 0, :].tobytes() for arr in self.arrays[g]]
                if i not in needed:
                    if any(b != poison * len(b) for b in blocks):
                        tally.add("stray_writes")
                    continue
                if (g, bid) in failed:
                    continue
                verdict = self._verify(g, view, u, hashes, i, hit, tails[g], blocks)
                tally.add(verdict)
                if verdict == "blocks_verified":
                    tally.add("bytes_verified", sum(len(b) for b in blocks))
        if result.loaded + len(result.failures) != needed_total:
            tally.add("load_plan_mismatch")
        tally.add("canary_damage", self.canary_damage())
        return dict(tally.counts)

    def _verify(self, g, view, u, hashes, i, hit, tail, blocks: list[bytes]) -> str:
        def matches(idents: list[bytes], view_) -> bool:
            return all(
                got[off : off + len(want)] == want
                for ident, got in zip(idents, blocks, strict=True)
                for off, want in oracle.expected_loaded(ident, view_, u, hashes, i, hit, tail, len(got))
            )

        if matches(self.idents[g], view):
            return "blocks_verified"
        for _name, _rank, views, idents in self.others:
            if g < len(idents) and len(idents[g]) == len(blocks) and matches(idents[g], views[g]):
                return "blocks_foreign"
        return "blocks_corrupted"

    def canary_damage(self) -> int:
        """Slack bytes (rows 0 and -1, and the [:, 1, :] halves) that no longer hold the canary."""
        import numpy as np

        damaged = 0
        for arrs, cans in zip(self.arrays, self.canaries, strict=True):
            for arr, image in zip(arrs, cans, strict=True):
                want = np.frombuffer(image, dtype=np.uint8).reshape(arr.shape)
                damaged += int((arr[0] != want[0]).sum() + (arr[-1] != want[-1]).sum())
                damaged += int((arr[:, 1, :] != want[:, 1, :]).sum())
        return damaged

    def segment_names(self) -> list[str]:
        from kvsidecar_client.memory import segment_of

        # Sealed memfds (shared_tensor's default) have no name to unlink: they go with the last descriptor.
        segments = [segment_of(t) for ts in self.tensors for t in ts]
        return [s.name for s in segments if s is not None and not s.sealed]

    def reopen(self) -> dict[str, Any]:
        self.client.close()
        self.client = self._connect()
        return {"reopens": 1}

    def ready(self) -> dict[str, Any]:
        """What the driver learns once the rank is up: its PID and the segments to clean if it dies."""
        return {"ready": os.getpid(), "segments": self.segment_names()}

    def exit(self) -> dict[str, Any]:
        self.client.close()
        return {"closed": 1}
