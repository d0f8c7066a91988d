"""One vLLM CPU engine (`vllm.LLM`) with the kvsidecar connector, and the passes the tests compare."""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from models import TinyModel
from noisy_connector import NOISE_FLAG

from kvsidecar_client.memory import SHM_DIR

MAX_TOKENS = 16


def kv_transfer_config(
    socket: str,
    prefix: str,
    *,
    connector: str = "NoisyLoadsConnector",
    role: str = "kv_both",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The --kv-transfer-config of the README, with the test's switchable-noise connector by default."""
    module = "noisy_connector" if connector == "NoisyLoadsConnector" else "kvsidecar_client.vllm"
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": socket, "cache_prefix": prefix, **(extra or {})},
    }


class Segments:
    """The KV caches of this process's vLLM engine processes, held open from the moment they were found.

    A path under /proc/<pid>/fd names a descriptor number, not a file: the engine may close it and reuse the number
    for a socket before the test writes (seen at TP=2: ENXIO). An open descriptor of our own keeps naming the cache.
    """

    def __init__(self) -> None:
        self.fds: list[int] = []
        seen: set[tuple[int, int]] = set()
        for path in _candidates():
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:  # closed meanwhile, or its number now names a socket
                continue
            try:
                # What the descriptor we hold is, checked on ours (the engine's may have changed since listing).
                ok = os.readlink(f"/proc/self/fd/{fd}").startswith(("/memfd:kvsidecar-", f"{SHM_DIR}/kvsidecar-"))
                st = os.fstat(fd)
            except OSError:
                ok = False
            if not ok or (st.st_dev, st.st_ino) in seen:
                os.close(fd)
                continue
            seen.add((st.st_dev, st.st_ino))
            self.fds.append(fd)

    def __len__(self) -> int:
        return len(self.fds)

    def close(self) -> None:
        """Close the descriptors (the caches stay the engine's)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _candidates() -> list[str]:
    """Named segments and memfd descriptors of this process's children that look like kvsidecar KV caches."""
    pids = {str(p.pid) for p in psutil.Process().children(recursive=True)}
    # shared_tensor names segments kvsidecar-<pid>-<n>-<random>.
    found = [f"{SHM_DIR}/{n}" for n in os.listdir(SHM_DIR) if n.startswith("kvsidecar-") and n.split("-")[1] in pids]
    # Its sealed memfds (the default) have no name: they are reached through the engine process's descriptors,
    # /proc/<pid>/fd/<n> -> "/memfd:kvsidecar-<pid> (deleted)", one per cache however many fds point at it.
    for pid in sorted(pids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(path).startswith("/memfd:kvsidecar-"):
                    found.append(path)
            except OSError:
                continue
    return found


def scribble(segments: Segments) -> int:
    """Fill whole KV caches with a finite garbage pattern: what a load does not write stays wrong (bytes filled)."""
    filled = 0
    for fd in segments.fds:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size) as view:
            view[:] = b"\x5a" * size  # 0x5a5a...: about 1.5e16 in fp32 and bf16, never NaN
        filled += size
    return filled


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _shm_in_use(pids: set[int]) -> set[str]:
    """Names of /dev/shm files the processes map or hold open (vLLM's queues, semaphores, CPU communicators)."""
    names: set[str] = set()
    prefix = f"{SHM_DIR}/"
    for pid in pids:
        paths: list[str] = []
        try:
            with open(f"/proc/{pid}/maps") as maps:
                paths += [line.split(maxsplit=5)[5].strip() for line in maps if len(line.split(maxsplit=5)) == 6]
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # exited meanwhile
            continue
        names.update(p[len(prefix) :] for p in paths if p.startswith(prefix) and not p.endswith(" (deleted)"))
    return names


@dataclass
class Engine:
    """An LLM over one tiny model, one daemon and a cache_prefix of its own."""

    llm: Any
    model: TinyModel
    noise_flag: Path
    shm_before: set[str] = field(default_factory=set)  # /dev/shm's names when the engine started
    pids_before: set[int] = field(default_factory=set)  # this process's children then (the daemon, its master)

    @classmethod
    def start(
        cls,
        model: TinyModel,
        path: Path,
        socket: str,
        workdir: Path,
        *,
        prefix: str | None = None,
        role: str = "kv_both",
        extra: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> Engine:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        flag = workdir / "noise-on"
        os.environ[NOISE_FLAG] = str(flag)  # inherited by the engine process started below
        settings: dict[str, Any] = {
            "model": str(path),
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": model.dtype,
            "max_model_len": 1024,
            "enable_prefix_caching": True,
            "seed": 0,
            "kv_transfer_config": KVTransferConfig(
                **kv_transfer_config(socket, prefix or f"t{uuid.uuid4().hex[:12]}", role=role, extra=extra)
            ),
        }
        settings.update(model.llm)
        settings.update(overrides)
        shm, pids = _shm_names(), _children()
        return cls(LLM(**settings), model, flag, shm, pids)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Greedy token ids of every prompt, in order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def reset_prefix_cache(self) -> None:
        assert self.llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"

    def noise(self, on: bool, *, only_recurrent: bool = False) -> None:
        """Noise over every loaded block (or only recurrent groups' blocks) from the next load on, or none."""
        if on:
            self.noise_flag.write_text("recurrent" if only_recurrent else "all")
        else:
            self.noise_flag.unlink(missing_ok=True)

    def close(self) -> None:
        """Shut the engine down and remove the /dev/shm files it made and left behind (vLLM CPU leaves its queues,
        semaphores and TP communicators there), so the next suite starts with nothing of this one's."""
        # Not multiprocessing's resource tracker, which the first engine starts: it lives as long as this process,
        # and waiting for it cost every run 60 s.
        engine = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.pids_before | _trackers()]
        mine = _shm_in_use({os.getpid(), *(p.pid for p in engine)}) - self.shm_before
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            psutil.wait_procs(engine, timeout=60)
            for name in mine:  # created while this engine ran, by it: another suite's files are never touched
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{SHM_DIR}/{name}")


def _trackers() -> set[int]:
    """This process's multiprocessing resource tracker, if it runs (its command line says what it is)."""
    found = set()
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any("multiprocessing.resource_tracker" in arg for arg in p.cmdline()):
                found.add(p.pid)
    return found


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}
