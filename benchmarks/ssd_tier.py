"""The disk tier (--ssd-dir) through a real daemon, against the disk itself, in one run.

    .venv/bin/python benchmarks/ssd_tier.py [--segment 256MiB] [--times 4] [--queue 256MiB] [--dir /path] [--out FILE]

First the filesystem under --dir alone: O_DIRECT writes of `--times` x the segment in 16 MiB batches (each made
durable, as the tier does), O_DIRECT reads of the same bytes in 1 MiB requests four at a time, and the same reads
buffered from a cold page cache into unaligned memory (the tier's read path). Then a daemon with a DRAM segment of
--segment: one rank (the public client, one MLA-like group of 1 MiB blocks, 16 per prompt) saves as fast as it can
until it has stored `--times` x the segment; the sustained rate is bytes over the time until the disk tier has
made every value durable. A second daemon gets the same saves offered at half the raw write rate, and every prompt is
then loaded back (lost values: any that do not come back byte-exact). The earliest prompts (evicted from DRAM, on
disk only) are loaded cold (page cache dropped) and warm; then the daemon is stopped (SIGTERM) and started again and
every prompt loaded. Everything runs in a temporary directory under --dir, removed after.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import mmap
import os
import re
import shutil
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.parsing import parse_size
from kvsidecar.tiers.records import indexed_keys
from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor
from kvsidecar_testing.processes import Daemon as DaemonProcess

MiB = 1 << 20
GiB = 1 << 30
BLOCK_TOKENS = 16
BLOCK_ELEMS = MiB // 2  # bf16: 1 MiB per block
BLOCKS_PER_PROMPT = 16
SLOTS = 2 * BLOCKS_PER_PROMPT
BATCH = 16 * MiB  # the tier's write batch
DEPTH = 4  # the tier's reads in flight


class TierDaemon:
    """A daemon process with a disk tier (or, ssd_size 0, none), and what this bench reads of it."""

    def __init__(self, work: Path, segment: int, ssd_size: int, queue: int) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        extra = ["--ssd-dir", str(work / "ssd"), "--ssd-size", str(ssd_size), "--ssd-buffer-size", str(queue)]
        # --allow-shm-names: its ranks are this bench's own processes, registering named segments.
        self.process = DaemonProcess(
            work, session_ttl=None, segment_size=str(segment), local_buffer_size=None, log_level="info",
            extra=extra if ssd_size else (), allow_shm_names=True,
        )  # fmt: skip
        self.socket = self.process.socket

    def start(self) -> float:
        """Start and wait until ready; the seconds it took."""
        began = time.monotonic()
        self.process.start(timeout=600)
        return time.monotonic() - began

    def stop(self) -> None:
        """SIGTERM, and wait for the daemon to end."""
        self.process.stop(120)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.process.metrics_url, timeout=5) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{label}}}" if label else s.name] = s.value
        return out

    def durable(self, blocks: int, timeout: float = 600) -> tuple[dict[str, float], int, float]:
        """Wait until every saved value is durable on disk (its index record is written after its bytes) or skipped;
        (metrics, values durable, when the last of them became durable).

        Watches the index files rather than the metrics, which the daemon brings up to date only once a second (a
        skipped value is seen that late, so the end is when the index last grew, not when the wait noticed).
        """
        deadline = time.monotonic() + timeout
        checked = 0.0
        skipped = 0.0
        count, last = 0, time.monotonic()
        while True:
            now = len(indexed_keys(self.work / "ssd"))
            if now != count:
                count, last = now, time.monotonic()
            if count + skipped >= blocks or time.monotonic() > deadline:
                return self.metrics(), count, last
            if time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                m = self.metrics()
                skipped = sum(v for k, v in m.items() if k.startswith("kvsidecar_disk_tier_skipped_writes_total"))
            time.sleep(0.005)

    def recovery_line(self) -> str:
        lines = [ln for ln in self.process.log_path.read_text().splitlines() if "recovered" in ln]
        return lines[-1].split(": ", 1)[-1] if lines else ""


def prompt_hashes(p: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(BLOCKS_PER_PROMPT):
        prev = hashlib.sha256(prev + f"bench{p}:{i}".encode()).digest()
        out.append(prev)
    return out


def connect(daemon: TierDaemon) -> tuple[SidecarClient, torch.Tensor]:
    client = SidecarClient.connect(
        f"unix://{daemon.socket}", model="bench/SSD", layout=EngineLayout(tp_size=1), num_kv_heads=1,
        hash_block_size=BLOCK_TOKENS, groups=[GroupSpec("mla", BLOCK_TOKENS)], client_name="ssd-bench",
    )  # fmt: skip
    kv = shared_tensor((SLOTS, BLOCK_ELEMS), torch.bfloat16)
    body = torch.Generator().manual_seed(1)
    kv[:BLOCKS_PER_PROMPT].view(torch.int16).copy_(
        torch.randint(-(1 << 15), 1 << 15, (BLOCKS_PER_PROMPT, BLOCK_ELEMS), generator=body, dtype=torch.int16)
    )
    client.register([kv], groups_of_tensor=[(0,)])
    return client, kv


def fill(kv: torch.Tensor, p: int) -> None:
    """Stamp prompt p on the save slots: a 4 KiB header per block (the body is random per slot, set at connect).

    A full 16 MiB pattern per prompt costs ~140 ms of CPU here, which would be measured instead of the tier.
    """
    head = kv[:BLOCKS_PER_PROMPT].view(torch.int16)[:, :HEADER]
    head.copy_(_STAMP.add(p * 7919).to(torch.int16))


HEADER = 2048  # int16 elements: 4 KiB
_STAMP = torch.arange(BLOCKS_PER_PROMPT * HEADER, dtype=torch.int32).view(BLOCKS_PER_PROMPT, HEADER)


def save_all(client: SidecarClient, kv: torch.Tensor, prompts: int, rate: float | None = None) -> dict[str, float]:
    """Save every prompt (at most `rate` bytes/s when given); no_space retries counted."""
    ids = [list(range(BLOCKS_PER_PROMPT))]
    tokens = BLOCKS_PER_PROMPT * BLOCK_TOKENS
    began = time.monotonic()
    retries = nbytes = 0
    for p in range(prompts):
        fill(kv, p)
        if rate:
            time.sleep(max(0.0, began + nbytes / rate - time.monotonic()))
        while True:
            result = client.save(prompt_hashes(p), ids, tokens).result()
            nbytes += result.bytes_written
            if not result.failed:
                break
            retries += 1
            time.sleep(0.1)
    return {"bytes": nbytes, "began": began, "seconds": time.monotonic() - began, "retries": retries}


def load_prompts(client: SidecarClient, kv: torch.Tensor, prompts: range) -> tuple[int, int, float]:
    """(blocks loaded, prompts byte-exact, seconds) for lookup + load of each prompt in turn."""
    ids = [list(range(BLOCKS_PER_PROMPT, SLOTS))]
    tokens = BLOCKS_PER_PROMPT * BLOCK_TOKENS
    loaded = exact = 0
    seconds = 0.0
    for p in prompts:
        h = prompt_hashes(p)
        began = time.monotonic()
        hit = client.lookup(h, tokens + 1)
        ok = hit.hit_tokens == tokens and not client.load(h, ids, hit)
        seconds += time.monotonic() - began
        if ok:
            loaded += BLOCKS_PER_PROMPT
            fill(kv, p)
            # Compared as integers: some bf16 bit patterns are NaNs, which never equal themselves.
            exact += bool(
                torch.equal(kv[:BLOCKS_PER_PROMPT].view(torch.int16), kv[BLOCKS_PER_PROMPT:].view(torch.int16))
            )
    return loaded, exact, seconds


def drop_page_cache(directory: Path) -> None:
    """Evict the directory's files from the page cache (clean pages), so the next reads come from the disk."""
    for f in directory.glob("*"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_disk(directory: Path, total: int) -> dict[str, float]:
    """The filesystem alone, on the tier's access pattern: GiB/s of O_DIRECT writes and of three kinds of reads."""
    path = directory / "raw.bin"
    buf = mmap.mmap(-1, BATCH)  # page aligned, as O_DIRECT needs
    buf.write(os.urandom(BATCH))
    out: dict[str, float] = {}
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        began = time.monotonic()
        for offset in range(0, total, BATCH):
            os.pwritev(fd, [buf], offset)
            os.fdatasync(fd)
        out["write_direct"] = total / GiB / (time.monotonic() - began)
    finally:
        os.close(fd)
    aligned = [mmap.mmap(-1, MiB) for _ in range(DEPTH)]
    # Unaligned destinations, as an engine's blocks are (the tier's buffered reads land there directly).
    raw = ctypes.create_string_buffer(DEPTH * MiB + 64)
    dest = [memoryview((ctypes.c_char * MiB).from_address(ctypes.addressof(raw) + 24 + i * MiB)).cast("B")
            for i in range(DEPTH)]  # fmt: skip

    def read(flags: int, mode: str, sequential: bool = False) -> float:
        """mode: "aligned" (into page-aligned memory), "bounce" (that, then a copy to unaligned), "unaligned"."""
        rfd = os.open(path, os.O_RDONLY | flags)
        try:
            drop_page_cache(directory)
            if sequential:
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

            def one(i: int) -> None:
                slot = i % DEPTH
                if mode == "unaligned":
                    os.preadv(rfd, [dest[slot]], i * MiB)
                    return
                os.preadv(rfd, [aligned[slot]], i * MiB)
                if mode == "bounce":
                    dest[slot][:] = aligned[slot]

            began = time.monotonic()
            with ThreadPoolExecutor(DEPTH) as pool:
                for start in range(0, total // MiB, DEPTH):
                    list(pool.map(one, range(start, min(start + DEPTH, total // MiB))))
            return total / GiB / (time.monotonic() - began)
        finally:
            os.close(rfd)

    out["read_direct"] = read(os.O_DIRECT, "aligned")
    out["read_direct_bounce"] = read(os.O_DIRECT, "bounce")
    out["read_buffered_cold"] = read(0, "unaligned")
    out["read_buffered_cold_sequential"] = read(0, "unaligned", sequential=True)
    path.unlink()
    return out


def index_replay(directory: Path, tier: int, value: int) -> tuple[int, float]:
    """(records, seconds) for the engine to recover a full tier of `tier` bytes of `value`-byte values (sparse files:
    the index is real, the data is not read at recovery)."""
    from kvsidecar.tiers.engine import DiskEngine
    from kvsidecar.tiers.files import default_file_size
    from kvsidecar.tiers.records import PUT, Record, encode

    file_size = default_file_size(tier)
    per_file = file_size // value
    files = tier // file_size
    directory.mkdir()
    for n in range(1, files + 1):
        (directory / f"{n:08d}.seg").touch(mode=0o600)
        os.truncate(directory / f"{n:08d}.seg", file_size)
        records = (
            Record(PUT, f"kvs1@@bench~{n:08x}@s0.c0.d0.p0.g0@{i:064x}", i * value, value, i) for i in range(per_file)
        )
        (directory / f"{n:08d}.idx").write_bytes(b"".join(encode(r) for r in records))
    drop_page_cache(directory)
    engine = DiskEngine(directory, tier, queue_bytes=MiB)
    try:
        return engine.recovery.blocks, engine.recovery.seconds
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segment", type=parse_size, default=256 * MiB, help="the daemon's DRAM segment")
    ap.add_argument("--times", type=int, default=4, help="store this many times the DRAM segment")
    ap.add_argument("--queue", type=parse_size, default=256 * MiB, help="--ssd-buffer-size (the write queue bound)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier goes (the disk measured)")
    ap.add_argument("--out", help="also write the report (Markdown) here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvsidecar-ssd-bench-", dir=args.dir))
    total = args.times * args.segment
    prompts = total // (BLOCKS_PER_PROMPT * MiB)
    ssd_size = 2 * total
    try:
        raw = raw_disk(work, total)
        replayed, replay_s = index_replay(work / "replay", 8 * GiB, 16 << 10)

        # 0. The same saves into a daemon without a disk tier (Mooncake evicts to make room): the save path's own pace.
        bare = TierDaemon(work / "bare", args.segment, 0, 0)
        bare.start()
        client, kv = connect(bare)
        control = save_all(client, kv, prompts)
        client.close()
        bare.stop()

        # 1. As fast as the rank can save: the sustained rate is the time until every value is durable on disk.
        fast = TierDaemon(work / "fast", args.segment, ssd_size, args.queue)
        fast.start()
        client, kv = connect(fast)
        saved = save_all(client, kv, prompts)
        m, durable_values, durable_at = fast.durable(prompts * BLOCKS_PER_PROMPT)
        durable_s = durable_at - saved["began"]
        skipped_fast = {k: v for k, v in m.items() if k.startswith("kvsidecar_disk_tier_skipped_writes_total") and v}
        on_disk = len(indexed_keys(work / "fast" / "ssd"))
        # Loads of the earliest half (evicted from DRAM: on disk only), cold then warm.
        early = range(prompts // 2)
        m0 = fast.metrics()
        drop_page_cache(work / "fast" / "ssd")
        cold = load_prompts(client, kv, early)
        warm = load_prompts(client, kv, early)
        m1 = fast.metrics()
        disk_bytes = m1["kvsidecar_tier_hit_bytes_total{tier=disk}"] - m0["kvsidecar_tier_hit_bytes_total{tier=disk}"]
        mem_bytes = (
            m1["kvsidecar_tier_hit_bytes_total{tier=memory}"] - m0["kvsidecar_tier_hit_bytes_total{tier=memory}"]
        )
        client.close()
        fast.stop()
        restart_s = fast.start()
        client, kv = connect(fast)
        drop_page_cache(work / "fast" / "ssd")
        after = load_prompts(client, kv, range(prompts))
        client.close()
        fast.stop()
        recovered = fast.recovery_line()

        # 2. Offered at half the raw write rate: nothing may be lost.
        paced = TierDaemon(work / "paced", args.segment, ssd_size, args.queue)
        paced.start()
        client, kv = connect(paced)
        offered = raw["write_direct"] * GiB / 2
        paced_saved = save_all(client, kv, prompts, rate=offered)
        pm, _, _ = paced.durable(prompts * BLOCKS_PER_PROMPT)
        paced_skipped = sum(v for k, v in pm.items() if k.startswith("kvsidecar_disk_tier_skipped_writes_total"))
        back = load_prompts(client, kv, range(prompts))
        client.close()
        paced.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def gibs(blocks: int, seconds: float) -> float:
        return blocks * MiB / GiB / max(seconds, 1e-9)

    sustained = durable_values * MiB / GiB / durable_s
    control_rate = control["bytes"] / GiB / control["seconds"]
    save_rate = saved["bytes"] / GiB / saved["seconds"]
    cold_rate, warm_rate = gibs(cold[0], cold[2]), gibs(warm[0], warm[2])
    lost = prompts - back[1]
    after_rate = gibs(after[0], after[2])
    lines = [
        "| measure | value | ratio to the disk |",
        "| --- | --- | --- |",
        f"| raw O_DIRECT write, {BATCH // MiB} MiB batches each made durable | {raw['write_direct']:.2f} GiB/s | 1 |",
        f"| raw O_DIRECT read, 1 MiB requests {DEPTH} deep, aligned memory | {raw['read_direct']:.2f} GiB/s | 1 |",
        f"| same, then copied to unaligned memory (a bounce buffer) | {raw['read_direct_bounce']:.2f} GiB/s "
        f"| {raw['read_direct_bounce'] / raw['read_direct']:.2f} x read |",
        f"| same, buffered from a cold page cache straight into unaligned memory "
        f"| {raw['read_buffered_cold']:.2f} GiB/s | {raw['read_buffered_cold'] / raw['read_direct']:.2f} x read |",
        f"| same, with POSIX_FADV_SEQUENTIAL (the tier's reads) | {raw['read_buffered_cold_sequential']:.2f} GiB/s "
        f"| {raw['read_buffered_cold_sequential'] / raw['read_direct']:.2f} x read |",
        f"| no disk tier: the same saves, DRAM evicting to make room (the save path's own pace) "
        f"| {control['bytes'] / GiB / control['seconds']:.2f} GiB/s ({control['retries']} no_space retries) | |",
        f"| tier: saves of {total // MiB} MiB ({args.times} x the {args.segment // MiB} MiB DRAM segment) as fast as "
        f"one rank goes, answered | {save_rate:.2f} GiB/s ({saved['retries']} no_space retries) | |",
        f"| tier: sustained, until every value is durable on disk | {sustained:.2f} GiB/s "
        f"| {sustained / raw['write_direct']:.2f} x write, {sustained / control_rate:.2f} x no disk tier |",
        f"| tier: values on disk after those saves | {on_disk:.0f} of {prompts * BLOCKS_PER_PROMPT} "
        f"(skipped: {skipped_fast or 'none'}) | |",
        f"| tier: saves offered at half the raw write ({offered / GiB:.2f} GiB/s), then every prompt loaded "
        f"| {prompts - lost} of {prompts} prompts byte-exact, {paced_skipped:.0f} writes skipped, "
        f"saved at {paced_saved['bytes'] / GiB / paced_saved['seconds']:.2f} GiB/s | |",
        f"| tier: loads of the {len(early)} earliest prompts (on disk only), cold page cache "
        f"| {cold_rate:.2f} GiB/s, {cold[1]} byte-exact | {cold_rate / raw['read_direct']:.2f} x read |",
        f"| same, warm page cache | {warm_rate:.2f} GiB/s, {warm[1]} byte-exact "
        f"| {warm_rate / raw['read_direct']:.2f} x read |",
        f"| (bytes those loads took from disk / from DRAM) | {disk_bytes / MiB:.0f} MiB / "
        f"{mem_bytes / MiB:.0f} MiB | |",
        f"| restart (SIGTERM, start, ready) | {restart_s:.1f} s | |",
        f"| recovery of a full 8 GiB tier of 16 KiB values: index replay, cold page cache | {replayed} records in "
        f"{replay_s:.2f} s | |",
        f"| after the restart, every prompt, cold | {after[0] // BLOCKS_PER_PROMPT} of {prompts} loaded, {after[1]} "
        f"byte-exact, {after_rate:.2f} GiB/s | {after_rate / raw['read_direct']:.2f} x read |",
    ]
    shown = re.sub(r"/\S*kvsidecar-ssd-bench-\w+", "DIR", recovered)
    report = "\n".join(
        [
            f"`benchmarks/ssd_tier.py --segment {args.segment // MiB}MiB --times {args.times} "
            f"--queue {args.queue // MiB}MiB`, under {args.dir} ({os.uname().sysname}, {os.cpu_count()} CPUs), "
            "1 MiB blocks, 16 per prompt, one rank.",
            "",
            *lines,
            "",
            f"Daemon's recovery line: `{shown or 'none'}`",
        ]
    )
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
