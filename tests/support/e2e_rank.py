"""One engine rank in its own OS process, driven by the test over a pipe with one JSON line per command.

The rank is deliberately dumb: it owns shared-memory KV-cache tensors and real `SidecarClient`s, writes the
patterns it is told to, saves, looks up and loads what it is told to, and reports block fingerprints. Deciding
what the bytes should be is the test's job (`support.e2e_bytes`).

Test side: `RankProcess.start(workdir)` spawns `python -m support.e2e_rank`; `call(op, **args)` runs one
command; `each(procs, op, args)` sends a command to several ranks at once and collects their answers, so their
saves and loads reach the daemon concurrently, as an engine's ranks do.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from support.e2e_bytes import POISON, digest, pattern
from support.processes import stop_pid

_TESTS_DIR = str(Path(__file__).resolve().parent.parent)
DEFAULT_TIMEOUT = 60.0


class RankError(RuntimeError):
    """A command failed inside a rank process; carries the rank's traceback."""


class RankProcess:
    """The test's handle on one rank process."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self._buffer = b""

    @classmethod
    def start(cls, workdir: Path, name: str) -> RankProcess:
        """Spawn a rank process; call `wait_ready` before the first command."""
        log_path = workdir / f"{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS_DIR, env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")  # the machine is shared; tensors here are tiny
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "support.e2e_rank"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        return cls(proc, log_path)

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Wait for the process to have imported torch and the client."""
        self.receive(timeout)

    def send(self, op: str, **args: Any) -> None:
        """Send one command without waiting for its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """The answer to the oldest command sent; RankError if it failed there."""
        line = self._readline(timeout)
        reply = json.loads(line)
        if "error" in reply:
            raise RankError(f"rank process {self.proc.pid}: {reply['error']}")
        return reply["ok"]

    def call(self, op: str, timeout: float = DEFAULT_TIMEOUT, **args: Any) -> Any:
        """Run one command and return its answer."""
        self.send(op, **args)
        return self.receive(timeout)

    def stop(self) -> None:
        """Ask the process to exit (it closes its clients), then make sure it is gone."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        stop_pid(self.proc, timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def log(self) -> str:
        """What the process wrote to stderr."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _readline(self, timeout: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankError(f"rank process {self.proc.pid}: no answer in {timeout} s\n{self.log()}")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RankError(f"rank process {self.proc.pid} exited ({self.proc.poll()}):\n{self.log()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


def each(procs: Sequence[RankProcess], op: str, args: Sequence[dict[str, Any]]) -> list[Any]:
    """Send op to every process at once (args[i] to procs[i]), then collect every answer in order."""
    for proc, kw in zip(procs, args, strict=True):
        proc.send(op, **kw)
    answers, first_error = [], None
    for proc in procs:
        try:
            answers.append(proc.receive())
        except RankError as exc:  # collect the others' answers first, so the pipes stay in step
            answers.append(None)
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return answers


# --- the rank process ---------------------------------------------------------------------------------------------


class _Engine:
    """One client with its tensors, as one engine rank holds them."""

    def __init__(self, client: Any, tensors: list[Any]) -> None:
        self.client = client
        self.tensors = tensors

    def block(self, tensor: int, block: int) -> tuple[int, int]:
        """Address and size of one block (the tensors are contiguous, dim 0 = blocks)."""
        view = self.tensors[tensor][block]
        return view.data_ptr(), view.numel() * view.element_size()


class _Rank:
    """The commands a rank process serves: one method per op, arguments by name."""

    def __init__(self) -> None:
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


def main() -> int:
    """Serve commands from stdin until `exit` or end of input; answers go to the original stdout only."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (by C code too) goes to the log, never into the protocol
    sys.stdout = sys.stderr
    import torch  # noqa: F401  # pay the import before saying ready

    import kvsidecar_client  # noqa: F401

    rank = _Rank()
    out.write(json.dumps({"ok": "ready"}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            answer = getattr(rank, op)(**request)
        except Exception:
            out.write(json.dumps({"error": f"{op}: {traceback.format_exc()}"}) + "\n")
            continue
        out.write(json.dumps({"ok": answer}) + "\n")
        if op == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
