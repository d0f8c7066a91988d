"""`kvsidecar bench`: start the processes, run the sections, stop everything by PID, write the report."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvsidecar_bench import lookup, scaling, step, throughput, volume
from kvsidecar_bench.device import check_device
from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.machine import describe_machine, load_average, process_stats, wait_rss_settled
from kvsidecar_bench.mooncake_direct import InProcessPath, RealClientPath
from kvsidecar_bench.paths import DaemonPath, DataPath, GatherDmaPath, MemcpyPath
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.render import render_markdown
from kvsidecar_bench.report import Results, to_json
from kvsidecar_bench.settings import Settings, command_line, from_args, out_dir
from kvsidecar_bench.shapes import SHAPES, EngineMemory, scale_rank_shape
from kvsidecar_testing.mooncake_env import MooncakeEnv
from kvsidecar_testing.processes import DaemonProcess, ProcessError, StorageNode

__all__ = ["main", "run"]


def _total_steps(settings: Settings) -> int:
    total = 1
    if "throughput" in settings.sections:
        total += throughput.steps(len(settings.shapes), settings.blocks, settings.rounds, settings.cold_rounds)
    if "step" in settings.sections:
        total += step.steps(len(_step_shapes(settings)), settings.step_rounds)
    if "lookup" in settings.sections:
        total += len(settings.lookup_tokens) + len(lookup.CASES) - 1
    if "scaling" in settings.sections:
        total += 1 + len(settings.ranks)
    if "volume" in settings.sections:
        total += len(volume.CASES)
    return total


def run(args: argparse.Namespace) -> int:
    """Run the bench as the flags say; 0 on success, 1 when a measurement failed, 2 for bad flags."""
    try:
        settings = from_args(args)
        _check_capacity(settings, [SHAPES[name] for name in settings.shapes])
        check_device(settings.device)  # before any process starts: a CPU-only setup fails here, at once
    except (ValueError, BenchError) as exc:
        print(f"kvsidecar bench: error: {exc}", file=sys.stderr)
        return 2
    _one_torch_thread()
    progress = Progress(_total_steps(settings), enabled=settings.progress)
    workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-bench-"))
    # Mooncake's environment, for the bench's own clients and every process it starts (they inherit it).
    mooncake = MooncakeEnv(workdir)
    saved_env = dict(os.environ)
    os.environ.update(mooncake.variables())
    try:
        results = measure(settings, progress, workdir, mooncake)
    except (BenchError, ProcessError, TimeoutError) as exc:
        progress.close()
        print(f"kvsidecar bench: error: {exc}\n(logs in {workdir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.close()
        shutil.rmtree(workdir, ignore_errors=True)
        print(
            f"kvsidecar bench: interrupted; every process it started was stopped and its temporary folder {workdir} "
            "removed",
            file=sys.stderr,
        )
        return 130
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        mooncake.close()
    progress.close()
    shutil.rmtree(workdir, ignore_errors=True)
    report(results)
    return 0


def _step_shapes(settings: Settings) -> list[str]:
    # The goal names MLA and GQA; a TP-8 rank's step is the same calls with smaller values.
    return [name for name in settings.shapes if name in ("mla", "gqa")] or list(settings.shapes[:1])


def _check_capacity(settings: Settings, shapes: list[Any]) -> None:
    # Values stay in the segment until a phase clears them: past Mooncake's eviction watermark puts would fail.
    room = 0.8 * settings.segment_size
    if throughput.cold_bytes(shapes, settings.cold_blocks, settings.cold_rounds) > room:
        raise BenchError("the cold phase would fill more than 80% of --segment-size: lower --cold-blocks/--cold-rounds")
    one_step = max(step.step_bytes(SHAPES[name], settings.step_requests) for name in _step_shapes(settings))
    if "step" in settings.sections and one_step > room:
        raise BenchError("a step would fill more than 80% of --segment-size: lower --step-requests")
    one_rank = settings.scale_rounds * settings.scale_blocks * scale_rank_shape(0).value_bytes
    if "scaling" in settings.sections and max(settings.ranks) * one_rank > room:
        raise BenchError("a scaling phase would fill more than 80% of --segment-size: lower --scale-rounds/-blocks")


def _one_torch_thread() -> None:
    # A parallel torch copy on a shared 2-core machine collapses whenever the other core is busy (its threads wait
    # for each other), and torch's idle OpenMP threads spin after each parallel region, stealing the core the daemon
    # or Mooncake's copy thread needs. One thread: memcpy is one core's copy, like one Mooncake transfer.
    import torch

    torch.set_num_threads(1)


def measure(settings: Settings, progress: Progress, workdir: Path, mooncake: MooncakeEnv) -> Results:
    """Every selected section, with the processes they need, all stopped before returning."""
    from kvsidecar.daemon.master import EmbeddedMaster

    machine = describe_machine(settings.device)
    started = time.monotonic()
    nonce = secrets.token_hex(4)
    sections = settings.sections
    shapes = [SHAPES[name] for name in settings.shapes]
    want_throughput = "throughput" in sections
    want_in_process = want_throughput or "volume" in sections
    results = Results(
        settings=settings,
        command=command_line(settings),
        machine=machine,
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        paths=[],
    )
    logs = workdir / "mooncake.log"
    with contextlib.ExitStack() as stack:
        progress.section("starting masters, the daemon and Mooncake clients")
        master = stack.enter_context(EmbeddedMaster(log_path=workdir / "master-daemon.log"))
        daemon = DaemonProcess(
            workdir, master=master.address, session_ttl=None, segment_size=str(settings.segment_size),
            local_buffer_size=None, log_level="warning", mooncake=mooncake,
        )  # fmt: skip
        results.daemon_command = ["python", *daemon.command()[1:]]
        stack.callback(daemon.stop)
        daemon.start()
        rss = wait_rss_settled(daemon.pid, settings.segment_size)
        results.daemon_idle = {"rss_mib": round(rss / 2**20, 1), "cpu_s": round(process_stats(daemon.pid).cpu_s, 2)}
        in_process = None
        master_b = None
        if want_in_process:
            master_b = stack.enter_context(EmbeddedMaster(log_path=workdir / "master-in-process.log"))
            in_process = InProcessPath(logs, master_b.address, settings.segment_size)
            stack.callback(in_process.close)
        paths: list[DataPath] = [DaemonPath(daemon)]
        if want_throughput:
            assert in_process is not None
            top = max([*settings.blocks, settings.cold_blocks])
            most = top * max(s.value_bytes for s in shapes)
            if settings.device == "cuda":
                # On a GPU the crossing is the same as on a CPU; what is new is the copy, judged by the GPU's limit.
                paths += [in_process, GatherDmaPath(most)]
                _wait_page_locked(daemon, progress)
            else:
                paths += [DaemonPath(daemon, data_socket=False), in_process]
            real = _real_client_path(settings, shapes, stack, workdir, logs, results, progress, mooncake)
            if real is not None:
                paths.append(real)
            paths.append(MemcpyPath(most, settings.device))
        results.paths = [p.name for p in paths]
        _device_notes(settings, results)
        progress.step("ready")

        if want_throughput:
            progress.section("1/4 throughput")
            results.throughput = throughput.measure(
                shapes,
                paths,
                settings.blocks,
                settings.rounds,
                settings.cold_blocks,
                settings.cold_rounds,
                progress,
                nonce,
                settings.device,
            )
        if "step" in sections:
            progress.section("one engine step: batched against separate calls")
            results.step = step.measure_step(
                daemon,
                [SHAPES[name] for name in _step_shapes(settings)],
                settings.step_requests,
                settings.step_rounds,
                progress,
                nonce,
            )
        if "lookup" in sections:
            progress.section("2/4 lookup latency")
            results.lookup = lookup.measure_lookups(
                daemon, master.address, settings.lookup_tokens, settings.lookup_reps, progress, nonce, logs
            )
        if "scaling" in sections:
            progress.section("3/4 scaling")
            results.scaling = scaling.measure_scaling(
                daemon, settings.ranks, settings.scale_blocks, settings.scale_rounds, progress, nonce, workdir
            )
        if "volume" in sections:
            progress.section("4/4 write volume")
            assert in_process is not None and master_b is not None
            master_b_url = master_b.metrics_url
            results.volume = volume.measure_volume(
                daemon,
                lambda: volume.master_allocated_bytes(master.metrics_url),
                in_process.client,
                lambda: volume.master_allocated_bytes(master_b_url),
                settings.volume_blocks,
                progress,
                nonce,
            )
    results.duration_s = time.monotonic() - started
    results.load_average_at_end = load_average()
    return results


def _real_client_path(
    settings: Settings,
    shapes: list[Any],
    stack: contextlib.ExitStack,
    workdir: Path,
    logs: Path,
    results: Results,
    progress: Progress,
    mooncake: MooncakeEnv,
) -> RealClientPath | None:
    from kvsidecar.daemon.master import EmbeddedMaster

    if not settings.real_client:
        results.notes.append("The real-client path was skipped (--no-real-client).")
        return None
    if settings.device == "cuda":
        results.notes.append(
            "The real-client path was skipped (--device cuda): a dummy client hands mooncake_client only buffers of "
            "its shared-memory pool in host memory, so it cannot move the same GPU buffers."
        )
        progress.note("real-client path skipped: it cannot read GPU memory")
        return None
    if StorageNode.binary() is None:
        results.notes.append("The real-client path was skipped: this Mooncake wheel ships no mooncake_client.")
        progress.note("real-client path skipped: no mooncake_client in this wheel")
        return None
    master = stack.enter_context(EmbeddedMaster(log_path=workdir / "master-real-client.log"))
    real = StorageNode(
        master.address, workdir, segment=f"{settings.segment_size // (1 << 20)}MB", local_buffer=None, mooncake=mooncake
    )
    stack.callback(real.stop)
    real.start()
    top = max([*settings.blocks, settings.cold_blocks])
    pool = max(EngineMemory.bytes_needed(shape, 2 * top) for shape in shapes)
    try:
        path = RealClientPath(logs, real, pool)
    except BenchError as exc:
        results.notes.append(f"The real-client path was skipped: {exc}.")
        progress.note(f"real-client path skipped: {exc}")
        return None
    stack.callback(path.close)
    return path


def _wait_page_locked(daemon: DaemonProcess, progress: Progress, timeout: float = 120.0) -> None:
    """Until the daemon has page-locked its segment (in the background, seconds per 10 GiB): the GPU path's speed."""
    progress.note("waiting for the daemon to page-lock its segment")
    deadline = time.monotonic() + timeout
    while not daemon.metric_samples("kvsidecar_gpu_pinned_segment_bytes").get("", 0.0):
        if time.monotonic() > deadline:
            raise BenchError(f"the daemon did not page-lock its segment within {timeout:.0f} s (see its log)")
        time.sleep(0.2)


def _device_notes(settings: Settings, results: Results) -> None:
    if settings.device != "cuda":
        return
    gpu = results.machine.get("gpu", {})
    name = gpu.get("name", "cuda:0") if isinstance(gpu, dict) else "cuda:0"
    if "throughput" in settings.sections:
        results.notes.append(
            f"--device cuda: the data-path section's KV cache is on cuda:0 ({name}), laid out as vLLM 0.33 allocates "
            "it (one buffer, every layer a view of it); the daemon maps it over CUDA IPC and moves it with its GPU "
            "path (gather/scatter kernels, one DMA per value or run of values, segment page-locked); gather+dma is "
            "the limit (one gather kernel and one DMA to pinned memory, in this process); in-process Mooncake "
            "registers the same device buffers; memcpy is a synchronized copy per tensor; loaded bytes are compared "
            "on the GPU."
        )
    cpu_only = [s for s in ("step", "scaling", "volume") if s in settings.sections]
    if cpu_only:
        results.notes.append(
            f"--device cuda: {', '.join(cpu_only)} ran on CPU shared memory as without it (they measure the RPC "
            "count, rank concurrency and write volume, not the copy); lookup moves no KV-cache bytes."
        )


def report(results: Results) -> None:
    """Write results.md, results.json and throughput.png under --out, or print the tables (--quick)."""
    from kvsidecar_bench.render import plot_throughput

    doc = to_json(results)
    folder = out_dir(results.settings)
    if folder is None:
        print(render_markdown(doc))
        return
    folder.mkdir(parents=True, exist_ok=True)
    plot_name = "throughput.png"
    why_not = plot_throughput(doc, folder / plot_name)
    if why_not is not None:
        doc["notes"].append(why_not)
    (folder / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    markdown = render_markdown(doc, plot=None if why_not else plot_name)
    (folder / "results.md").write_text(markdown + "\n")
    headline = markdown.split("## Headline", 1)[1].split("\n## ", 1)[0]
    print("## Headline" + headline.rstrip())
    print(
        f"\nwrote {folder / 'results.md'}, {folder / 'results.json'}" + ("" if why_not else f", {folder / plot_name}")
    )


def main(argv: list[str] | None = None) -> int:
    """`kvsidecar bench`, `kvsidecar-bench` and `python -m kvsidecar_bench`."""
    from kvsidecar_bench.settings import add_arguments

    parser = argparse.ArgumentParser(prog="kvsidecar bench", description=__doc__, allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args(argv))
