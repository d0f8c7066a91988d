"""One engine rank for the scaling section, in its own process: `python -m kvsidecar.bench.worker CONFIG_JSON`.

It opens a session, registers its KV cache and says {"ready": pid}; then each line on stdin is a command:
{"op": "run", "phase": str, "rounds": n} saves and loads `rounds` requests and answers with its timings;
{"op": "reset"} removes every block of the model; {"op": "quit"} (or end of input) closes the session and exits.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from kvsidecar.bench.shapes import BLOCK_TOKENS, EngineMemory, Request, scale_rank_shape

__all__ = ["MODEL", "main"]

MODEL = "bench/scale"


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """Serve commands until told to quit."""
    import torch

    from kvsidecar_client import EngineLayout, GroupSpec, Hit, SidecarClient

    torch.set_num_threads(1)  # see runner._one_torch_thread

    config = json.loads(argv[0])
    rank, blocks, nonce = int(config["rank"]), int(config["blocks"]), str(config["nonce"])
    shape = scale_rank_shape(rank)
    memory = EngineMemory.shared(shape, 2 * blocks, seed=rank + 1)
    client = SidecarClient.connect(
        config["target"],
        model=MODEL,
        layout=EngineLayout(tp_size=shape.tp_size, tp_rank=rank),
        num_kv_heads=shape.kv_heads,
        hash_block_size=BLOCK_TOKENS,
        groups=[GroupSpec(shape.group, BLOCK_TOKENS)],
        client_name=f"kvsidecar-bench rank {rank}",
    )
    try:
        client.register(memory.tensors, [(0,)] * len(memory.tensors))
        _say({"ready": True})
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "quit":
                break
            if command["op"] == "reset":
                _say({"removed": client.reset()})
                continue
            saves: list[float] = []
            loads: list[float] = []
            start = time.time()
            nbytes = 0
            for r in range(int(command["rounds"])):
                request = Request.of(shape, f"{nonce}/{command['phase']}/{r}", blocks, blocks)
                nbytes = request.nbytes
                t0 = time.perf_counter()
                saved = client.save(request.hashes, [request.save_ids], request.num_tokens).result()
                saves.append(time.perf_counter() - t0)
                # The scheduler's lookup needs every TP rank's shard; with fewer ranks running, the hit it would
                # report for this rank's own blocks is built here.
                tokens = blocks * BLOCK_TOKENS
                hit = Hit(tokens, (tokens,))
                t0 = time.perf_counter()
                loaded = client.load_detailed(request.hashes, [request.load_ids], hit)
                loads.append(time.perf_counter() - t0)
                if saved.written != blocks or loaded.loaded != blocks:
                    _say({"error": f"rank {rank}: wrote {saved.written}, loaded {loaded.loaded} of {blocks} blocks"})
                    return 1
            _say({"save_s": saves, "load_s": loads, "bytes": nbytes, "start": start, "end": time.time()})
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
