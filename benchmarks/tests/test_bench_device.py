"""`--device`: cpu stays the default with the same settings; cuda fails at once, precisely, where it cannot run."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar_bench.device import check_device, cuda_problems, mooncake_builds
from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.render import render_markdown
from kvsidecar_bench.report import headline
from kvsidecar_bench.settings import CUDA_DEFAULTS, QUICK, Settings, add_arguments, command_line, from_args


def parse(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def cuda_usable() -> bool:
    try:
        check_device("cuda")
    except BenchError:
        return False
    return True


def test_cpu_is_the_default_and_the_settings_are_unchanged():
    assert Settings().device == "cpu" and QUICK.device == "cpu"
    assert parse() == Settings() and parse("--quick") == QUICK
    assert parse("--device", "cpu") == Settings()
    assert command_line(parse()) == "kvsidecar bench"
    assert command_line(parse("--quick", "--device", "cpu")) == "kvsidecar bench --quick"
    check_device("cpu")  # never refused, whatever is installed


def test_cuda_is_recorded_in_the_command_line():
    s = parse("--quick", "--device", "cuda")
    # The GPU targets' sizes and shapes (issue 33), and a segment that holds the largest request being loaded back.
    assert s.device == "cuda" and (s.blocks, s.shapes) == (CUDA_DEFAULTS["blocks"], CUDA_DEFAULTS["shapes"])
    assert s.rounds == QUICK.rounds
    line = command_line(s)
    assert line == "kvsidecar bench --quick --device cuda"
    assert parse(*line.split()[2:]) == s
    with pytest.raises(SystemExit):
        parse("--device", "rocm")


def test_cuda_problems_name_each_missing_piece():
    cpu_mooncake = {"mooncake-transfer-engine-non-cuda": "0.3.13.post1"}
    cuda_mooncake = {"mooncake-transfer-engine": "0.3.13"}
    problems = cuda_problems("2.13.0+cpu", None, 0, cpu_mooncake)
    assert len(problems) == 2
    assert "torch 2.13.0+cpu is a CPU-only build (torch.version.cuda is None)" in problems[0]
    assert "mooncake-transfer-engine-non-cuda 0.3.13.post1 is installed" in problems[1]
    assert "FLAVOUR=cuda" in problems[1]
    assert cuda_problems("2.13.0", "12.8", 1, cuda_mooncake) == []
    (no_gpu,) = cuda_problems("2.13.0", "12.8", 0, cuda_mooncake)
    assert "sees no CUDA device" in no_gpu
    (no_mooncake,) = cuda_problems("2.13.0", "12.8", 1, {})
    assert "none is" in no_mooncake
    (both,) = cuda_problems("2.13.0", "12.8", 1, {**cpu_mooncake, **cuda_mooncake})
    assert "keep one" in both


@pytest.mark.skipif(cuda_usable(), reason="this machine can run --device cuda")
def test_device_cuda_fails_at_once_before_any_process_starts(tmp_path: Path):
    import torch

    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the bench's workdir (logs, sockets) would be made here
    run = subprocess.run(
        [sys.executable, "-m", "kvsidecar_bench", "--quick", "--device", "cuda", "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    assert run.stderr.startswith("kvsidecar bench: error: --device cuda cannot run here: "), run.stderr
    devices = torch.cuda.device_count() if torch.version.cuda is not None else 0
    for problem in cuda_problems(torch.__version__, torch.version.cuda, devices, mooncake_builds()):
        assert problem in run.stderr
    assert not list(tmp_path.glob("kvsidecar-bench-*")), "a workdir was made: processes were about to start"


def test_a_cuda_report_names_the_gpu_and_what_memcpy_is():
    doc = {
        "command": "kvsidecar bench --quick --device cuda",
        "started": "2026-12-01T14:00:00+00:00",
        "duration_s": 40.0,
        "machine": {
            "cpu": "x",
            "cores": 16,
            "usable_cores": 16,
            "memory_gib": 128.0,
            "kernel": "6",
            "python": "3.12",
            "torch_threads": 1,
            "transparent_hugepages": "never",
            "versions": {},
            "load_average_at_start": [],
            "gpu": {
                "name": "NVIDIA H200",
                "memory_gib": 139.8,
                "capability": "9.0",
                "cuda": "12.8",
                "driver": "570.1",
                "count": 1,
            },
        },
        "settings": {"device": "cuda"},
        "paths": ["daemon", "in-process", "memcpy"],
        "notes": [],
        "throughput": [],
        "step": [],
        "lookup": [],
        "scaling": [],
        "volume": [],
    }
    doc["headline"] = headline(doc)
    text = render_markdown(doc)
    assert "GPU (cuda:0 of 1): NVIDIA H200, 139.8 GiB, compute capability 9.0, driver 570.1, CUDA 12.8" in text
