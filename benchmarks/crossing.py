"""The cost of crossing into the daemon: small saves and loads, and a null call, per daemon, interleaved.

    python benchmarks/crossing.py [--before /tmp/before] [--blocks 8,16,32,64,128] [--shapes mla,gqa]
                                  [--rounds 15] [--null 400] [--threads] [--checksums off,sampled,all]

Runs one daemon of this tree (and, with --before, one more whose PYTHONPATH is another checkout of the repo, each
with its own master and segment) next to in-process Mooncake (the bench's own path), all on the same engine memory,
taking turns request by request. Prints per path and size: median GiB/s, wall ms per request, CPU ms per request of
the client and of the daemon. The null call is a Save of no blocks through the client (its save pool, gRPC, the
daemon's whole servicer path) and a raw KeepAlive on the channel: p50/p99 wall and CPU per call. --threads also
prints the daemon's CPU per thread (/proc/<pid>/task, grouped by thread name) over the save and load rounds.
--checksums runs one daemon of this tree per --checksums mode instead (each with its own master and segment), and
adds each one's rate as a fraction of the first's (a mode given twice, off,off,..., shows the noise of that).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar_bench.mooncake_direct import InProcessPath
from kvsidecar_bench.paths import DaemonPath, Timing
from kvsidecar_bench.shapes import SHAPES, EngineMemory, Request
from kvsidecar_bench.stats import GIB
from kvsidecar_testing.mooncake_env import MooncakeEnv
from kvsidecar_testing.processes import DaemonProcess

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of a process (threads of one name summed)."""
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            out[name.rstrip("0123456789_-")] += (int(fields[11]) + int(fields[12])) / TICK
    return out


def run_time(pid: int) -> float:
    """CPU seconds of a process's live threads, at nanosecond resolution (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


class Point:
    def __init__(self) -> None:
        self.wall: list[float] = []
        self.own = 0.0  # this process (the client's share)
        self.daemon = 0.0

    def add(self, timing: Timing, own: float, daemon: float) -> None:
        self.wall.append(timing.wall_s)
        self.own += own
        self.daemon += daemon


def cpu_of(fn: Callable[[], Timing], pid: int | None) -> tuple[Timing, float, float]:
    """fn's timing, this process's CPU and the daemon's (pid; None: no daemon) while it ran."""
    d0 = run_time(pid) if pid else 0.0
    cpu0 = time.process_time()
    timing = fn()
    own = time.process_time() - cpu0
    return timing, own, (run_time(pid) - d0) if pid else 0.0


def null_calls(path: DaemonPath, count: int) -> dict[str, tuple[float, float, float]]:
    """p50 and p99 ms and CPU ms per call (client + daemon) of a null save and a raw KeepAlive."""
    from kvsidecar_contract.proto import sidecar_pb2 as pb

    client: Any = path._client
    keeper = client._keeper
    out = {}

    def save() -> None:
        client.save([], [[]], 0).result()

    def keepalive() -> None:
        keeper.rpc("KeepAlive", pb.KeepAliveRequest(session_id=keeper.session.id), 5.0)

    for name, fn in (("null save", save), ("raw KeepAlive", keepalive)):
        for _ in range(20):
            fn()
        times = []
        d0, c0 = run_time(path.daemon.pid), time.process_time()
        for _ in range(count):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        cpu = run_time(path.daemon.pid) - d0 + time.process_time() - c0
        times.sort()
        out[name] = (1e3 * times[len(times) // 2], 1e3 * times[int(len(times) * 0.99)], 1e3 * cpu / count)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another checkout of the repo: a second daemon runs its code")
    parser.add_argument("--blocks", default="8,16,32,64,128")
    parser.add_argument("--shapes", default="mla,gqa")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--null", type=int, default=400, help="null calls per daemon (0: none)")
    parser.add_argument("--segment-size", default="1GiB")
    parser.add_argument("--threads", action="store_true", help="the daemon's CPU per thread")
    parser.add_argument(
        "--checksums", default="", help="daemons of this tree, one per --checksums mode, e.g. off,sampled/32,all"
    )
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="kvsidecar-crossing-"))
    # `python -m kvsidecar` puts its working directory first on sys.path: from a checkout's root every daemon would
    # import that checkout, whatever PYTHONPATH says.
    os.chdir(work)
    mooncake = MooncakeEnv(work)
    segment = int(args.segment_size.removesuffix("GiB")) << 30
    trees: dict[str, tuple[str | None, tuple[str, ...]]] = {"after": (None, ())}
    if args.checksums:
        trees = {}
        for spec in args.checksums.split(","):  # a mode twice (off,off) measures the noise between two daemons
            mode, _, every = spec.partition("/")  # sampled/32: one value in 32
            extra = ("--checksums", mode, *(("--checksum-every", every) if every else ()))
            trees[spec if spec not in trees else f"{spec}-{len(trees)}"] = (None, extra)
    if args.before:
        trees["before"] = (args.before, ())
    with contextlib.ExitStack() as stack:
        daemons: dict[str, DaemonPath] = {}
        for name, (tree, extra) in trees.items():
            folder = work / name.replace("/", "-")  # sampled/32
            master = stack.enter_context(EmbeddedMaster(log_path=work / f"master-{folder.name}.log"))
            env = {}
            if tree:
                env["PYTHONPATH"] = os.pathsep.join(str(Path(tree) / p) for p in ("", "contract", "client"))
            folder.mkdir()
            daemon = DaemonProcess(
                folder, master=master.address, session_ttl=None, segment_size=args.segment_size,
                local_buffer_size=None, log_level="warning", mooncake=mooncake, env=env, extra=extra,
            )  # fmt: skip
            stack.callback(daemon.stop)
            daemon.start()
            daemons[name] = DaemonPath(daemon)
        master_i = stack.enter_context(EmbeddedMaster(log_path=work / "master-in-process.log"))
        in_process = InProcessPath(work / "mooncake.log", master_i.address, segment)
        stack.callback(in_process.close)
        paths: list[Any] = [*daemons.values(), in_process]
        names = [*daemons, "in-process"]
        time.sleep(2)  # segments pre-faulted
        for shape in shapes:
            top = max(blocks)
            memory = EngineMemory.shared(shape, 2 * top, seed=2)
            for p in paths:
                p.begin(shape, memory)
            try:
                points: dict[tuple[str, int, str], Point] = defaultdict(Point)
                threads: dict[str, dict[str, float]] = {}
                before_threads = {n: thread_cpu(d.daemon.pid) for n, d in daemons.items()}
                orders = list(itertools.permutations(zip(names, paths, strict=True)))
                for n in blocks:
                    request = Request.of(shape, f"crossing/{shape.name}/{n}/{time.time()}", n, top)
                    for r in range(args.rounds + 1):
                        # Every order in turn: a path's rate depends on the path run just before it (what that
                        # left in the caches and the run queue), so rotations alone favour the path listed second.
                        order = orders[r % len(orders)]
                        for op in ("save", "load"):
                            for name, p in order:
                                call = p.save if op == "save" else p.load
                                pid = daemons[name].daemon.pid if name in daemons else None
                                timing, own, daemon_cpu = cpu_of(lambda c=call, q=request: c(q), pid)
                                if r:
                                    points[(op, n, name)].add(timing, own, daemon_cpu)
                        for _, p in order:
                            p.clear()
                for name, d in daemons.items():
                    now = thread_cpu(d.daemon.pid)
                    threads[name] = {k: now[k] - before_threads[name].get(k, 0.0) for k in now}
                print(f"\n## {shape.name}: GiB/s | wall ms | client CPU ms | daemon CPU ms (per request, median wall)")
                first, *others = daemons
                head = [*names, *(f"{d}/in-proc" for d in daemons), *(f"CPU/GiB {d}/in-proc" for d in daemons)]
                head += [f"{d}/{first}" for d in others]
                print("| op | blocks | " + " | ".join(head) + " |")
                print("|" + " --- |" * (len(head) + 2))
                for op in ("save", "load"):
                    for n in blocks:
                        nbytes = n * shape.value_bytes
                        cells, rates, cpu = [], {}, {}
                        for name in names:
                            pt = points[(op, n, name)]
                            wall = statistics.median(pt.wall)
                            rates[name] = nbytes / wall / GIB
                            k = len(pt.wall)
                            cpu[name] = (pt.own + pt.daemon) / (k * nbytes / GIB)
                            cells.append(
                                f"{rates[name]:.2f} / {1e3 * wall:.2f} / {1e3 * pt.own / k:.2f} / "
                                f"{1e3 * pt.daemon / k:.2f}"
                            )
                        ratios = [f"{rates[d] / rates['in-process']:.2f}" for d in daemons]
                        ratios += [f"{cpu[d] / cpu['in-process']:.2f}" for d in daemons]
                        ratios += [f"{rates[d] / rates[first]:.3f}" for d in others]
                        print(f"| {op} | {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
                if args.threads:
                    for name, per in threads.items():
                        busy = sorted(per.items(), key=lambda kv: -kv[1])
                        print(f"daemon {name} CPU s by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in busy if v))
            finally:
                for p in paths:
                    p.end()
        if args.null:
            shape = shapes[0]
            memory = EngineMemory.shared(shape, 4, seed=3)
            for d in daemons.values():
                d.begin(shape, memory)
            print("\n## null calls: p50 ms / p99 ms / CPU ms per call (client + daemon)")
            results: dict[str, dict[str, list[tuple[float, float, float]]]] = defaultdict(lambda: defaultdict(list))
            for _ in range(3):  # interleaved in three parts
                for name, d in daemons.items():
                    for call, value in null_calls(d, args.null // 3).items():
                        results[call][name].append(value)
            for call, per in results.items():
                for name, values in per.items():
                    p50 = statistics.median(v[0] for v in values)
                    p99 = statistics.median(v[1] for v in values)
                    cpu = statistics.median(v[2] for v in values)
                    print(f"| {call} | {name} | {p50:.3f} | {p99:.3f} | {cpu:.3f} |")
            for d in daemons.values():
                d.end()
    mooncake.close()


if __name__ == "__main__":
    main()
