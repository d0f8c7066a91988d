"""What a lookup costs against how much of the prompt is stored, per tree, side by side in one run.

    python benchmarks/lookup_stored.py [--before CHECKOUT] [--rounds 5] [--tokens 131072]
                                       [--stored 0,0.01,0.1,0.5,1] [--json FILE]

Layout: T=8, H=8, groups [mla, full_attention, mamba], 16-token blocks (17 namespaces per boundary). Each tree (this
one, and with --before another checkout with its own .venv) runs in a worker process of its own interpreter: its
daemon (embedded master, 1 GiB segment), eight rank sessions that save a prompt's first blocks through the public
client (one prompt per stored fraction; 0 is a miss), and a scheduler session that looks each prompt up. The driver
takes turns, round by round, between the trees and the fractions (their order turned each round), and prints the
median lookup per fraction, its ratio to the same tree's full hit, and this tree's time over the other's.
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
from pathlib import Path
from typing import Any

GROUPS = ("mla", "full_attention", "mamba")
TP = 8
KV_HEADS = 8
BLOCK_TOKENS = 16
MODEL = "bench/lookup-stored"
VALUE_BYTES = 64  # per block and group: enough for a key to exist


def _client(target: str, rank: int, role: str) -> Any:
    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

    return SidecarClient.connect(
        target,
        model=MODEL,
        layout=EngineLayout(tp_size=TP, tp_rank=rank),
        num_kv_heads=KV_HEADS,
        hash_block_size=BLOCK_TOKENS,
        groups=[GroupSpec(kind, BLOCK_TOKENS) for kind in GROUPS],
        role=role,
        client_name="lookup-stored",
    )


def _save(target: str, hashes: list[bytes]) -> None:
    """Every rank saves these blocks (a prompt's first len(hashes) blocks), as engines after a prefill do."""
    import torch

    from kvsidecar_client import shared_tensor

    n = len(hashes)
    if not n:
        return
    for rank in range(TP):
        tensors = [shared_tensor((n, VALUE_BYTES), torch.uint8) for _ in GROUPS]
        with _client(target, rank, "rank") as client:
            client.register(tensors, [(g,) for g in range(len(tensors))])
            result = client.save(hashes, [list(range(n))] * len(tensors), n * BLOCK_TOKENS, timeout=600).result()
            if result.failed:
                raise RuntimeError(f"rank {rank} failed to save {result.failed} values")


def _hashes(tag: str, count: int) -> list[bytes]:
    import hashlib

    out, prev = [], b""
    for i in range(count):
        prev = hashlib.sha256(prev + f"{tag}/{i}".encode()).digest()
        out.append(prev)
    return out


def worker(tokens: int, fractions: list[float], workdir: Path) -> None:
    """One tree's daemon and sessions; answers 'lookup FRACTION' lines with the seconds one lookup took."""
    try:
        from kvsidecar_testing.processes import DaemonProcess
    except ImportError:  # a tree from before the test machinery left the daemon's package (the --before side)
        from kvsidecar.testing.processes import Daemon as DaemonProcess  # type: ignore[import-not-found,no-redef]

    daemon = DaemonProcess(workdir, session_ttl=None, segment_size="1GiB", local_buffer_size=None, log_level="warning")
    daemon.start()
    try:
        blocks = tokens // BLOCK_TOKENS
        nonce = f"{os.getpid()}-{time.time_ns()}"
        prompts = {f: _hashes(f"{nonce}/{f}", blocks) for f in fractions}
        for f, hashes in prompts.items():
            _save(daemon.target, hashes[: int(blocks * f)])
        with _client(daemon.target, 0, "scheduler") as scheduler:
            hits = {f: scheduler.lookup(prompts[f], tokens, timeout=120).hit_tokens for f in fractions}
            print(json.dumps({"ready": {str(f): hits[f] for f in fractions}}), flush=True)
            for line in sys.stdin:
                what, _, arg = line.strip().partition(" ")
                if what != "lookup":
                    break
                f = float(arg)
                t0 = time.perf_counter()
                hit = scheduler.lookup(prompts[f], tokens, timeout=120)
                seconds = time.perf_counter() - t0
                if hit.hit_tokens != hits[f] or hit.degraded:
                    raise RuntimeError(f"lookup of {f:.0%} stored: {hit}, expected {hits[f]} tokens")
                print(json.dumps({"seconds": seconds}), flush=True)
    finally:
        daemon.stop()


class Side:
    """One tree's worker process."""

    def __init__(self, name: str, root: Path, python: str, args: argparse.Namespace, workdir: Path) -> None:
        self.name = name
        workdir.mkdir()
        fractions = ",".join(str(f) for f in args.stored)
        command = [python, str(Path(__file__).resolve()), "--worker", "--workdir", str(workdir)]
        command += ["--tokens", str(args.tokens), "--stored", fractions]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(
            command, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.hits: dict[float, int] = {}
        self.seconds: dict[float, list[float]] = {f: [] for f in args.stored}

    def ready(self) -> None:
        got = self._read()
        self.hits = {float(f): t for f, t in got["ready"].items()}

    def lookup(self, fraction: float) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"lookup {fraction}\n")
        return float(self._read()["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None and self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(120)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker ended (exit {self.proc.wait()})")
        return dict(json.loads(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout (with its own .venv) to run side by side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--stored", type=lambda s: [float(x) for x in s.split(",")], default=[0, 0.01, 0.1, 0.5, 1])
    parser.add_argument("--json", type=Path, help="also write the samples here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.tokens, args.stored, args.workdir)
        return
    if 1.0 not in args.stored:
        parser.error("--stored must include 1 (the full hit every ratio is taken against)")
    trees = [("this", Path(__file__).resolve().parents[1], sys.executable)]
    if args.before is not None:
        trees.append(("before", args.before.resolve(), str(args.before.resolve() / ".venv" / "bin" / "python")))
    with tempfile.TemporaryDirectory(prefix="lookup-stored-") as tmp:
        sides = [Side(name, root, python, args, Path(tmp) / name) for name, root, python in trees]
        try:
            for side in sides:
                side.ready()
            first = sides[0].hits
            for side in sides[1:]:
                if side.hits != first:
                    raise RuntimeError(f"the trees disagree on the hits: {first} against {side.hits}")
            for r in range(args.rounds + 1):  # the first round warms up
                order = args.stored if r % 2 else list(reversed(args.stored))
                for i, f in enumerate(order):
                    turn = sides if (r + i) % 2 else list(reversed(sides))
                    for side in turn:
                        seconds = side.lookup(f)
                        if r:
                            side.seconds[f].append(seconds)
        finally:
            for side in sides:
                side.close()
    report(sides, args)


def report(sides: list[Side], args: argparse.Namespace) -> None:
    medians = {s.name: {f: statistics.median(v) for f, v in s.seconds.items()} for s in sides}
    head = "| stored | hit tokens | " + " | ".join(f"{s.name} ms | {s.name} / full hit" for s in sides)
    head += " | this / before |" if len(sides) > 1 else " |"
    print(f"\nT={TP}, H={KV_HEADS}, {list(GROUPS)}, {args.tokens} tokens, median of {args.rounds} rounds\n")
    print(head)
    print("|" + " --- |" * (2 + 2 * len(sides) + (len(sides) > 1)))
    for f in args.stored:
        cells = [f"{f:.0%}", str(sides[0].hits[f])]
        for s in sides:
            cells += [f"{medians[s.name][f] * 1000:.2f}", f"{medians[s.name][f] / medians[s.name][1.0]:.4f}"]
        if len(sides) > 1:
            cells.append(f"{medians['this'][f] / medians['before'][f]:.2f}")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        samples = {s.name: {str(f): v for f, v in s.seconds.items()} for s in sides}
        args.json.write_text(json.dumps({"tokens": args.tokens, "samples": samples}, indent=1) + "\n")


if __name__ == "__main__":
    main()
