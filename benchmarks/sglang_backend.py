"""SGLang's HiCache L3 calls through kvsidecar against SGLang's own Mooncake backend, in-process, on the same pool.

Three backends are built by SGLang's backend factory over one host pool of SGLang's (its shm allocator, page_first),
side by side in one run, rounds rotating: `batch_set_v1` of fresh pages (a batch of SGLang's 128, never stored
before), then `batch_get_v1` of the same pages into other slots. kvsidecar in place (the default): the pool was
moved into a sealed memfd at registration and the daemon (another process) reads and writes its pages directly,
from and into its Mooncake segment. kvsidecar staged (`zero_copy: false`, the fallback): the rank copies the pages
through its sealed staging area. Mooncake: SGLang's MooncakeStore registers the pool and calls Mooncake's zero-copy
batch put/get in the engine's process (its own segment: Mooncake's memcpy path). Pages per second, GiB/s and each
kvsidecar path / Mooncake, medians of rounds.

    .venv-sglang/bin/pip install mooncake-transfer-engine-non-cuda==0.3.13.post1   # SGLang's backend needs it
    flock /tmp/kvsidecar-heavy.lock .venv-sglang/bin/python benchmarks/sglang_backend.py --out /tmp/sglang-bench

The daemon and mooncake_master run from the main venv (`scripts/setup.sh`), as in tests/sglang.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / sub) for sub in ("tests/sglang", "tests/vllm_connector", ".", "testing")]

from sidecar_daemon import SidecarDaemon  # noqa: E402

from kvsidecar_testing.mooncake_env import MooncakeEnv  # noqa: E402
from kvsidecar_testing.processes import LOOPBACK, free_port, stop_pid  # noqa: E402

GIB = 2**30
SHAPES = {
    # name: (kind, layers, page tokens, KV heads, head dim)
    "mha": ("mha", 16, 32, 4, 128),  # 1 MiB pages (K and V, bf16)
    "mla": ("mla", 61, 16, 1, 0),  # 61 layers x 40 wide (the test latent) x 16 tokens: 76 KiB pages
}


def _master(workdir: Path, env: MooncakeEnv) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    binary = REPO / ".venv" / "bin" / "mooncake_master"
    args = [str(binary), f"--rpc_port={port}", f"--rpc_address={LOOPBACK}", f"--metrics_port={free_port()}",
            "--enable_metric_reporting=false", "--minloglevel=1"]  # fmt: skip
    log = open(workdir / "master.log", "wb")  # noqa: SIM115 (lives as long as the process)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env.child_env())
    time.sleep(1.0)  # the master answers ~0.1 s after spawn; the Mooncake client retries its setup anyway
    return proc, f"{LOOPBACK}:{port}"


def _indices(pages: list[int], page: int) -> Any:
    import torch

    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])


def measure(shape: str, rounds: int, batch: int, workdir: Path) -> dict[str, Any]:
    """Rounds of set then get on both backends, alternating; per backend and op: seconds of each round."""
    from pools import backend, extra_config, fill, host_pool, model_dir

    from kvsidecar_client.sglang.pages import page_pool, pool_buffers

    kind, layers, page, heads, head_dim = SHAPES[shape]
    geometry = {"layers": layers, "page": page, "tokens": 2 * batch * page, "ratio": 1.0}
    if kind == "mha":
        geometry.update(heads=heads, head_dim=head_dim)
    pool = host_pool(kind, "page_first", **geometry)
    fill(pool, 11)
    model = str(model_dir(workdir))
    daemon = SidecarDaemon(workdir / "daemon", segment_size="2GiB")
    (workdir / "daemon").mkdir(exist_ok=True)
    env = MooncakeEnv(workdir)
    master, address = _master(workdir, env)
    os.environ.update(env.child_env())
    os.environ.update(
        MOONCAKE_MASTER=address, MOONCAKE_PROTOCOL="tcp", MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE",
        MOONCAKE_GLOBAL_SEGMENT_SIZE="2gb", MOONCAKE_LOCAL_HOSTNAME=LOOPBACK,
    )  # fmt: skip
    try:
        daemon.start()
        # The daemon pre-faults its segment in the background: measure after, not beside it.
        deadline = time.monotonic() + 300
        while "pre-faulted" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        # In place first: it moves the pool (same addresses), which the other two then use as they find it.
        start = time.perf_counter()
        in_place = backend(pool, model, extra_config(daemon.target, cache_prefix="a"), mla=kind == "mla")
        attach = time.perf_counter() - start  # the move of the pool (pool_bytes) and the session's opening
        backends = {
            "in place": in_place,
            "staged": backend(
                pool, model, extra_config(daemon.target, cache_prefix="b", zero_copy=False), mla=kind == "mla"
            ),
            "mooncake": backend(pool, model, {}, mla=kind == "mla", name="mooncake"),
        }
        page_bytes = sum(r.size for r in page_pool("kv", pool).runs)  # the same page all three store
        write, read = list(range(batch)), list(range(batch, 2 * batch))
        times: dict[str, dict[str, list[float]]] = {n: {"set": [], "get": []} for n in backends}
        order = list(backends.items())
        for r in range(rounds + 1):  # round 0 warms all up and is not counted
            for name, storage in order[r % 3 :] + order[: r % 3]:
                keys = [uuid.uuid4().hex * 2 for _ in range(batch)]
                start = time.perf_counter()
                stored = storage.batch_set_v1(keys, _indices(write, page))
                middle = time.perf_counter()
                loaded = storage.batch_get_v1(keys, _indices(read, page))
                end = time.perf_counter()
                if not (all(stored) and all(loaded)):
                    raise RuntimeError(f"{name}: {stored.count(False)} sets and {loaded.count(False)} gets failed")
                if r:
                    times[name]["set"].append(middle - start)
                    times[name]["get"].append(end - middle)
        backends["in place"].close()
        backends["staged"].close()
        # The Mooncake client unmounts its segment from the master when it goes, which must still run then.
        del backends, order, storage, in_place
    finally:
        daemon.stop()
        stop_pid(master)
        env.close()
    pool_bytes = sum(b.numel() * b.element_size() for b in pool_buffers(pool))
    return {"shape": shape, "batch": batch, "page_bytes": page_bytes, "times": times, "attach_s": attach,
            "pool_bytes": pool_bytes}  # fmt: skip


def report(results: list[dict[str, Any]]) -> str:
    """The markdown table: medians per backend and op, and each kvsidecar path / Mooncake."""
    lines = [
        "| pages | op | in place pages/s | GiB/s | staged pages/s | GiB/s | SGLang's Mooncake pages/s | GiB/s "
        "| in place / Mooncake | staged / Mooncake |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        gib = res["batch"] * res["page_bytes"] / GIB
        for op in ("set", "get"):
            median = {name: statistics.median(times[op]) for name, times in res["times"].items()}
            cells = [f"{res['batch'] / median[n]:.0f} | {gib / median[n]:.2f}" for n in ("in place", "staged")]
            cells.append(f"{res['batch'] / median['mooncake']:.0f} | {gib / median['mooncake']:.2f}")
            ratios = [f"{median['mooncake'] / median[n]:.2f}x" for n in ("in place", "staged")]
            shape = f"{res['shape']} {res['batch']} x {res['page_bytes'] / 2**20:.2f} MiB"
            lines.append(f"| {shape} | {op}_v1 | {' | '.join(cells)} | {' | '.join(ratios)} |")
    moves = [f"{r['shape']}: {r['pool_bytes'] / 2**20:.0f} MiB pool moved and session opened in {r['attach_s']:.2f} s"
             for r in results]  # fmt: skip
    return "\n".join([*lines, "", *moves])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="sglang-bench-")))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in SHAPES:
        workdir = Path(tempfile.mkdtemp(prefix=f"sglang-bench-{shape}-"))
        results.append(measure(shape, args.rounds, args.batch, workdir))
    (args.out / "sglang_backend.json").write_text(json.dumps(results, indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
