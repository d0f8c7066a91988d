"""A well-behaved engine rank on the real client library, running beside a fuzzer and verifying every byte it loads.

Layout: TP=1, groups [full_attention/16, mamba/32], U=16, so hits are fine-grained and both an attention prefix and a
recurrent state are read back. Each round saves a fresh prompt, looks it up, loads it into other blocks and compares
them with what the rank computed; anything else (an error, a short hit, a failed block, one wrong byte) is a failure.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import traceback

from kvsidecar_client import Deadlines, EngineLayout, GroupSpec, SidecarClient, shared_tensor

U = 16
SPANS = (16, 32)
NUM_BLOCKS = 64
BLOCK_BYTES = 512
POISON = b"\xa5" * BLOCK_BYTES


def content(tag: str, kind: str, block_hash: bytes, n: int = BLOCK_BYTES) -> bytes:
    """What a block computed for this prefix holds."""
    seed = hashlib.sha256(f"{tag}/{kind}/".encode() + block_hash).digest()
    return (seed * (n // len(seed) + 1))[:n]


class GoodClient:
    """Start it, let the fuzzer run, then `check()`: it raises if any round went wrong or none ran."""

    def __init__(self, target: str, tag: str, pause: float = 0.005) -> None:
        import torch

        self.tag = tag
        self.pause = pause
        self.client = SidecarClient.connect(
            target,
            model=f"org/FuzzGood-{tag}",
            layout=EngineLayout(),
            num_kv_heads=1,
            hash_block_size=U,
            groups=[GroupSpec("full_attention", 16), GroupSpec("mamba", 32)],
            client_name=f"good-{tag}",
            # Correctness is the point here, not latency: a shared CI machine may stall a lookup past the default 5 s
            # (which would answer a degraded miss, counted as a failure below).
            deadlines=Deadlines(lookup=60.0),
        )
        self.tensors = [shared_tensor((NUM_BLOCKS, BLOCK_BYTES), torch.uint8) for _ in SPANS]
        self.client.register(self.tensors, [(0,), (1,)])
        self.rounds = 0
        self.blocks_verified = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._rng = random.Random(tag)
        self._thread = threading.Thread(target=self._run, name="good-client", daemon=True)

    def start(self) -> GoodClient:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()

    def check(self) -> None:
        """Raise AssertionError with the first failures, or when no round completed."""
        if self.failures:
            raise AssertionError(f"the well-behaved client failed {len(self.failures)} times: {self.failures[:3]}")
        if not self._thread.is_alive() and not self._stop.is_set():
            raise AssertionError("the well-behaved client's thread ended early")

    # --- one round ---

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception:
                self.failures.append(traceback.format_exc(limit=4))
                time.sleep(0.2)
            time.sleep(self.pause)

    def _write(self, group: int, block: int, data: bytes) -> None:
        import torch

        self.tensors[group][block].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _read(self, group: int, block: int) -> bytes:
        return self.tensors[group][block].numpy().tobytes()

    def _round(self) -> None:
        k = self._rng.randint(1, 8)
        n = k * U
        seed = hashlib.sha256(f"{self.tag}/{self.rounds}/{self._rng.random()}".encode()).digest()
        hashes = []
        for i in range(k):
            seed = hashlib.sha256(seed + bytes([i])).digest()
            hashes.append(seed)
        half = NUM_BLOCKS // 2
        m = -(-n // SPANS[1])  # mamba blocks: every block end, and the state at the last U boundary
        attn_src = self._rng.sample(range(half), k)
        mamba_src = self._rng.sample(range(half), m)
        for i, b in enumerate(attn_src):
            self._write(0, b, content(self.tag, "attn", hashes[i]))
        for j, b in enumerate(mamba_src):
            boundary = min((j + 1) * SPANS[1], n)
            self._write(1, b, content(self.tag, "mamba", hashes[boundary // U - 1]))
        saved = self.client.save(hashes, [attn_src, mamba_src], n).result(timeout=60)
        if saved.failed or saved.written != k + m:
            raise AssertionError(f"save of a fresh prompt: {saved}")
        hit = self.client.lookup(hashes, n + 1)
        if (hit.hit_tokens, hit.tail_boundaries, hit.degraded) != (n, (n, n), False):
            raise AssertionError(f"lookup of a saved {n}-token prompt: {hit}")
        attn_dst = self._rng.sample(range(half, NUM_BLOCKS), k)
        mamba_dst = self._rng.sample(range(half, NUM_BLOCKS), m)
        for b in attn_dst:
            self._write(0, b, POISON)
        for b in mamba_dst:
            self._write(1, b, POISON)
        loaded = self.client.load_detailed(hashes, [attn_dst, mamba_dst], hit)
        if loaded.failures or loaded.loaded != k + 1:
            raise AssertionError(f"load of a {n}-token hit: {loaded}")
        for i, b in enumerate(attn_dst):
            if self._read(0, b) != content(self.tag, "attn", hashes[i]):
                raise AssertionError(f"attention block {i} of a {n}-token prompt came back wrong")
        for j, b in enumerate(mamba_dst):
            want = content(self.tag, "mamba", hashes[n // U - 1]) if j == m - 1 else POISON
            if self._read(1, b) != want:
                raise AssertionError(f"mamba block {j} of {m} ({n} tokens) holds the wrong bytes")
        self.blocks_verified += k + m
        self.rounds += 1
