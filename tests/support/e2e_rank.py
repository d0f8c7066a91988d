"""The commands one end-to-end engine rank serves in its own process (driven by `kvsidecar_testing.ranks`).

The rank is deliberately dumb: it owns shared-memory KV-cache tensors and real `SidecarClient`s, writes the
patterns it is told to, saves, looks up and loads what it is told to, and reports block fingerprints. Deciding
what the bytes should be is the test's job (`kvsidecar_testing.oracle`).

`start(workdir, name)` spawns one; `each(procs, op, args)` sends a command to several ranks at once and collects
their answers, so their saves and loads reach the daemon concurrently, as an engine's ranks do.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvsidecar_testing.oracle import POISON, digest, pattern
from kvsidecar_testing.ranks import RankError, RankProcess, each

__all__ = ["RankError", "RankProcess", "each", "start", "started"]


def start(workdir: Path, name: str) -> RankProcess:
    """Spawn a rank process (it imports torch and the client first); `wait_ready` before the first command."""
    return RankProcess(E2ERank, name=name, log_path=workdir / f"{name}.log").spawn()


@contextlib.contextmanager
def started(workdir: Path, count: int, meanwhile: Callable[[], object] = lambda: None) -> Iterator[list[RankProcess]]:
    """count rank processes rank0.., ready (`meanwhile` runs while they import torch), stopped at the end."""
    procs = [start(workdir, f"rank{i}") for i in range(count)]
    try:
        meanwhile()
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


class _Engine:
    """One client with its tensors, as one engine rank holds them."""

    def __init__(self, client: Any, tensors: list[Any]) -> None:
        self.client = client
        self.tensors = tensors

    def block(self, tensor: int, block: int) -> tuple[int, int]:
        """Address and size of one block (the tensors are contiguous, dim 0 = blocks)."""
        view = self.tensors[tensor][block]
        return view.data_ptr(), view.numel() * view.element_size()


class E2ERank:
    """The commands a rank process serves: one method per op, arguments by name."""

    def __init__(self) -> None:
        import torch  # noqa: F401  # pay the imports before saying ready

        import kvsidecar_client  # noqa: F401

        self.engines: dict[str, _Engine] = {}

    def open(self, name: str, address: str, spec: dict[str, Any], tensors: list[dict[str, Any]]) -> Any:
        import torch

        from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor

        groups = [
            GroupSpec(g["kind"], g["block_size"], g.get("window", 0), tuple(g.get("inner", ()))) for g in spec["groups"]
        ]
        client = SidecarClient.connect(
            address,
            model=spec["model"],
            layout=EngineLayout(**spec["layout"]),
            num_kv_heads=spec["num_kv_heads"],
            hash_block_size=spec["hash_block_size"],
            groups=groups,
            cache_prefix=spec.get("cache_prefix", ""),
            client_name=f"e2e {name} pid={os.getpid()}",
        )
        try:
            made = [shared_tensor(t["shape"], getattr(torch, t["dtype"])) for t in tensors]
            registration = client.register(made, [t["groups"] for t in tensors])
        except BaseException:
            client.close()
            raise
        self.engines[name] = _Engine(client, made)
        info = client.session_info
        return {
            "groups": [list(g) for g in info.groups] if info else [],
            "value_bytes": list(registration.value_bytes),
        }

    def fill(self, name: str, blocks: list[list[Any]]) -> None:
        engine = self.engines[name]
        for tensor, block, tag in blocks:
            address, size = engine.block(tensor, block)
            ctypes.memmove(address, pattern(tag, size), size)

    def poison(self, name: str) -> None:
        for tensor in self.engines[name].tensors:
            ctypes.memset(tensor.data_ptr(), POISON, tensor.numel() * tensor.element_size())

    def save(self, name: str, hashes: list[str], ids: list[list[int]], num_tokens: int, saved_tokens: int = 0) -> Any:
        job = self.engines[name].client.save(
            [bytes.fromhex(h) for h in hashes], ids, num_tokens, saved_tokens=saved_tokens
        )
        return _plain(job.result(timeout=60))

    def lookup(self, name: str, hashes: list[str], num_tokens: int, eagle: bool = False) -> Any:
        hit = self.engines[name].client.lookup([bytes.fromhex(h) for h in hashes], num_tokens, eagle=eagle)
        return _plain(hit)

    def load(
        self, name: str, hashes: list[str], ids: list[list[int]], hit: dict[str, Any], start_tokens: int = 0
    ) -> Any:
        from kvsidecar_client import Hit

        answer = Hit(hit["hit_tokens"], tuple(hit["tail_boundaries"]), hit["degraded"], hit["detail"])
        result = self.engines[name].client.load_detailed(
            [bytes.fromhex(h) for h in hashes], ids, answer, start_tokens=start_tokens
        )
        return _plain(result)

    def digests(self, name: str) -> list[list[str]]:
        engine = self.engines[name]
        return [
            [digest(ctypes.string_at(*engine.block(t, b))) for b in range(len(tensor))]
            for t, tensor in enumerate(engine.tensors)
        ]

    def close(self, name: str) -> None:
        engine = self.engines.pop(name)
        engine.client.close()

    def exit(self) -> None:
        for name in list(self.engines):
            self.close(name)


def _plain(value: Any) -> Any:
    """NamedTuples (and their nested tuples) as JSON-ready dicts and lists."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
