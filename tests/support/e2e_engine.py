"""A simulated engine for end-to-end tests: one rank process per rank, regions filled and checked by the oracle.

Each rank of the engine is a `RankProcess` holding its own real client and shared-memory tensors. The cold pass fills
every block with what that rank truly holds (`kvsidecar_testing.oracle`), the warm pass loads into other block ids
of cleared regions, and `verify` compares every block of every region with what the oracle says it must hold now.
"""

from __future__ import annotations

import math
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvsidecar_client import EngineLayout, GroupSpec, Hit, SidecarClient
from kvsidecar_contract.placement import Layout
from kvsidecar_testing import oracle
from kvsidecar_testing.oracle import Prompt, RankId
from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.ranks import RankProcess, each

NUM_BLOCKS = 32


@dataclass(frozen=True)
class TensorSpec:
    """One KV-cache tensor of every rank: the group it serves and one block's shape and dtype."""

    group: int
    block_shape: tuple[int, ...]
    dtype: str = "bfloat16"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}[self.dtype]
        return math.prod(self.block_shape) * itemsize


def client_groups(layout: Layout) -> list[GroupSpec]:
    """The layout's groups as the client spells them."""
    return [GroupSpec(g.kind.value, g.block_size, g.window, tuple(k.value for k in g.inner)) for g in layout.groups]


def scheduler(target: str, layout: Layout) -> SidecarClient:
    """A scheduler session (lookups only) for the engine of `layout`."""
    par = layout.parallel
    return SidecarClient.connect(
        target,
        model=layout.model,
        layout=EngineLayout(tp_size=par.tp_size, pp_size=par.pp_size, pcp_size=par.pcp_size, dcp_size=par.dcp_size),
        num_kv_heads=layout.num_kv_heads,
        hash_block_size=layout.hash_block_size,
        groups=client_groups(layout),
        cache_prefix=layout.cache_prefix,
        role="scheduler",
    )


def hit_dict(hit: Hit) -> dict[str, Any]:
    """A Hit as the rank processes take it."""
    return {
        "hit_tokens": hit.hit_tokens,
        "tail_boundaries": list(hit.tail_boundaries),
        "degraded": hit.degraded,
        "detail": hit.detail,
    }


class SimEngine:
    """Every rank of one engine layout, each in its own process (procs[i] plays ranks[i])."""

    def __init__(
        self, procs: Sequence[RankProcess], target: str, layout: Layout, tensors: Sequence[TensorSpec]
    ) -> None:
        par = layout.parallel
        self.ranks = [
            RankId(r, c, p) for r in range(par.tp_size) for c in range(par.pcp_size) for p in range(par.pp_size)
        ]
        if len(procs) < len(self.ranks):
            raise ValueError(f"{len(self.ranks)} ranks need as many processes, got {len(procs)}")
        self.procs = list(procs[: len(self.ranks)])
        self.target = target
        self.layout = layout
        self.tensors = list(tensors)
        self.name = f"engine-{uuid.uuid4().hex[:8]}"
        self.placements: list[Any] = []

    # ---- sessions ----

    def spec(self, rank: RankId) -> dict[str, Any]:
        """The client's session spec of one rank, as JSON."""
        par = self.layout.parallel
        return {
            "model": self.layout.model,
            "layout": {
                "tp_size": par.tp_size,
                "tp_rank": rank.tp,
                "pp_size": par.pp_size,
                "pp_rank": rank.pp,
                "pcp_size": par.pcp_size,
                "pcp_rank": rank.pcp,
                "dcp_size": par.dcp_size,
            },
            "num_kv_heads": self.layout.num_kv_heads,
            "hash_block_size": self.layout.hash_block_size,
            "groups": [
                {"kind": g.kind, "block_size": g.block_size, "window": g.window, "inner": list(g.inner)}
                for g in client_groups(self.layout)
            ],
            "cache_prefix": self.layout.cache_prefix,
        }

    def open(self) -> SimEngine:
        """Connect every rank and register its tensors; keeps what each session says about its placement."""
        tensors = [{"shape": [NUM_BLOCKS, *t.block_shape], "dtype": t.dtype, "groups": [t.group]} for t in self.tensors]
        args = [
            {"name": self.name, "address": self.target, "spec": self.spec(rank), "tensors": tensors}
            for rank in self.ranks
        ]
        self.placements = each(self.procs, "open", args)
        return self

    def close(self) -> None:
        """Close every rank's client (its regions stay in the process until it exits)."""
        each(self.procs, "close", [{"name": self.name}] * len(self.procs))

    # ---- block ids ----

    def cold_ids(self, prompt: Prompt) -> list[list[int]]:
        """Per group, the blocks the prefill allocates: 0, 1, 2, ..."""
        dcp = self.layout.parallel.dcp_size
        return [list(range(oracle.blocks_of(g, dcp, prompt.num_tokens))) for g in self.layout.groups]

    def warm_ids(self, prompt: Prompt) -> list[list[int]]:
        """Per group, other blocks for the warm pass: counted down from the top, so no id matches the cold one."""
        dcp = self.layout.parallel.dcp_size
        return [
            [NUM_BLOCKS - 1 - k for k in range(oracle.blocks_of(g, dcp, prompt.num_tokens))] for g in self.layout.groups
        ]

    # ---- the passes ----

    def prefill(self, prompt: Prompt, ranks: Sequence[int] | None = None) -> None:
        """Write into each rank's cold blocks what that rank holds after computing the prompt."""
        chosen = range(len(self.ranks)) if ranks is None else ranks
        args = []
        ids = self.cold_ids(prompt)
        for i in chosen:
            blocks = []
            for t, spec in enumerate(self.tensors):
                tags = oracle.cold_block_tags(self.layout, spec.group, t, self.ranks[i], prompt)
                blocks += [[t, ids[spec.group][k], tag] for k, tag in tags.items()]
            args.append({"name": self.name, "blocks": blocks})
        each([self.procs[i] for i in chosen], "fill", args)

    def save(self, prompt: Prompt, ranks: Sequence[int] | None = None, saved_tokens: int = 0) -> list[dict[str, Any]]:
        """Every chosen rank saves the prompt's cold blocks at once; their SaveResults, in rank order."""
        chosen = range(len(self.ranks)) if ranks is None else ranks
        arg = {
            "name": self.name,
            "hashes": [h.hex() for h in prompt.hashes],
            "ids": self.cold_ids(prompt),
            "num_tokens": prompt.num_tokens,
            "saved_tokens": saved_tokens,
        }
        return each([self.procs[i] for i in chosen], "save", [arg] * len(chosen))

    def clear(self) -> None:
        """Fill every region of every rank with the poison byte, as a cleared GPU cache would be reused."""
        each(self.procs, "poison", [{"name": self.name}] * len(self.procs))

    def load(self, prompt: Prompt, hit: Hit, start_tokens: int = 0) -> list[dict[str, Any]]:
        """Every rank loads the hit into its warm blocks at once; their LoadResults, in rank order."""
        arg = {
            "name": self.name,
            "hashes": [h.hex() for h in prompt.hashes],
            "ids": self.warm_ids(prompt),
            "hit": hit_dict(hit),
            "start_tokens": start_tokens,
        }
        return each(self.procs, "load", [arg] * len(self.procs))

    def rank_lookup(self, rank: int, prompt: Prompt, *, eagle: bool = False) -> Hit:
        """A lookup from one rank's own session."""
        answer = self.procs[rank].call(
            "lookup",
            name=self.name,
            hashes=[h.hex() for h in prompt.hashes],
            num_tokens=prompt.num_tokens,
            eagle=eagle,
        )
        return Hit(answer["hit_tokens"], tuple(answer["tail_boundaries"]), answer["degraded"], answer["detail"])

    # ---- what the oracle says ----

    def expected_loaded(self, cold: Prompt, hit_tokens: int, start_tokens: int = 0) -> int:
        """Values one rank must read for a hit: the blocks each group needs at the hit end and does not hold."""
        total = 0
        for g in range(len(self.layout.groups)):
            t = next(t for t, spec in enumerate(self.tensors) if spec.group == g)
            tags = oracle.warm_block_tags(self.layout, g, t, self.ranks[0], cold, hit_tokens, start_tokens)
            total += len(tags)
        return total

    def digests(self) -> list[list[list[str]]]:
        """Per rank, per tensor, per block: the fingerprint of the block's bytes now."""
        return each(self.procs, "digests", [{"name": self.name}] * len(self.procs))

    def verify(self, cold: Prompt, hit_tokens: int, start_tokens: int = 0) -> list[str]:
        """Every block of every region of every rank against the oracle: loaded blocks, and poison elsewhere."""
        found = self.digests()
        ids = self.warm_ids(cold)
        problems = []
        for rank, digests in zip(self.ranks, found, strict=True):
            for t, spec in enumerate(self.tensors):
                tags = oracle.warm_block_tags(self.layout, spec.group, t, rank, cold, hit_tokens, start_tokens)
                want = oracle.expected_digests(tags, ids[spec.group], NUM_BLOCKS, spec.block_bytes)
                by_id = {ids[spec.group][k]: tag for k, tag in tags.items()}
                for block, (got, expected) in enumerate(zip(digests[t], want, strict=True)):
                    if got != expected:
                        what = by_id.get(block, "poison (not loaded)")
                        problems.append(f"rank {rank} tensor {t} (group {spec.group}) block {block}: want {what}")
        return problems

    def replication_sets(self, group: int) -> list[list[RankId]]:
        """The oracle's replication sets of a group: ranks of one PCP/PP position that hold identical bytes."""
        sets: dict[tuple[int, int, str], list[RankId]] = {}
        for rank in self.ranks:
            sets.setdefault((rank.pcp, rank.pp, oracle.holder(self.layout, group, rank)), []).append(rank)
        return list(sets.values())

    def expected_writes(self, values_per_group: Sequence[int]) -> list[tuple[int, int]]:
        """(written, left to others) per rank when each group's values are shared evenly inside its replication set.

        values_per_group[g]: how many values one save stores for group g (in each namespace).
        """
        out = []
        for rank in self.ranks:
            written = left = 0
            for g, n in enumerate(values_per_group):
                size = next(len(s) for s in self.replication_sets(g) if rank in s)
                assert n % size == 0, f"pick {size} | {n} so the share is even"
                written += n // size
                left += n - n // size
            out.append((written, left))
        return out


# ---- tensors and checks the scenarios share ------------------------------------------------------------------------

MLA = TensorSpec(0, (16, 72))  # one latent block: 16 tokens x 576 bytes
GQA = TensorSpec(1, (2, 16, 1, 32))  # K and V of this rank's one KV head
MAMBA_CONV = TensorSpec(1, (3, 64))  # a recurrent group keeps two tensors: its value is both slices, in order
MAMBA_SSM = TensorSpec(1, (2, 8, 16), "float32")


def unique_model(name: str) -> str:
    """A model name no other test uses, so every scenario starts with an empty store."""
    return f"e2e/{name}-{uuid.uuid4().hex[:8]}"


def writes(results: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """(written, left to others) of each rank's SaveResult."""
    return [(r["written"], r["striped_to_others"]) for r in results]


def cold_pass(engine: SimEngine, prompt: Prompt) -> list[dict[str, Any]]:
    """Every rank prefills and saves the prompt; no save may fail."""
    engine.prefill(prompt)
    results = engine.save(prompt)
    failures = [r["failures"] for r in results]
    assert failures == [[]] * len(results), f"failed saves: {failures}"
    return results


def warm_pass(engine: SimEngine, prompt: Prompt, hit: Hit, start_tokens: int = 0) -> None:
    """Load the hit on every rank into cleared regions: no failure, and every block as the oracle says."""
    engine.clear()
    loads = engine.load(prompt, hit, start_tokens)
    expected = engine.expected_loaded(prompt, hit.hit_tokens, start_tokens)
    got = [(r["loaded"], r["failures"]) for r in loads]
    assert got == [(expected, [])] * len(loads), f"{hit}: want {expected} loaded per rank, got {got}"
    problems = engine.verify(prompt, hit.hit_tokens, start_tokens)
    assert problems == [], f"{hit}: {len(problems)} blocks differ from the oracle: {problems[:4]}"


def placements_match_oracle(engine: SimEngine) -> None:
    """Each session's reported factor is the oracle's replication-set size, and its span the engine's."""
    dcp = engine.layout.parallel.dcp_size
    for rank, placement in zip(engine.ranks, engine.placements, strict=True):
        for g, (factor, _shard, _keys, span, *_) in enumerate(placement["groups"]):
            size = next(len(s) for s in engine.replication_sets(g) if rank in s)
            want = (size, oracle.view_of(engine.layout.groups[g], dcp).span)
            assert (factor, span) == want, f"{rank} group {g}: daemon says {(factor, span)}, oracle {want}"


def saved_blocks(daemon: DaemonProcess) -> dict[str, float]:
    """The daemon's kvsidecar_saved_blocks counter per group kind, scraped from /metrics."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    return {
        sample.labels["group_kind"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvsidecar_saved_blocks_total"
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """What a counter family gained, by label, leaving out the unchanged ones."""
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v != before.get(k, 0)}
