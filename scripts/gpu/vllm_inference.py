"""The GPU check's vLLM driver: cold and warm vLLM engines through a real daemon, KV over CUDA IPC; prints RESULT lines.

Run by scripts/gpu/vllm.sh in the vLLM venv, with tests/vllm_real and tests/vllm_connector on PYTHONPATH (the
tiny models, the switchable-noise connector and the daemon starter the CPU tests use).
"""

from __future__ import annotations

import gc
import sys
import uuid
from pathlib import Path
from typing import Any

from models import LLAMA, prompts
from noisy_connector import NOISE_FLAG
from sidecar_daemon import Daemon

MAX_TOKENS = 16


def engine(model_dir: Path, socket: str, prefix: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="NoisyLoadsConnector",
            kv_connector_module_path="noisy_connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"socket": socket, "cache_prefix": prefix},
        ),
    )


def generate(llm: Any, batch: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main(work: Path) -> int:
    import os

    work.mkdir(parents=True, exist_ok=True)
    flag = work / "noise-on"
    flag.unlink(missing_ok=True)
    os.environ[NOISE_FLAG] = str(flag)
    model_dir = LLAMA.build(work / "models")
    batch = prompts(LLAMA)
    prefix = f"gpu{uuid.uuid4().hex[:8]}"
    (work / "daemon").mkdir(exist_ok=True)
    daemon = Daemon(work / "daemon").start()
    failures: list[str] = []
    try:
        cold_llm = engine(model_dir, daemon.target, prefix)
        cold = generate(cold_llm, batch)
        close(cold_llm)
        saved = daemon.counters()
        # A new engine process: its GPU memory never held these prompts, so a hit comes from the store.
        warm_llm = engine(model_dir, daemon.target, prefix)
        warm = generate(warm_llm, batch)
        after = daemon.counters()
        assert warm_llm.reset_prefix_cache()
        flag.touch()
        noisy = generate(warm_llm, batch)
        close(warm_llm)
        hit = after.get("kvsidecar_lookup_hit_tokens_total", 0) - saved.get("kvsidecar_lookup_hit_tokens_total", 0)
        loaded = after.get("kvsidecar_loaded_bytes_total", 0) - saved.get("kvsidecar_loaded_bytes_total", 0)
        print(
            f"RESULT saved_bytes={saved.get('kvsidecar_saved_bytes_total', 0):g} hit_tokens={hit:g} "
            f"loaded_bytes={loaded:g} prompts={len(batch)} prompt_tokens={sum(map(len, batch))}"
        )
        print(f"RESULT cold={cold}")
        print(f"RESULT warm_equals_cold={warm == cold}")
        changed = sum(a != b for a, b in zip(noisy, cold, strict=True))
        print(f"RESULT noisy_outputs_changed={changed}/{len(batch)}")
        if saved.get("kvsidecar_saved_bytes_total", 0) <= 0:
            failures.append("the cold engine saved nothing")
        if hit <= 0 or loaded <= 0:
            failures.append("the warm engine loaded nothing from the store")
        if warm != cold:
            failures.append(f"warm outputs differ from cold ones: {warm}")
        if changed != len(batch):
            failures.append(f"noise over the loaded blocks changed only {changed} outputs")
    finally:
        daemon.stop()
        print(daemon.log()[-2000:], file=sys.stderr)
    for failure in failures:
        print(f"FAIL: {failure}")
    if not failures:
        print("PASS: vLLM 0.33 on CUDA, KV over CUDA IPC: warm == cold, and noise over the loads is seen")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
