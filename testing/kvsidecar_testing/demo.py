"""`kvsidecar demo` (the `kvsidecar-demo` command): the main job in one command, checked byte for byte.

Simulated ranks of a small hybrid model (MLA + sliding-window attention + Mamba, TP ranks in threads, each with its
own client and shared-memory KV cache) prefill a prompt and save it (cold pass), clear their cache, then look the
prompt up and load it into other blocks (warm pass). Every rank checks every block of its cache against the bytes it
holds by construction: the latent is the same on every rank, attention heads follow the KV head, Mamba state follows
the rank. Uses the daemon at --socket, or, if none answers there, starts one (with an embedded Mooncake master) in a
temporary folder and stops it at the end. The demo's blocks live under a cache prefix of their own (one per run, or
--cache-prefix: a prefix a daemon with a tenants file grants the demo's uid) and are removed at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsidecar_contract.paths import default_socket_path

if TYPE_CHECKING:
    import torch

    from kvsidecar_client import GroupSpec, Hit, SidecarClient
    from kvsidecar_contract.placement import Layout
    from kvsidecar_testing.oracle import Prompt

MODEL = "kvsidecar-demo/hybrid-tiny"
HASH_BLOCK = 16  # U: tokens per block hash, and per physical block of every group
WINDOW = 32  # tokens the sliding-window layers attend to
NUM_KV_HEADS = 1  # of the sliding-window layers
NUM_BLOCKS = 64  # per KV-cache tensor of each rank
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0

# (group, shape of one block, dtype): a latent, K and V of one head, and a Mamba layer's conv and SSM state.
TENSORS = (
    (0, (16, 576), "bfloat16"),
    (1, (2, 16, 1, 64), "bfloat16"),
    (2, (3, 256), "bfloat16"),
    (2, (4, 16, 16), "float32"),
)


class DemoError(RuntimeError):
    """The demo cannot run (the daemon it started did not come up, a rank failed): its reason, in one line."""


def main(argv: list[str] | None = None) -> int:
    """`kvsidecar-demo`, which `kvsidecar demo` becomes."""
    parser = argparse.ArgumentParser(
        prog="kvsidecar demo",
        description="Simulated ranks of a small hybrid model (MLA + sliding window + Mamba) save a prompt, clear their "
        "cache and load it back through the daemon at --socket (or one started for the demo if none answers there), "
        "checking every byte. Exit 0 only with zero mismatches and zero failed loads.",
    )
    _add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags."""
    parser.add_argument(
        "--socket", default=default_socket_path(), help="the daemon's Unix socket (default: %(default)s)"
    )
    parser.add_argument("--tp", type=int, choices=(1, 2, 4), default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--tokens", type=int, default=200, help="prompt length in tokens, 32..512 (default 200)")
    parser.add_argument(
        "--cache-prefix",
        default="",
        help="the cache prefix of the demo's blocks (default: kvsidecar-demo-<random>, one per run); a daemon with "
        "--tenants grants prefixes by the caller's uid and groups: run the demo as a uid of a tenant and give one of "
        "its prefixes (the demo's model is 'hybrid-tiny', which a tenant's `models` must allow)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the cold and the warm pass; exit 0 only if every loaded byte is right and nothing failed."""
    if args.tokens < 2 * HASH_BLOCK or args.tokens > (NUM_BLOCKS // 2) * HASH_BLOCK:
        print(f"kvsidecar demo: error: --tokens must be in [{2 * HASH_BLOCK}, {NUM_BLOCKS // 2 * HASH_BLOCK}]")
        return 2
    try:
        with _daemon(args.socket) as target:
            return _demo(target, args.tp, args.tokens, args.cache_prefix)
    except DemoError as exc:
        print(f"kvsidecar demo: error: {exc}")
        return 1


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
    from kvsidecar_testing.processes import DaemonProcess

    target = f"unix://{socket_path}"
    if os.path.exists(socket_path) and _serving(target):
        print(f"daemon: {target}")
        yield target
        return
    folder = tempfile.mkdtemp(prefix="kvsidecar-demo-")
    daemon = DaemonProcess(Path(folder), session_ttl=None, log_level="warning")
    try:
        try:
            daemon.start(START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            raise DemoError(f"the daemon started for the demo did not come up: {exc}") from None
        print(f"daemon: none answers at {socket_path}; started one for this demo (pid {daemon.pid}, embedded master)")
        yield daemon.target
    finally:
        code = daemon.stop(STOP_TIMEOUT_S)
        shutil.rmtree(folder, ignore_errors=True)
        print(f"daemon: stopped the one started for this demo (exit {code})")


# ---- the simulated engine -------------------------------------------------------------------------------------------


def _groups() -> list[GroupSpec]:
    from kvsidecar_client import GroupSpec

    return [
        GroupSpec("mla", HASH_BLOCK),
        GroupSpec("sliding_window", HASH_BLOCK, window=WINDOW),
        GroupSpec("mamba", HASH_BLOCK),
    ]


def _layout(tp: int, rank: int = 0) -> Layout:
    """The engine as the byte oracle sees it."""
    from kvsidecar_contract.placement import GroupSpec, Kind, Layout, Parallel

    groups = (
        GroupSpec(Kind.MLA, HASH_BLOCK),
        GroupSpec(Kind.SLIDING_WINDOW, HASH_BLOCK, window=WINDOW),
        GroupSpec(Kind.MAMBA, HASH_BLOCK),
    )
    return Layout(MODEL, groups, Parallel(tp, rank), NUM_KV_HEADS, HASH_BLOCK)


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
        self.value_bytes = self.client.register(self.tensors, [(group,) for group, _, _ in TENSORS]).value_bytes

    def block(self, tensor: int, block: int) -> tuple[int, int]:
        view = self.tensors[tensor][block]
        return view.data_ptr(), view.numel() * view.element_size()

    def clear(self) -> None:
        from kvsidecar_testing import oracle

        for t in self.tensors:
            ctypes.memset(t.data_ptr(), oracle.POISON, t.numel() * t.element_size())

    def close(self) -> None:
        self.client.close()


def _cold_ids(num_tokens: int) -> list[list[int]]:
    return [list(range(-(-num_tokens // HASH_BLOCK)))] * 3


def _warm_ids(num_tokens: int) -> list[list[int]]:
    # Other blocks than the prefill used, counted down from the top, as a cleared cache hands them out.
    return [[NUM_BLOCKS - 1 - k for k in range(-(-num_tokens // HASH_BLOCK))]] * 3


def _cold(rank: _Rank, prompt: Prompt) -> str:
    from kvsidecar_testing import oracle

    ids = _cold_ids(prompt.num_tokens)
    layout = _layout(rank.tp, rank.rank)
    for t, (group, _, _) in enumerate(TENSORS):
        for k, tag in oracle.cold_block_tags(layout, group, t, oracle.RankId(rank.rank), prompt).items():
            address, size = rank.block(t, ids[group][k])
            ctypes.memmove(address, oracle.pattern(tag, size), size)
    saved = rank.client.save(prompt.hashes, ids, prompt.num_tokens).result()
    line = f"  rank {rank.rank}: saved {_blocks(saved.written)} ({_size(saved.bytes_written)})"
    if saved.striped_to_others:
        n = saved.striped_to_others
        line += (
            f", {n} replicated {'one' if n == 1 else 'ones'} left to the other {'rank' if rank.tp == 2 else 'ranks'}"
        )
    if saved.failed:
        line += f", {saved.failed} FAILED ({', '.join(sorted({f.reason for f in saved.failures}))})"
    return line


def _warm(rank: _Rank, prompt: Prompt, hit: Hit) -> tuple[str, int, int]:
    from kvsidecar_testing import oracle

    ids = _warm_ids(prompt.num_tokens)
    loaded = rank.client.load_detailed(prompt.hashes, ids, hit)
    layout = _layout(rank.tp, rank.rank)
    mismatches = 0
    for t, (group, _, _) in enumerate(TENSORS):
        tags = oracle.warm_block_tags(layout, group, t, oracle.RankId(rank.rank), prompt, hit.hit_tokens)
        want = {ids[group][k]: tag for k, tag in tags.items()}
        for block in range(NUM_BLOCKS):
            address, size = rank.block(t, block)
            expected = oracle.pattern(want[block], size) if block in want else bytes([oracle.POISON]) * size
            mismatches += ctypes.string_at(address, size) != expected
    failed = len(loaded.failures)
    # Blocks of every group, by the group's first tensor (a Mamba block's two tensors are one value).
    first = {group: t for t, (group, _, _) in reversed(list(enumerate(TENSORS)))}
    counts = {
        g.kind: len(
            oracle.warm_block_tags(layout, group, first[group], oracle.RankId(rank.rank), prompt, hit.hit_tokens)
        )
        for group, g in enumerate(_groups())
    }
    by_group = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    line = (
        f"  rank {rank.rank}: loaded {_blocks(loaded.loaded)} ({_size(loaded.bytes_loaded)}: {by_group}) into other "
        f"blocks, {failed} failed, {mismatches} mismatched"
    )
    return line, failed, mismatches


def _block_sizes(value_bytes: tuple[int, ...]) -> str:
    """Why a load of fewer blocks than a save can move more bytes: what one block of each group holds."""
    sizes = ", ".join(f"{g.kind} {_size(n)}" for g, n in zip(_groups(), value_bytes, strict=True))
    return (
        f"  blocks differ by group ({sizes}): a save writes every group's blocks (MLA's shared out\n"
        "  among the ranks), a load only what the hit needs: every MLA block, the window's last ones, one Mamba state"
    )


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _demo(target: str, tp: int, num_tokens: int, cache_prefix: str = "") -> int:
    from kvsidecar_client import EngineLayout, PermissionDenied, SidecarClient, SidecarError
    from kvsidecar_testing.oracle import Prompt

    run_id = secrets.token_hex(4)
    # This run's blocks only (the prompt's hashes are the run's own too); removed at the end.
    cache_prefix = cache_prefix or f"kvsidecar-demo-{run_id}"
    prompt = Prompt(run_id, num_tokens, HASH_BLOCK)
    hashes = prompt.hashes
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
        for line in pool.map(lambda r: _cold(r, prompt), ranks):
            print(line)

        for rank in ranks:
            rank.clear()
        hit = scheduler.lookup(hashes, num_tokens, miss_on_unavailable=False)
        tails = "/".join(str(t) for t in hit.tail_boundaries)
        print(f"warm pass: cache cleared; lookup hit {hit.hit_tokens} of {num_tokens} tokens (tails {tails})")
        if hit.degraded:
            print(f"  the lookup is degraded: {hit.detail} (see `kvsidecar status`)")
        failed = mismatched = 0
        for line, rank_failed, rank_mismatched in pool.map(lambda r: _warm(r, prompt, hit), ranks):
            print(line)
            failed += rank_failed
            mismatched += rank_mismatched
        print(_block_sizes(ranks[0].value_bytes))
        if hit.hit_tokens == 0:
            print("FAILED: the warm pass found nothing of what the cold pass saved")
            return 1
        if failed or mismatched:
            print(
                f"FAILED: {_blocks(failed)} failed to load; {_blocks(mismatched)} with other bytes than their rank "
                "saved"
            )
            return 1
        print(f"OK: every rank got its own bytes back, 0 mismatches ({hit.hit_tokens} tokens not recomputed)")
        return 0
    except PermissionDenied as exc:
        raise DemoError(
            f"the daemon refused the demo's session under cache prefix {cache_prefix!r} ({exc}): a daemon with a "
            "tenants file grants prefixes by uid and groups; run the demo as a tenant's uid with --cache-prefix "
            "one of its prefixes"
        ) from None
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


if __name__ == "__main__":
    sys.exit(main())
