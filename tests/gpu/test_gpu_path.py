"""The GPU path against a real daemon and a real master, ranks in processes of their own whose KV cache is laid out
as vLLM allocates it: CUDA memory shared over CUDA IPC on a GPU machine (scripts/gpu-check.sh), and on a machine
without one shared memory moved by a daemon standing a CPU in for its GPU (--gpu cpu): the same device mover (plans,
staging slots, rounds, copies from the segment), so a regression in its logic fails the suite before a GPU sees it.

What needs CUDA itself (registration time of CUDA memory, GPU memory given back by a killed rank) is skipped on CPU.
Each test prints RESULT lines (what it measured) for the check's summary.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvsidecar_contract.placement import Geometry, GroupSpec, Layout, Parallel, kind_of, load_plan, save_plan
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.ranks import RankProcess
from support.cuda_rank import BLOCK_TOKENS, DEVICE, CudaRank

pytestmark = pytest.mark.integration

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ON_GPU = DEVICE != "cpu"
LEASE_S = 10.0  # the daemon's default session lease
GQA = [("full_attention", 32, 64 * KiB)]  # Llama-8B-like: 32 layers, 8 KV heads x 16 tokens x (K+V) x bf16
MLA = [("mla", 61, 18 * KiB)]  # DeepSeek-V3-like latent
HYBRID = [("mla", 8, 18 * KiB), ("full_attention", 8, 64 * KiB), ("mamba", 8, 256 * KiB)]
# On CPU the same kinds, smaller: 24 blocks of 840 KiB through 4 MiB staging slots are several rounds.
SMALL_GQA = [("full_attention", 4, 64 * KiB)]
SMALL_HYBRID = [("mla", 4, 18 * KiB), ("full_attention", 4, 64 * KiB), ("mamba", 2, 256 * KiB)]
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA memory (a GPU): tests/gpu runs on CPU what it can")


def result(name: str, value: object) -> None:
    print(f"RESULT {name}: {value}", flush=True)


def wait_for(what: str, check, timeout: float, every: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    """Seconds until check() holds; fails the test past timeout."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(every)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:  # type: ignore[no-untyped-def]
    workdir = tmp_path_factory.mktemp("daemon")
    if ON_GPU:
        flags = ("--gpu-staging-size", "256MiB")
        d = DaemonProcess(workdir, session_ttl=LEASE_S, segment_size="8GiB", log_level="info", extra=flags)
    else:
        flags = ("--gpu", "cpu", "--gpu-staging-size", "16MiB", "--gpu-bounce-size", "16MiB")
        d = DaemonProcess(workdir, session_ttl=LEASE_S, segment_size="128MiB", extra=flags)
    d.start(timeout=120)
    if ON_GPU:
        # CUDA and the page-locked segment start in the background: the speed checks want the segment locked.
        wait_for(
            "segment page-locked",
            lambda: d.metric_samples("kvsidecar_gpu_pinned_segment_bytes").get("", 0.0) > 0,
            120,
            0.2,
        )
    yield d
    d.stop()
    print((d.workdir / "daemon.log").read_text()[-3000:])


def rank(daemon: DaemonProcess, tmp: Path, name: str, groups, blocks: int) -> RankProcess:  # type: ignore[no-untyped-def]
    """A CudaRank in a process of its own (its first CUDA call included in the start)."""
    proc = RankProcess(CudaRank, daemon.target, "gpu/check", groups, blocks, name=name, log_path=tmp / f"{name}.log")
    return proc.start(timeout=120)


def pairs(groups, hashes, saved, loaded, hit, tails):  # type: ignore[no-untyped-def]
    """Per group, the (destination, source) blocks a load of `hit` tokens into `loaded` reads from `saved`."""
    layout = Layout("gpu/check", tuple(GroupSpec(kind_of(k), BLOCK_TOKENS) for k, _, _ in groups), Parallel(), 8)
    geo = Geometry.of(layout)
    source = {c.key: c.block_id for c in save_plan(geo, hashes, saved, len(hashes) * BLOCK_TOKENS + 1).chunks}
    out: dict[int, list[tuple[int, int]]] = {g: [] for g in range(len(groups))}
    for c in load_plan(geo, hashes, loaded, hit, tails):
        out[c.group].append((c.block_id, source[c.key]))
    return out


CASES = [("gqa", GQA), ("mla", MLA), ("hybrid", HYBRID)] if ON_GPU else [("hybrid", SMALL_HYBRID)]


@pytest.mark.parametrize(("name", "groups"), CASES, ids=[name for name, _ in CASES])
def test_a_fresh_process_loads_every_byte_another_saved(daemon, tmp_path, name, groups):
    # On a GPU, 40 blocks of GQA are 80 MiB: two rounds of a 64 MiB slot.
    n, blocks = (40, 128) if ON_GPU else (24, 48)
    writer = rank(daemon, tmp_path, f"{name}-writer", groups, blocks)
    reader = rank(daemon, tmp_path, f"{name}-reader", groups, blocks)
    try:
        for r in (writer, reader):
            r.call("register")
        writer.call("fill", seed=1)
        reader.call("fill", seed=2)
        hashes = chained_hashes(f"gpu/{name}", n)
        saved = [list(range(n))] * len(groups)
        out = writer.call("save", hashes=hashes, ids=saved, tokens=n * BLOCK_TOKENS + 1)
        assert out["failed"] == 0 and out["written"] > 0
        hit, tails = reader.call("lookup", hashes=hashes, tokens=n * BLOCK_TOKENS + 1)
        assert hit == n * BLOCK_TOKENS
        loaded = [list(range(blocks - n, blocks))] * len(groups)
        got = reader.call("load", hashes=hashes, ids=loaded, hit_tokens=hit, tails=list(tails))
        assert got["failed"] == []
        expected = pairs(groups, hashes, saved, loaded, hit, tails)
        assert got["loaded"] == sum(len(p) for p in expected.values())
        for g, moved in expected.items():
            assert reader.call("matches", group=g, pairs=moved, seed=1) == [], f"group {g}: blocks with wrong bytes"
        result(f"{name} round trip", f"{got['loaded']} blocks byte-exact (save {out['seconds'] * 1e3:.1f} ms, "
               f"load {got['seconds'] * 1e3:.1f} ms)")  # fmt: skip
    finally:
        writer.stop()
        reader.stop()
    if not ON_GPU:
        # The daemon moved them through its device mover: a CPU stood in for its GPU.
        assert daemon.metric_samples("kvsidecar_gpu_staging_bytes").get("", 0.0) == 16 * MiB


def test_values_missing_from_the_store_fail_alone_and_leave_their_blocks(daemon, tmp_path):
    r = rank(daemon, tmp_path, "partial", GQA if ON_GPU else SMALL_GQA, 64)
    try:
        r.call("register")
        r.call("fill", seed=3)
        stored = chained_hashes("gpu/partial", 8)
        r.call("save", hashes=stored[:5], ids=[list(range(5))], tokens=5 * BLOCK_TOKENS + 1)
        hashes = stored[:5] + chained_hashes("gpu/never-saved", 3)
        got = r.call("load", hashes=hashes, ids=[list(range(32, 40))], hit_tokens=8 * BLOCK_TOKENS, tails=[128])
        assert got["loaded"] == 5 and got["failed"] == [(0, 37), (0, 38), (0, 39)]
        assert r.call("matches", group=0, pairs=[(32 + i, i) for i in range(5)], seed=3) == []
        # A block that failed still holds what it held (fill(3) put block 37's own bytes there).
        assert r.call("matches", group=0, pairs=[(37, 37), (38, 38), (39, 39)], seed=3) == []
    finally:
        r.stop()


@needs_cuda
@pytest.mark.parametrize("gib", [8, 64])
def test_registering_cuda_memory_of_any_size_takes_under_a_second(daemon, tmp_path, gib):
    blocks = (gib * GiB) // (64 * KiB)
    r = rank(daemon, tmp_path, f"register-{gib}", [("full_attention", 1, 64 * KiB)], blocks)
    try:
        seconds = r.call("register", timeout=120)
        result(f"register {gib} GiB of CUDA memory", f"{seconds:.3f} s (target <= 1 s)")
        assert seconds <= 1.0
    finally:
        r.stop()


def settled_free_bytes(timeout: float = 30.0) -> int:
    """The GPU's free memory once it stops moving (memory an earlier test's processes held is back by then)."""
    last = torch.cuda.mem_get_info()[0]
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        time.sleep(0.5)
        now = torch.cuda.mem_get_info()[0]
        if abs(now - last) < 64 * MiB:
            return int(now)
        last = now
    pytest.fail(f"the GPU's free memory did not settle within {timeout} s")


@needs_cuda
def test_a_killed_rank_gives_its_gpu_memory_back_within_the_lease(daemon, tmp_path):
    torch.cuda.init()
    registered = "kvsidecar_registered_region_bytes"
    free_before = settled_free_bytes()
    mapped_before = daemon.metric_samples(registered).get("", 0.0)
    blocks = (8 * GiB) // (64 * KiB)
    doomed = rank(daemon, tmp_path, "doomed", [("full_attention", 1, 64 * KiB)], blocks)
    doomed.call("register")
    assert torch.cuda.mem_get_info()[0] < free_before - 7 * GiB
    assert daemon.metric_samples(registered).get("", 0.0) >= mapped_before + 8 * GiB
    doomed.kill()

    def released() -> bool:
        # This rank's 8 GiB, and no earlier test's memory: the daemon let go of exactly its mapping.
        ours = daemon.metric_samples(registered).get("", 0.0) <= mapped_before
        return ours and torch.cuda.mem_get_info()[0] > free_before - GiB

    back = wait_for("8 GiB back", released, LEASE_S + 30, 0.1)
    result("GPU memory of a rank killed -9 back after", f"{back:.1f} s (lease {LEASE_S:.0f} s; target lease + 1 s)")
    assert back <= LEASE_S + 1
    # The daemon serves the next rank as before.
    survivor = rank(daemon, tmp_path, "survivor", GQA, 16)
    try:
        survivor.call("register")
        survivor.call("fill", seed=4)
        hashes = chained_hashes("gpu/survivor", 4)
        assert survivor.call("save", hashes=hashes, ids=[[0, 1, 2, 3]], tokens=65)["failed"] == 0
    finally:
        survivor.stop()
