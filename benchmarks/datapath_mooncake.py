"""The daemon's Python around real store calls: DataPath in one process over a real Mooncake store, no RPC.

    python benchmarks/datapath_mooncake.py [--before /tmp/before] [--checksums off,sampled] [--blocks 8]
                                           [--rounds 300] [--repeat 3]

Each run is a child process of one tree (this one, and with --before another checkout, as benchmarks/crossing.py
takes it) and one --checksums mode, over one shared master: MLA saves of new keys (engine memory in one allocation,
as vLLM lays it out) and their loads, a 0.5 ms pause after each (a daemon idles between requests). Printed per run:
p50 of the whole save and of its store calls (existence check, put), and of everything else (the data path's and
the mover's Python, p50 and the mean of the fastest 90%); the same for the load and its get. Runs take turns, tree by
tree, --repeat times. What datapath_overhead.py measures over a stub store, here with the caches an 8 MiB copy
leaves: the Python costs two to three times as much.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODES = ("off", "sampled", "all")


def child(master: str, mode: str, blocks: int, rounds: int) -> dict[str, float]:
    """One tree's run (imports whichever kvsidecar PYTHONPATH names)."""
    import torch

    from kvsidecar.datapath.transfers import DataPath
    from kvsidecar.memory.mappings import Opener
    from kvsidecar.memory.regions import SessionMemory
    from kvsidecar.metrics import Metrics
    from kvsidecar.rpc import wire
    from kvsidecar.sessions.registry import SessionRegistry
    from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore
    from kvsidecar.values import LoadArgs, Role, SaveArgs
    from kvsidecar_bench.shapes import BLOCK_TOKENS, MLA, Request
    from kvsidecar_client import shared_tensor
    from kvsidecar_contract.placement import save_plan

    try:
        from kvsidecar_client.descriptions import describe_regions
    except ImportError:  # a checkout from before the client's modules were renamed (d58d629)
        from kvsidecar_client.memory import describe_regions  # type: ignore[import-not-found,no-redef]

    torch.set_num_threads(1)
    store = MooncakeStore.connect(
        MooncakeSettings(local_hostname="127.0.0.1", master_server_addr=master, global_segment_size=512 << 20)
    )
    if store.prefault is not None:
        store.prefault.done.wait(60)  # as a daemon's segment is by the time requests come
    # One allocation, every layer a view of it, as vLLM lays it out (whatever the tree's bench does).
    whole = shared_tensor((MLA.regions, 2 * blocks, BLOCK_TOKENS, *MLA.token_dims), torch.bfloat16)
    tensors = list(whole.unbind(0))
    # A checkout from before the movers (d58d629) has no checksums; its sessions register memory themselves. (Asked
    # of the registry: an editable install of this tree would supply the movers' modules to an older checkout.)
    movers: Any = None
    if "movers" in inspect.signature(SessionRegistry).parameters:
        from kvsidecar.movers.factory import Movers
        from kvsidecar.movers.trailer import ChecksumSettings

        movers = Movers(store, checksums=ChecksumSettings(mode))
        sessions = SessionRegistry(60, movers)
    else:
        sessions = SessionRegistry(60, register=store.register_buffer, unregister=store.unregister_buffer)  # type: ignore[call-arg]
    session = sessions.open(Role.RANK, MLA.layout("bench/x"), 32, "x")
    fds: list[int] = []
    regions = describe_regions([(t, (0,), None) for t in tensors], fds)
    session.memory = SessionMemory(wire.regions(regions), 1, Opener(fds))
    if movers is not None:
        session.mover = movers.mover(session.memory)
    datapath = DataPath(store, Metrics())
    spans: dict[str, list[int]] = {"save": [], "exists": [], "put": [], "load": [], "get": []}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[name].append(time.perf_counter_ns() - start)

        return call

    store.exists = timed("exists", store.exists)  # type: ignore[method-assign]
    store.put_from = timed("put", store.put_from)  # type: ignore[method-assign]
    store.get_into = timed("get", store.get_into)  # type: ignore[method-assign]
    warm = 20
    for r in range(warm + rounds):
        request = Request.of(MLA, f"datapath-mooncake/{time.time()}/{r}", blocks, blocks)
        start = time.perf_counter_ns()
        saved = datapath.save(session, SaveArgs(request.hashes, [request.save_ids], request.num_tokens, 0))
        spans["save"].append(time.perf_counter_ns() - start)
        start = time.perf_counter_ns()
        hit = blocks * 16
        loaded = datapath.load(session, LoadArgs(request.hashes, [request.load_ids], hit, [hit], 0))
        spans["load"].append(time.perf_counter_ns() - start)
        if saved.written != blocks or loaded.failures:
            raise SystemExit(f"round {r}: {saved} {loaded}")
        chunks = save_plan(session.geometry, request.hashes, [request.save_ids], request.num_tokens, 0).chunks
        store.remove([c.key for c in chunks])
        time.sleep(0.0005)
    store.close()
    s = {k: v[warm:] for k, v in spans.items()}
    save_rest = [a - b - c for a, b, c in zip(s["save"], s["exists"], s["put"], strict=True)]
    load_rest = [a - b for a, b in zip(s["load"], s["get"], strict=True)]
    out = {k: statistics.median(v) / 1e3 for k, v in s.items()}
    for name, rest in (("save_rest", save_rest), ("load_rest", load_rest)):
        out[name] = statistics.median(rest) / 1e3
        out[name + "_mean90"] = statistics.fmean(sorted(rest)[: int(0.9 * len(rest))]) / 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another checkout of the repo: its runs take turns with this tree's")
    parser.add_argument("--checksums", default="off,sampled", help="this tree's runs, one per mode")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MASTER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        # The bench package too comes from the tree PYTHONPATH names, not from this file's folder.
        folder = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != folder]
        print(json.dumps(child(args.child[0], args.child[1], args.blocks, args.rounds)))
        return
    from kvsidecar.daemon.master import EmbeddedMaster
    from kvsidecar_testing.mooncake_env import MooncakeEnv

    here = Path(__file__).resolve().parent.parent
    runs = [(f"this, {mode}", None, mode) for mode in args.checksums.split(",")]
    if args.before:
        runs.append(("before", Path(args.before).resolve(), "off"))
    work = Path(tempfile.mkdtemp(prefix="kvsidecar-datapath-mooncake-"))
    print(f"MLA, {args.blocks} blocks, {args.rounds} rounds; us, p50 (rest also: mean of the fastest 90%)")
    print("| run | save | exists | put | rest | load | get | rest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with MooncakeEnv(work) as env, EmbeddedMaster(log_path=work / "master.log") as master:
        for _ in range(args.repeat):
            for name, tree, mode in runs:
                # The child is this file whichever tree it runs: the tree's code comes from PYTHONPATH.
                paths = [(tree or here) / p for p in ("", "contract", "client", "benchmarks", "testing")]
                extra = {"PYTHONPATH": os.pathsep.join(map(str, paths))}
                command = [sys.executable, str(Path(__file__).resolve()), "--child", master.address, mode]
                command += ["--blocks", str(args.blocks)]
                command += ["--rounds", str(args.rounds)]
                done = subprocess.run(
                    command,
                    cwd=work,
                    env=env.child_env(extra),
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                )
                if done.returncode:
                    print(f"| {name} | failed: {done.stderr.strip()[-300:]} |")
                    continue
                r = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"| {name} | {r['save']:.0f} | {r['exists']:.0f} | {r['put']:.0f} | "
                    f"{r['save_rest']:.0f} ({r['save_rest_mean90']:.0f}) | {r['load']:.0f} | {r['get']:.0f} | "
                    f"{r['load_rest']:.0f} ({r['load_rest_mean90']:.0f}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
