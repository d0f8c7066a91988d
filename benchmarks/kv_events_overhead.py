"""What KV events cost a save: DataPath saves without events, publishing to nobody, to a subscriber that reads, and to
one that never reads (stuck), side by side in one run, as ratios to the save without events.

    python benchmarks/kv_events_overhead.py [--repeat 41] [--blocks 128]

The store is datapath_overhead.py's stub (it answers at once and never holds anything, so every save writes, and
announces, every block): what is left is the daemon's own CPU per save. Rows run interleaved, round after round,
so machine noise falls on all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial

import zmq
from datapath_overhead import StubStore
from prometheus_client import CollectorRegistry

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.events.node import NodeEvents
from kvsidecar.memory.mappings import Opener
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.rpc import wire
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.values import Role, SaveArgs
from kvsidecar_bench.shapes import BLOCK_TOKENS, GQA, Request
from kvsidecar_client import shared_tensor
from kvsidecar_client.descriptions import describe_regions


class Reader:
    """A subscriber that reads everything, on its own thread."""

    def __init__(self, endpoint: str) -> None:
        self.count = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self._sock.recv_multipart()
                self.count += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=41)
    parser.add_argument("--blocks", type=int, default=128)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    n = args.blocks
    movers = Movers(StubStore(False))
    sessions = SessionRegistry(60, movers)
    # Named shared memory: this process maps it by name, as the daemon maps a trusted rank's (no side socket here).
    shape = (2 * n, BLOCK_TOKENS, *GQA.token_dims)
    tensors = [shared_tensor(shape, torch.bfloat16, named=True) for _ in range(GQA.regions)]
    session = sessions.open(Role.RANK, GQA.layout("bench/x"), 32, "x")
    regions = wire.regions(describe_regions([(t, (0,), None) for t in tensors]))
    session.memory = SessionMemory(regions, 1, Opener(shm_names=True))
    session.mover = movers.mover(session.memory)
    request = Request.of(GQA, "events", n, n)
    tokens = list(range(request.num_tokens))

    nodes = {
        name: NodeEvents("tcp://127.0.0.1:0", "", "bench", CollectorRegistry()) for name in ("none", "read", "stuck")
    }
    for node in nodes.values():
        node.start()
    reader = Reader(nodes["read"].publisher.address)
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt_string(zmq.SUBSCRIBE, "")
    stuck.connect(nodes["stuck"].publisher.address)
    time.sleep(0.5)  # subscriptions reach the publishers (a slow joiner only misses messages, it costs nothing)

    rows = {
        "no events": (DataPath(StubStore(False), Metrics()), ()),
        "events, no subscriber": (DataPath(StubStore(False), Metrics(), events=nodes["none"].feed), ()),
        "events, subscriber reading": (DataPath(StubStore(False), Metrics(), events=nodes["read"].feed), ()),
        "events, stuck subscriber": (DataPath(StubStore(False), Metrics(), events=nodes["stuck"].feed), ()),
        "events + token ids, stuck subscriber": (
            DataPath(StubStore(False), Metrics(), events=nodes["stuck"].feed),
            tokens,
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    ids = [request.save_ids]
    for _ in range(args.repeat):
        for name, (datapath, toks) in rows.items():
            save = partial(datapath.save, session, SaveArgs(request.hashes, ids, request.num_tokens, 0, toks, 0))
            start = time.perf_counter()
            save()
            times[name].append(time.perf_counter() - start)
    for node in nodes.values():
        node.publisher.flush(60)
    base = statistics.median(times["no events"])
    print(f"GQA save of {n} blocks, {args.repeat} rounds; DataPath over a stub store (the daemon's own CPU)")
    print("| save | ms (median) | x no events |")
    print("| --- | --- | --- |")
    for name, samples in times.items():
        ms = statistics.median(samples)
        print(f"| {name} | {1e3 * ms:.3f} | {ms / base:.2f} |")
    dropped = {name: node.publisher.dropped._value.get() for name, node in nodes.items()}
    print(f"publisher queue drops: {dropped}; messages the reading subscriber got: {reader.count}")
    reader.close()
    stuck.close(linger=0)
    ctx.term()
    for node in nodes.values():
        node.stop()


if __name__ == "__main__":
    main()
