"""The soak's driver side: rank processes, an engine loop per engine, fault injection (hostile traffic: soakhostile).

An engine is a scheduler (a real `SidecarClient` with role "scheduler", in the test process) and one OS process
per rank (`support.soakrank`). Each request: the scheduler looks the prompt up, the ranks load the hit into freshly
allocated (poisoned) blocks and verify every byte, then compute the whole prompt into those blocks and save it, as
an engine with a cold GPU cache would. Prompts share prefixes (system prompts, repeats, extensions), and both
engines draw from the same prompts, so the same block hashes land in both tenants' namespaces.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import threading
import traceback
from collections import Counter
from collections.abc import Sequence
from multiprocessing import resource_tracker
from typing import Any

from kvsidecar_client import SidecarClient
from kvsidecar_testing.ranks import RankDied, RankError, RankProcess
from support.soakrank import NUM_BLOCKS, EngineDef, SoakRank

MAX_TOKENS = 512

ENGINE_A = EngineDef(
    name="A",
    model="org/SoakModel",
    cache_prefix="engine-a",
    tp=4,
    heads=1,
    groups=(("mla", 32, 0), ("mamba", 64, 0)),
    region_bytes=((512,), (768, 256)),  # mamba: conv state and ssm state, two regions of one value
)
ENGINE_B = EngineDef(
    name="B",
    model="org/SoakModel",  # the same model: only the cache prefix keeps the tenants apart
    cache_prefix="engine-b",
    tp=4,
    heads=2,
    groups=(("full_attention", 32, 0), ("sliding_window", 16, 64)),
    region_bytes=((256, 256), (128,)),  # full attention: K and V regions
)
ENGINES = [ENGINE_A, ENGINE_B]


class RankHandle(RankProcess):
    """One rank process of the soak (driven by `kvsidecar_testing.ranks`) and the shared memory it owns."""

    def __init__(self, target: str, engine: EngineDef, tp_rank: int) -> None:
        super().__init__(SoakRank, target, engine, tp_rank, ENGINES, name=f"soak-{engine.name}{tp_rank}")
        self.engine, self.tp_rank = engine, tp_rank
        self.segments: list[str] = []

    def start(self, timeout: float = 180.0) -> RankHandle:
        """Spawn the process and wait until its client has registered."""
        self.spawn().wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 180.0) -> RankHandle:
        super().wait_ready(timeout)
        self.segments = list(self.ready_info["segments"])
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Close the client and let the process exit; kill it if it does not."""
        super().stop(timeout)
        self.unlink_segments()

    def unlink_segments(self) -> None:
        """Unlink the segments of a process that died without doing it (the daemon's mappings stay valid)."""
        for name in self.segments:
            path = os.path.join("/dev/shm", name)
            if os.path.exists(path):
                os.unlink(path)
                # Spawned children report to this process's resource tracker, which would unlink it at exit.
                resource_tracker.unregister("/" + name, "shared_memory")
        self.segments = []


def chain_hashes(tokens: Sequence[int], u: int) -> list[bytes]:
    """One chained sha256 per full U-token chunk, as an engine's prefix cache computes them."""
    out, prev = [], b"soak"
    for i in range(len(tokens) // u):
        chunk = b"".join(t.to_bytes(4, "little") for t in tokens[i * u : (i + 1) * u])
        prev = hashlib.sha256(prev + chunk).digest()
        out.append(prev)
    return out


class Prompts:
    """Prompts with shared prefixes: a few system prompts, exact repeats, and extensions of earlier prompts."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.systems = [[rng.randrange(50_000) for _ in range(rng.randrange(32, 257))] for _ in range(6)]
        self.history: list[list[int]] = []
        self.lock = threading.Lock()

    def next(self) -> list[int]:
        with self.lock:
            roll = self.rng.random()
            if self.history and roll < 0.3:
                tokens = list(self.rng.choice(self.history))  # the same prompt again: a full hit
            elif self.history and roll < 0.5:
                base = self.rng.choice(self.history)
                tokens = base + [self.rng.randrange(50_000) for _ in range(self.rng.randrange(1, 96))]
            else:
                tokens = self.rng.choice(self.systems) + [
                    self.rng.randrange(50_000) for _ in range(self.rng.randrange(1, 257))
                ]
            tokens = tokens[:MAX_TOKENS]
            self.history.append(tokens)
            del self.history[:-200]
            return tokens


class Tally:
    """Counters shared by the soak's threads."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.samples: dict[str, str] = {}
        self.lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def merge(self, counts: dict[str, Any], prefix: str = "") -> None:
        with self.lock:
            for key, value in counts.items():
                if isinstance(value, int):
                    self.counts[prefix + key] += value

    def note(self, key: str, text: str) -> None:
        """Count key and keep the first text seen for it."""
        with self.lock:
            self.counts[key] += 1
            self.samples.setdefault(key, text[:2000])


class EngineLoop(threading.Thread):
    """One engine: a scheduler client and its rank processes, serving prompts until told to stop."""

    def __init__(self, target: str, engine: EngineDef, prompts: Prompts, tally: Tally, stop: threading.Event):
        super().__init__(name=f"engine-{engine.name}", daemon=True)
        self.target, self.engine, self.prompts, self.tally, self.stop_event = target, engine, prompts, tally, stop
        self.rng = random.Random(f"engine-{engine.name}-{os.getpid()}")
        self.ranks = [RankHandle(target, engine, r) for r in range(engine.tp)]
        self.views = engine.views()
        self.scheduler: SidecarClient | None = None
        self.pending_reopen: set[int] = set()
        self.lock = threading.Lock()  # held while ranks are restarted, so faults pick live processes
        self.error: str | None = None

    def spawn_ranks(self) -> None:
        for rank in self.ranks:
            rank.spawn()

    def wait_ranks(self) -> None:
        for rank in self.ranks:
            rank.wait_ready()
        spec = self.engine.spec(0, role="scheduler", client_name=f"soak scheduler {self.engine.name}")
        self.scheduler = SidecarClient.connect(
            self.target,
            model=spec.model,
            layout=spec.layout,
            num_kv_heads=spec.num_kv_heads,
            hash_block_size=spec.hash_block_size,
            groups=spec.groups,
            cache_prefix=spec.cache_prefix,
            role="scheduler",
            client_name=spec.client_name,
        )

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                self.serve_one()
        except Exception:
            self.error = traceback.format_exc()

    def serve_one(self) -> None:
        e = self.engine.name
        for tp_rank in sorted(self.pending_reopen):
            self.pending_reopen.discard(tp_rank)
            self.broadcast("reopen", {}, only=[tp_rank])
        tokens = self.prompts.next()
        n = len(tokens)
        hashes = chain_hashes(tokens, self.engine.u)
        assert self.scheduler is not None
        hit = self.scheduler.lookup(hashes, n)
        self.tally.add(f"{e}:lookups")
        self.tally.add(f"{e}:lookup_hit_tokens", hit.hit_tokens)
        self.tally.add(f"{e}:prompt_tokens", n)
        if hit.degraded:
            self.tally.note(f"{e}:lookups_degraded", hit.detail)
        ids = [self.rng.sample(range(NUM_BLOCKS), min(NUM_BLOCKS, n // v.span + 1)) for v in self.views]
        ok = True
        if hit.hit_tokens:
            ok = self.broadcast(
                "load", {"hashes": hashes, "ids": ids, "hit": hit.hit_tokens, "tails": list(hit.tail_boundaries)}
            )
        ok = self.broadcast("prefill", {"hashes": hashes, "tokens": n, "ids": ids}) and ok
        self.tally.add(f"{e}:requests_completed" if ok else f"{e}:requests_cut_by_a_fault")

    def broadcast(self, op: str, args: dict[str, Any], only: Sequence[int] | None = None) -> bool:
        """Send a command to the ranks at once (their RPCs reach the daemon concurrently); restart dead ranks."""
        targets = [self.ranks[r] for r in (only if only is not None else range(len(self.ranks)))]
        sent, dead = [], []
        for rank in targets:
            try:
                rank.send(op, **args)
                sent.append(rank)
            except RankDied:
                dead.append(rank)
        for rank in sent:
            try:
                reply = rank.receive(timeout=120)
            except RankDied:
                dead.append(rank)
                continue
            except RankError as exc:
                self.tally.note(f"{self.engine.name}:rank_error:{op}:{exc.error_type}", str(exc))
                continue
            self.tally.merge(reply, prefix=f"{self.engine.name}:")
        with self.lock:
            for rank in dead:
                self.tally.add(f"{self.engine.name}:rank_restarts")
                rank.stop(5)
                rank.start()
        return not dead

    def close(self) -> None:
        for rank in self.ranks:
            rank.stop()
        if self.scheduler is not None:
            self.scheduler.close()


class Faults(threading.Thread):
    """Every `interval` seconds one fault, in turn: a rank SIGKILLed mid-request, a rank's session closed and
    reopened, a rank stalled (SIGSTOP) past its lease and resumed."""

    KINDS = ("kill", "reopen", "stall")

    def __init__(self, engines: Sequence[EngineLoop], tally: Tally, stop: threading.Event, interval: float, ttl: float):
        super().__init__(name="faults", daemon=True)
        self.engines, self.tally, self.stop_event = engines, tally, stop
        self.interval, self.ttl = interval, ttl
        self.rng = random.Random(f"faults-{os.getpid()}")

    def run(self) -> None:
        turn = 0
        while not self.stop_event.wait(self.interval * self.rng.uniform(0.7, 1.3)):
            kind = self.KINDS[turn % len(self.KINDS)]
            turn += 1
            engine = self.rng.choice(self.engines)
            with engine.lock:
                rank = self.rng.choice(engine.ranks)
                pid = rank.pid if rank.alive() else None
            if pid is None:
                continue
            self.tally.add(f"fault:{kind}")
            if kind == "kill":
                rank.kill()
            elif kind == "reopen":
                engine.pending_reopen.add(rank.tp_rank)
            else:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    # Past the lease: its liveness connection keeps the session (a lease-only client re-opens).
                    self.stop_event.wait(self.ttl + 2.5)
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)


def kill_leftovers(engines: Sequence[EngineLoop]) -> None:
    """Kill every rank process still running (a failed soak must not leave them behind)."""
    for engine in engines:
        for rank in engine.ranks:
            if rank.proc is not None and rank.proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.proc.pid, signal.SIGCONT)
                rank.proc.kill()
                rank.proc.join(10)
            rank.unlink_segments()
