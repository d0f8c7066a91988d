"""benchmarks/serving.py's report (serving_report.py), from a result like one its run writes (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SERVING = Path(__file__).resolve().parents[1] / "serving.py"


def load_serving():
    """The report's module, as serving.py imports it (from beside it)."""
    spec = importlib.util.spec_from_file_location("serving_report", SERVING.with_name("serving_report.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESULT = {
    "preset": "cpu",
    "device": "cpu",
    "vllm": "0.32.0",
    "model": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "dtype": "float32",
    },
    "max_tokens": 16,
    "miss": {"connector": [99.0, 100.0, 101.0], "plain": [100.0, 102.0, 98.0]},
    "ttft": {
        "1000": {
            "cold": [1.0, 3.0],
            "plain_cold": [1.0, 1.2],
            "prefix_cache": [0.1, 0.1],
            "warm": [0.2, 0.2],
            "warm_prefix_cache": [0.1, 0.12],
        }
    },
    "greedy_equal": {"equal": 2, "of": 2},
    "daemon": {"kvsidecar_saved_bytes_total": 2**20, "kvsidecar_loaded_bytes_total": 2**20, "warm_hit_tokens": 1984},
    "machine_before": {"cpu": "x", "cores": 2, "load_average": [1.0, 1.0, 1.0]},
    "machine_after": {"cpu": "x", "cores": 2, "load_average": [2.0, 1.0, 1.0]},
    "seconds": 12.0,
}


def test_the_report_leads_with_ratios_of_medians():
    serving = load_serving()
    text = serving.render(RESULT)
    # medians: cold 2.0, vLLM alone cold 1.1, warm 0.2, vLLM's prefix cache 0.1, B's own prefix cache 0.11
    assert "| 1000 | 0.100x | 2.00x | 1.82x | 2.000 | 1.100 | 0.200 | 0.100 | 0.110 |" in text
    assert "**1.000x**" in text  # miss overhead: median 100 against 100
    assert "2 of 2 prompts" in text
    lines = serving.result_lines(RESULT)
    assert lines[0].startswith("RESULT serving 1000 tokens: TTFT warm/cold 0.100x, warm/prefix-cache 2.00x")
    assert lines[-1] == "RESULT serving greedy warm == cold: 2/2"


def test_render_rewrites_the_report_from_its_json(tmp_path):
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(RESULT))
    out = subprocess.run([sys.executable, str(SERVING), "--render", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "serving.md").read_text() == load_serving().render(RESULT)
