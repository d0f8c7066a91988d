"""The disk tier (--ssd-dir) through a real daemon: save rate into a full DRAM tier, load throughput from disk against a
plain sequential read of the same bytes on the same disk, and the hit rate across a restart.

    .venv/bin/python benchmarks/ssd_tier.py [--segment 256MiB] [--times 4] [--dir /path/on/the/disk] [--out FILE.md]

One rank (the public client, one MLA-like group of 1 MiB blocks) saves prompts of 16 blocks until it has stored
`--times` x the DRAM segment, retrying the prompts that meet a full segment (no_space) the way an engine's next save
would. It then loads the earliest prompts (evicted, so on disk) and reads the disk tier's bucket files with plain
sequential reads (buffered, and O_DIRECT where the filesystem allows it). Finally the daemon is stopped (SIGTERM) and
started again, and every prompt is looked up. Everything runs in a temporary directory under --dir, removed after.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.config import parse_size
from kvsidecar.tiers.directory import inventory
from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor

MiB = 1 << 20
BLOCK_TOKENS = 16
BLOCK_ELEMS = MiB // 2  # bf16: 1 MiB per block
BLOCKS_PER_PROMPT = 16
SLOTS = 2 * BLOCKS_PER_PROMPT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, work: Path, segment: int, ssd_size: int, buffer: int) -> None:
        self.work, self.segment, self.ssd_size, self.buffer = work, segment, ssd_size, buffer
        self.socket = str(work / "kvsidecar.sock")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        began = time.monotonic()
        args = [sys.executable, "-m", "kvsidecar", "serve", "--socket", self.socket,
                "--metrics-address", f"127.0.0.1:{self.port}", "--segment-size", str(self.segment),
                "--ssd-dir", str(self.work / "ssd"), "--ssd-size", str(self.ssd_size),
                "--ssd-buffer-size", str(self.buffer), "--log-level", "info"]  # fmt: skip
        log = open(self.work / "daemon.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while "ready:" not in (self.work / "daemon.log").read_text(errors="replace").split("kvsidecar stopping")[-1]:
            if self.proc.poll() is not None:
                raise SystemExit((self.work / "daemon.log").read_text())
            time.sleep(0.1)
        return time.monotonic() - began

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{label}}}" if label else s.name] = s.value
        return out


def prompt_hashes(p: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(BLOCKS_PER_PROMPT):
        prev = hashlib.sha256(prev + f"bench{p}:{i}".encode()).digest()
        out.append(prev)
    return out


def connect(daemon: Daemon) -> tuple[SidecarClient, torch.Tensor]:
    client = SidecarClient.connect(
        f"unix://{daemon.socket}", model="bench/SSD", layout=EngineLayout(tp_size=1), num_kv_heads=1,
        hash_block_size=BLOCK_TOKENS, groups=[GroupSpec("mla", BLOCK_TOKENS)], client_name="ssd-bench",
    )  # fmt: skip
    kv = shared_tensor((SLOTS, BLOCK_ELEMS), torch.bfloat16)
    client.register([kv], groups_of_tensor=[(0,)])
    return client, kv


def fill(kv: torch.Tensor, p: int) -> None:
    view = kv[:BLOCKS_PER_PROMPT].view(torch.int16)
    view.copy_(torch.arange(view.numel(), dtype=torch.int32).view(view.shape).add(p * 7919).to(torch.int16))


def save_all(client: SidecarClient, kv: torch.Tensor, prompts: int) -> dict[str, float]:
    ids = [list(range(BLOCKS_PER_PROMPT))]
    tokens = BLOCKS_PER_PROMPT * BLOCK_TOKENS
    began = time.monotonic()
    full_at = None
    full_bytes = 0
    retries = 0
    nbytes = 0
    for p in range(prompts):
        fill(kv, p)
        while True:
            result = client.save(prompt_hashes(p), ids, tokens).result()
            nbytes += result.bytes_written
            if full_at is not None:
                full_bytes += result.bytes_written
            if not result.failed:
                break
            if full_at is None:
                full_at = time.monotonic()
            retries += 1
            time.sleep(0.1)
    end = time.monotonic()
    return {
        "bytes": nbytes,
        "seconds": end - began,
        "before_full_seconds": (full_at or end) - began,
        "after_full_bytes": full_bytes,
        "after_full_seconds": end - (full_at or end),
        "retries": retries,
    }


def load_prompts(client: SidecarClient, kv: torch.Tensor, prompts: range) -> tuple[int, int, float]:
    ids = [list(range(BLOCKS_PER_PROMPT, SLOTS))]
    tokens = BLOCKS_PER_PROMPT * BLOCK_TOKENS
    loaded = exact = 0
    began = time.monotonic()
    for p in prompts:
        h = prompt_hashes(p)
        hit = client.lookup(h, tokens + 1)
        if hit.hit_tokens == tokens and not client.load(h, ids, hit):
            loaded += BLOCKS_PER_PROMPT
            fill(kv, p)
            # Compared as integers: some bf16 bit patterns are NaNs, which never equal themselves.
            exact += bool(
                torch.equal(kv[:BLOCKS_PER_PROMPT].view(torch.int16), kv[BLOCKS_PER_PROMPT:].view(torch.int16))
            )
    return loaded, exact, time.monotonic() - began


def sequential_read(directory: Path, limit: int, direct: bool) -> tuple[int, float]:
    """Read the bucket files front to back in 4 MiB requests, as dd would; (bytes, seconds)."""
    files = sorted(directory.glob("*.bucket"), key=lambda f: f.stat().st_mtime)
    buf = mmap.mmap(-1, 4 * MiB)  # page-aligned, as O_DIRECT needs
    total = 0
    began = time.monotonic()
    for f in files:
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while total < limit and (n := os.readv(fd, [buf])) > 0:
                total += n
        finally:
            os.close(fd)
        if total >= limit:
            break
    return total, time.monotonic() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segment", type=parse_size, default=256 * MiB)
    ap.add_argument("--buffer", type=parse_size, default=64 * MiB, help="--ssd-buffer-size of the daemon")
    ap.add_argument("--times", type=int, default=4, help="store this many times the DRAM segment")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier goes (the disk measured)")
    ap.add_argument("--out", help="also write the report (Markdown) here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvsidecar-ssd-bench-", dir=args.dir))
    prompts = args.times * args.segment // (BLOCKS_PER_PROMPT * MiB)
    lines: list[str] = []
    try:
        daemon = Daemon(work, args.segment, 4 * args.times * args.segment, args.buffer)
        daemon.start()
        client, kv = connect(daemon)
        saved = save_all(client, kv, prompts)
        time.sleep(6)  # let the tier gauges refresh
        m0 = daemon.metrics()
        early = range(prompts // 2)  # evicted long ago: on disk
        loaded, exact, seconds = load_prompts(client, kv, early)
        m1 = daemon.metrics()
        disk_bytes = m1["kvsidecar_tier_hit_bytes_total{tier=disk}"] - m0["kvsidecar_tier_hit_bytes_total{tier=disk}"]
        mem_bytes = (
            m1["kvsidecar_tier_hit_bytes_total{tier=memory}"] - m0["kvsidecar_tier_hit_bytes_total{tier=memory}"]
        )
        seq_bytes, seq_s = sequential_read(work / "ssd", int(disk_bytes) or loaded * MiB, direct=False)
        try:
            dio_bytes, dio_s = sequential_read(work / "ssd", int(disk_bytes) or loaded * MiB, direct=True)
        except OSError as exc:
            dio_bytes, dio_s = 0, float("nan")
            print(f"O_DIRECT read not possible here: {exc}", file=sys.stderr)
        held = inventory(work / "ssd")
        client.close()
        daemon.stop()
        restart_s = daemon.start()
        client, kv = connect(daemon)
        r_loaded, r_exact, r_seconds = load_prompts(client, kv, range(prompts))
        hits_after = sum(1 for p in range(prompts) if client.lookup(prompt_hashes(p), 257).hit_tokens)
        client.close()
        recovered = next(
            (line for line in (work / "daemon.log").read_text().splitlines()[::-1] if "recovered" in line), ""
        )
        daemon.stop()

        gib = 1 << 30
        after_rate = saved["after_full_bytes"] / MiB / max(saved["after_full_seconds"], 1e-9)
        before_rate = args.segment / MiB / max(saved["before_full_seconds"], 1e-9)
        direct = f"{dio_bytes / gib / dio_s:.2f} GiB/s" if dio_bytes else "not supported by this filesystem"
        lines += [
            "# Disk tier (--ssd-dir) benchmark",
            "",
            f"`benchmarks/ssd_tier.py --segment {args.segment // MiB}MiB --times {args.times} "
            f"--buffer {args.buffer // MiB}MiB`, disk tier under "
            f"{args.dir} ({os.uname().sysname}, {os.cpu_count()} CPUs), 1 MiB blocks, 16 per prompt, one rank.",
            "",
            "| measure | value |",
            "| --- | --- |",
            f"| stored | {saved['bytes'] / MiB:.0f} MiB = {args.times} x the {args.segment // MiB} MiB DRAM segment, "
            f"{prompts} prompts |",
            f"| save rate while DRAM has room | {before_rate:.0f} MiB/s (first {saved['before_full_seconds']:.1f} s) |",
            f"| sustained save rate into a full DRAM tier | {after_rate:.1f} MiB/s "
            f"({saved['after_full_bytes'] / MiB:.0f} MiB in {saved['after_full_seconds']:.1f} s, "
            f"{saved['retries']} no_space retries at 0.1 s) |",
            f"| disk tier after the saves | {held.keys} blocks, {held.bytes / MiB:.0f} MiB in {held.buckets} buckets |",
            f"| load of the earliest {len(early)} prompts | {loaded / BLOCKS_PER_PROMPT:.0f} prompts, "
            f"{loaded * MiB / gib / seconds:.2f} GiB/s ({disk_bytes / MiB:.0f} MiB from disk, "
            f"{mem_bytes / MiB:.0f} MiB from DRAM), {exact} byte-exact |",
            f"| plain sequential read of the bucket files, buffered | {seq_bytes / gib / seq_s:.2f} GiB/s "
            f"({seq_bytes / MiB:.0f} MiB) |",
            f"| same, O_DIRECT (no page cache) | {direct} |",
            f"| restart (SIGTERM, start, ready) | {restart_s:.1f} s |",
            f"| hit rate after the restart | {hits_after}/{prompts} prompts hit; {r_loaded / BLOCKS_PER_PROMPT:.0f} "
            f"loaded whole, {r_exact} byte-exact, {r_loaded * MiB / gib / max(r_seconds, 1e-9):.2f} GiB/s |",
            "",
            f"Daemon's recovery line: `{recovered.split(': ', 1)[-1] if recovered else 'none'}`",
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
