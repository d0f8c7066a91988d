"""`kvsidecar demo`: the main job in one command, checked byte for byte.

Simulated ranks of a small hybrid model (MLA + sliding-window attention + Mamba, TP ranks in threads, each with its
own client and shared-memory KV cache) prefill a prompt and save it (cold pass), clear their cache, then look the
prompt up and load it into other blocks (warm pass). Every rank checks every block of its cache against the bytes it
holds by construction: the latent is the same on every rank, attention heads follow the KV head, Mamba state follows
the rank. Uses the daemon at --socket, or, if none answers there, starts one (with an embedded Mooncake master) in a
temporary folder and stops it at the end. The demo's blocks live under a cache prefix of their own and are removed
at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsidecar_contract.paths import default_socket_path

if TYPE_CHECKING:
    import torch

    from kvsidecar_client import GroupSpec, Hit, SidecarClient

MODEL = "kvsidecar-demo/hybrid-tiny"
HASH_BLOCK = 16  # U: tokens per block hash, and per physical block of every group
WINDOW = 32  # tokens the sliding-window layers attend to
NUM_KV_HEADS = 1  # of the sliding-window layers
NUM_BLOCKS = 64  # per KV-cache tensor of each rank
POISON = 0xA5  # what a cleared cache holds
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0

# (group, shape of one block, dtype): a latent, K and V of one head, and a Mamba layer's conv and SSM state.
TENSORS = (
    (0, (16, 576), "bfloat16"),
    (1, (2, 16, 1, 64), "bfloat16"),
    (2, (3, 256), "bfloat16"),
    (2, (4, 16, 16), "float32"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags."""
    parser.add_argument(
        "--socket", default=default_socket_path(), help="the daemon's Unix socket (default: %(default)s)"
    )
    parser.add_argument("--tp", type=int, choices=(1, 2, 4), default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--tokens", type=int, default=200, help="prompt length in tokens, 32..512 (default 200)")


def run(args: argparse.Namespace) -> int:
    """Run the cold and the warm pass; exit 0 only if every loaded byte is right and nothing failed."""
    if args.tokens < 2 * HASH_BLOCK or args.tokens > (NUM_BLOCKS // 2) * HASH_BLOCK:
        print(f"kvsidecar demo: error: --tokens must be in [{2 * HASH_BLOCK}, {NUM_BLOCKS // 2 * HASH_BLOCK}]")
        return 2
    try:
        with _daemon(args.socket) as target:
            return _demo(target, args.tp, args.tokens)
    except DemoError as exc:
        print(f"kvsidecar demo: error: {exc}")
        return 1


class DemoError(RuntimeError):
    """The demo cannot run (no daemon, a daemon that does not start, a call that fails)."""


# ---- the daemon -----------------------------------------------------------------------------------------------------


def _serving(target: str, timeout: float = 1.0) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@contextlib.contextmanager
def _daemon(socket_path: str) -> Iterator[str]:
    """The daemon's target: the one at socket_path, or one started here for the demo's duration."""
    target = f"unix://{socket_path}"
    if os.path.exists(socket_path) and _serving(target):
        print(f"daemon: {target}")
        yield target
        return
    folder = tempfile.mkdtemp(prefix="kvsidecar-demo-")
    own = os.path.join(folder, "kvsidecar.sock")
    command = [
        sys.executable, "-m", "kvsidecar", "serve", "--socket", own, "--metrics-address", "127.0.0.1:0",
        "--segment-size", "64MiB", "--local-buffer-size", "16MiB", "--log-level", "warning",
    ]  # fmt: skip
    log_path = os.path.join(folder, "daemon.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (os.path.exists(own) and _serving(f"unix://{own}")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"the daemon started for the demo did not come up:\n{_tail(log_path)}")
            time.sleep(0.1)
        print(f"daemon: none answers at {socket_path}; started one for this demo (pid {proc.pid}, embedded master)")
        yield f"unix://{own}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
        print(f"daemon: stopped the one started for this demo (exit {proc.returncode})")


def _tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# ---- the simulated engine -------------------------------------------------------------------------------------------


def _groups() -> list[GroupSpec]:
    from kvsidecar_client import GroupSpec

    return [
        GroupSpec("mla", HASH_BLOCK),
        GroupSpec("sliding_window", HASH_BLOCK, window=WINDOW),
        GroupSpec("mamba", HASH_BLOCK),
    ]


def _holder(group: int, rank: int, tp: int) -> str:
    """What a rank truly holds for a group: who else holds the same bytes."""
    if group == 0:
        return "latent"  # replicated on every rank
    if group == 1:
        return f"kv-head-{rank * NUM_KV_HEADS // tp}" if tp > NUM_KV_HEADS else f"kv-heads-of-rank-{rank}"
    return f"state-shard-{rank}"  # Mamba state is sharded by head/dim


def _tag(run_id: str, group: int, tensor: int, holder: str, end: int, hashes: list[bytes]) -> str:
    return f"{run_id}|{group}|{tensor}|{holder}|{end}|{hashes[end // HASH_BLOCK - 1].hex()}"


def _cold_tags(run_id: str, tensor: int, rank: int, tp: int, num_tokens: int, hashes: list[bytes]) -> dict[int, str]:
    """After the prefill: block k holds tokens (or the state) up to min((k + 1) * 16, last complete unit)."""
    group = TENSORS[tensor][0]
    end = num_tokens - num_tokens % HASH_BLOCK
    holder = _holder(group, rank, tp)
    return {
        k: _tag(run_id, group, tensor, holder, min((k + 1) * HASH_BLOCK, end), hashes)
        for k in range(-(-end // HASH_BLOCK))
    }


def _warm_tags(
    run_id: str, tensor: int, rank: int, tp: int, hit: int, cold: dict[int, str], hashes: list[bytes]
) -> dict[int, str]:
    """After loading a hit: the blocks the engine attends to at the hit end, or the state at exactly the hit."""
    if hit == 0:
        return {}
    group = TENSORS[tensor][0]
    last = (hit - 1) // HASH_BLOCK
    if group == 2:
        return {last: _tag(run_id, group, tensor, _holder(group, rank, tp), hit, hashes)}
    first = max(0, hit - WINDOW) // HASH_BLOCK if group == 1 else 0
    return {k: cold[k] for k in range(first, last + 1)}


def _pattern(tag: str, size: int) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(size)


class _Rank:
    """One simulated engine rank: its client and its KV-cache tensors in shared memory."""

    def __init__(self, target: str, rank: int, tp: int, cache_prefix: str) -> None:
        import torch

        from kvsidecar_client import EngineLayout, SidecarClient, shared_tensor

        self.rank, self.tp = rank, tp
        self.client: SidecarClient = SidecarClient.connect(
            target,
            model=MODEL,
            layout=EngineLayout(tp_size=tp, tp_rank=rank),
            num_kv_heads=NUM_KV_HEADS,
            hash_block_size=HASH_BLOCK,
            groups=_groups(),
            cache_prefix=cache_prefix,
            client_name=f"kvsidecar demo rank {rank}",
        )
        self.tensors: list[torch.Tensor] = [
            shared_tensor((NUM_BLOCKS, *shape), getattr(torch, dtype)) for _, shape, dtype in TENSORS
        ]
        self.client.register(self.tensors, [(group,) for group, _, _ in TENSORS])

    def block(self, tensor: int, block: int) -> tuple[int, int]:
        view = self.tensors[tensor][block]
        return view.data_ptr(), view.numel() * view.element_size()

    def clear(self) -> None:
        for t in self.tensors:
            ctypes.memset(t.data_ptr(), POISON, t.numel() * t.element_size())

    def close(self) -> None:
        self.client.close()


def _cold_ids(num_tokens: int) -> list[list[int]]:
    return [list(range(-(-num_tokens // HASH_BLOCK)))] * 3


def _warm_ids(num_tokens: int) -> list[list[int]]:
    # Other blocks than the prefill used, counted down from the top, as a cleared cache hands them out.
    return [[NUM_BLOCKS - 1 - k for k in range(-(-num_tokens // HASH_BLOCK))]] * 3


def _cold(rank: _Rank, run_id: str, num_tokens: int, hashes: list[bytes]) -> str:
    ids = _cold_ids(num_tokens)
    for t, (group, _, _) in enumerate(TENSORS):
        for k, tag in _cold_tags(run_id, t, rank.rank, rank.tp, num_tokens, hashes).items():
            address, size = rank.block(t, ids[group][k])
            ctypes.memmove(address, _pattern(tag, size), size)
    saved = rank.client.save(hashes, ids, num_tokens).result()
    line = f"  rank {rank.rank}: saved {saved.written} blocks ({_size(saved.bytes_written)})"
    if saved.striped_to_others:
        line += f", {saved.striped_to_others} replicated ones left to the other ranks"
    if saved.failed:
        line += f", {saved.failed} FAILED ({', '.join(sorted({f.reason for f in saved.failures}))})"
    return line


def _warm(rank: _Rank, run_id: str, num_tokens: int, hashes: list[bytes], hit: Hit) -> tuple[str, int, int]:
    ids = _warm_ids(num_tokens)
    loaded = rank.client.load_detailed(hashes, ids, hit)
    mismatches = 0
    for t, (group, _, _) in enumerate(TENSORS):
        cold = _cold_tags(run_id, t, rank.rank, rank.tp, num_tokens, hashes)
        tags = _warm_tags(run_id, t, rank.rank, rank.tp, hit.hit_tokens, cold, hashes)
        want = {ids[group][k]: tag for k, tag in tags.items()}
        for block in range(NUM_BLOCKS):
            address, size = rank.block(t, block)
            expected = _pattern(want[block], size) if block in want else bytes([POISON]) * size
            mismatches += ctypes.string_at(address, size) != expected
    failed = len(loaded.failures)
    line = (
        f"  rank {rank.rank}: loaded {loaded.loaded} blocks ({_size(loaded.bytes_loaded)}) into other blocks, "
        f"{failed} failed, {mismatches} mismatched"
    )
    return line, failed, mismatches


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _hashes(run_id: str, num_tokens: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(num_tokens // HASH_BLOCK):
        prev = hashlib.sha256(prev + f"{run_id}:{i}".encode()).digest()
        out.append(prev)
    return out


def _demo(target: str, tp: int, num_tokens: int) -> int:
    from kvsidecar_client import EngineLayout, SidecarClient, SidecarError

    run_id = secrets.token_hex(4)
    cache_prefix = f"kvsidecar-demo-{run_id}"  # this run's blocks only; removed at the end
    hashes = _hashes(run_id, num_tokens)
    groups = ", ".join(f"{g.kind}{f':{g.window}' if g.window else ''}/{g.block_size}" for g in _groups())
    print(f"engine: {MODEL}, TP={tp}, groups {groups}, U={HASH_BLOCK}; a prompt of {num_tokens} tokens")
    ranks: list[_Rank] = []
    scheduler: SidecarClient | None = None
    pool = concurrent.futures.ThreadPoolExecutor(tp, thread_name_prefix="demo-rank")
    try:
        scheduler = SidecarClient.connect(
            target, model=MODEL, layout=EngineLayout(tp_size=tp), num_kv_heads=NUM_KV_HEADS,
            hash_block_size=HASH_BLOCK, groups=_groups(), cache_prefix=cache_prefix, role="scheduler",
        )  # fmt: skip
        starting = [pool.submit(_Rank, target, r, tp, cache_prefix) for r in range(tp)]
        concurrent.futures.wait(starting)
        ranks = [f.result() for f in starting if f.exception() is None]
        for f in starting:
            f.result()  # the first rank that could not start ends the demo (after the others are closed)

        hit = scheduler.lookup(hashes, num_tokens, miss_on_unavailable=False)
        print(f"cold pass: lookup hit {hit.hit_tokens} of {num_tokens} tokens; every rank prefills and saves")
        for line in pool.map(lambda r: _cold(r, run_id, num_tokens, hashes), ranks):
            print(line)

        for rank in ranks:
            rank.clear()
        hit = scheduler.lookup(hashes, num_tokens, miss_on_unavailable=False)
        tails = "/".join(str(t) for t in hit.tail_boundaries)
        print(f"warm pass: cache cleared; lookup hit {hit.hit_tokens} of {num_tokens} tokens (tails {tails})")
        if hit.degraded:
            print(f"  the lookup is degraded: {hit.detail} (see `kvsidecar status`)")
        failed = mismatched = 0
        for line, rank_failed, rank_mismatched in pool.map(lambda r: _warm(r, run_id, num_tokens, hashes, hit), ranks):
            print(line)
            failed += rank_failed
            mismatched += rank_mismatched
        if hit.hit_tokens == 0:
            print("FAILED: the warm pass found nothing of what the cold pass saved")
            return 1
        if failed or mismatched:
            print(f"FAILED: {failed} blocks failed to load, {mismatched} blocks hold other bytes than their rank saved")
            return 1
        print(f"OK: every rank got its own bytes back, 0 mismatches ({hit.hit_tokens} tokens not recomputed)")
        return 0
    except (SidecarError, OSError) as exc:
        raise DemoError(f"{type(exc).__name__}: {exc}") from None
    finally:
        if scheduler is not None:
            with contextlib.suppress(SidecarError):
                scheduler.reset()
        for rank in ranks:
            rank.close()
        if scheduler is not None:
            scheduler.close()
        pool.shutdown()
