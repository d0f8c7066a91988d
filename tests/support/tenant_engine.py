"""An engine rank of one tenant in its own process, running as a given uid: `python tenant_engine.py JSON`.

It imports everything as the starting user (root in CI), then drops to the tenant's uid and gid before it talks to
the daemon, so the daemon sees that uid through SO_PEERCRED. It prints one JSON line: what each step answered.

Steps (the JSON's "steps", run in order), each answering {"ok": ...} or {"error": class, "reason": ...}:
  open PREFIX         open a rank session under PREFIX (closing any open one), register a sealed memfd tensor
  open_named PREFIX   the same with a named /dev/shm tensor (the daemon takes those from trusted tenants only)
  save SEED N         save N blocks of prompt SEED (hashes and bytes derived from SEED); answers written/failed
  flood SEED N        save N blocks under prompt SEED's hashes without writing their bytes first (cheap volume)
  hits SEED N         look up prompt SEED: hit tokens out of N blocks
  load SEED N         look up and load prompt SEED into fresh blocks; answers loaded and whether the bytes match
  reset               Reset the open session's namespace
  stats               Stats as this uid: the tenants and prefixes of the sessions it sees
  stats_until T P S   Stats, asked again until a session of tenant T under prefix P shows (at most S seconds)
  wait_for PATH S     wait (at most S seconds) until PATH exists, holding the session open meanwhile
  hostile SECONDS     truncate, punch holes in and remap its own memfd in a loop while saving and loading
  open_crafted PREFIX KIND MIB  open as `open` does, but register a crafted memfd of MIB MiB instead of a good one:
                      KIND sparse (ftruncate only, sealed) or hugetlb (MFD_HUGETLB)
  punch               punch every page of the registered memfd out, then save: answers the save
  park PREFIX N       open N rank sessions and park 253 memfds in each until refused (they stay open to the end)
  tickets N           mint up to N side-socket tickets without redeeming them, until refused
  hold_side N SECONDS hold up to N side-socket connections open (sending nothing) for SECONDS
  touch PATH          create PATH (tells the test a step before it is done)
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import mmap
import os
import sys
import threading
import time
from typing import Any

import torch

from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, SidecarError, shared_tensor
from kvsidecar_client import memory as client_memory
from kvsidecar_client.memory import SharedMemory, segment_of
from kvsidecar_contract.limits import MAX_MEMFDS
from kvsidecar_contract.paths import side_socket_path

BLOCK_TOKENS = 16
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def prompt(seed: str, n: int) -> list[bytes]:
    """N chained block hashes of a prompt named seed."""
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def block_bytes(seed: str, i: int, numel: int) -> torch.Tensor:
    """The deterministic content of block i of prompt seed."""
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}#{i}".encode()).digest()[:6], "little"))
    return torch.rand(numel, generator=g)


class Engine:
    """One rank: a client, its KV tensor, and the steps."""

    def __init__(self, target: str, model: str, num_blocks: int, block_floats: int) -> None:
        self.target, self.model = target, model
        self.kv = shared_tensor((num_blocks, block_floats), torch.float32)
        self.named_kv: torch.Tensor | None = None
        self.client: SidecarClient | None = None

    def open(self, prefix: str, named: bool = False) -> dict[str, Any]:
        if named:
            assert self.named_kv is not None, "made before dropping privileges (its resource tracker is a process)"
            self.kv = self.named_kv
        if self.client is not None:
            self.client.close()
            self.client = None
        client = SidecarClient.connect(
            self.target, model=self.model, layout=EngineLayout(), num_kv_heads=1, hash_block_size=BLOCK_TOKENS,
            groups=[GroupSpec("full_attention", BLOCK_TOKENS)], cache_prefix=prefix,
        )  # fmt: skip
        self.client = client
        client.register([self.kv], [(0,)])
        return {"ok": True, "tenant": client.session_info.tenant if client.session_info else ""}

    def _need(self) -> SidecarClient:
        assert self.client is not None, "open first"
        return self.client

    def save(self, seed: str, n: int, fill: bool = True) -> dict[str, Any]:
        client = self._need()
        n = min(n, self.kv.shape[0])
        for i in range(n if fill else 0):
            self.kv[i].copy_(block_bytes(seed, i, self.kv.shape[1]))
        result = client.save(prompt(seed, n), [list(range(n))], n * BLOCK_TOKENS).result()
        reasons = sorted({f.reason for f in result.failures})
        return {"ok": True, "written": result.written, "failed": result.failed, "reasons": reasons}

    def hits(self, seed: str, n: int) -> dict[str, Any]:
        hit = self._need().lookup(prompt(seed, n), n * BLOCK_TOKENS + 1)
        return {"ok": True, "hit_blocks": hit.hit_tokens // BLOCK_TOKENS}

    def load(self, seed: str, n: int) -> dict[str, Any]:
        client = self._need()
        hashes = prompt(seed, n)
        hit = client.lookup(hashes, n * BLOCK_TOKENS + 1)
        k = hit.hit_tokens // BLOCK_TOKENS
        blocks = self.kv.shape[0]
        ids = [blocks - k + i for i in range(k)]  # the top blocks, away from where saves were staged
        self.kv[blocks - k :].zero_()
        failed = client.load(hashes, [ids], hit)
        same = all(torch.equal(self.kv[b], block_bytes(seed, i, self.kv.shape[1])) for i, b in enumerate(ids))
        return {"ok": True, "hit_blocks": k, "failed": len(failed), "bytes_match": same}

    def reset(self) -> dict[str, Any]:
        return {"ok": True, "removed": self._need().reset()}

    def stats(self) -> dict[str, Any]:
        s = self._need().stats()
        return {
            "ok": True,
            "caller_tenant": s.caller_tenant,
            "tenancy": s.tenancy,
            "sessions": sorted({(x.tenant, x.cache_prefix) for x in s.sessions}),
        }

    def stats_until(self, tenant: str, prefix: str, seconds: float) -> dict[str, Any]:
        end = time.monotonic() + seconds
        while True:
            answer = self.stats()
            if [tenant, prefix] in [list(s) for s in answer["sessions"]] or time.monotonic() > end:
                return answer
            time.sleep(0.05)

    def wait_for(self, path: str, seconds: float) -> dict[str, Any]:
        end = time.monotonic() + seconds
        while not os.path.exists(path):
            if time.monotonic() > end:
                return {"ok": False, "reason": f"{path} did not appear in {seconds} s"}
            time.sleep(0.05)
        return {"ok": True}

    def hostile(self, seconds: float) -> dict[str, Any]:
        self._need()
        segment = segment_of(self.kv)
        assert segment is not None and segment.sealed
        fd, size = segment.fd, segment.size
        refused = {"truncate": 0, "grow": 0}
        done = threading.Event()
        punched = remapped = 0

        def attack() -> None:
            nonlocal punched, remapped
            libc = ctypes.CDLL(None, use_errno=True)
            while not done.is_set():
                for what, length in (("truncate", 0), ("grow", size * 2)):
                    try:
                        os.ftruncate(fd, length)
                    except PermissionError:
                        refused[what] += 1
                # Punching holes is allowed: the pages read back as zeros, never as a fault.
                if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) == 0:
                    punched += 1
                with contextlib.closing(mmap.mmap(fd, size)) as m:  # map and unmap its own memory
                    m[0:1] = b"\x00"
                    remapped += 1

        thread = threading.Thread(target=attack, daemon=True)
        thread.start()
        errors: dict[str, int] = {}
        calls = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seed = f"hostile-{calls}"
            try:
                self.save(seed, 4)
                self.load(seed, 4)
            except SidecarError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            calls += 1
        done.set()
        thread.join(10)
        return {"ok": True, "calls": calls, "refused": refused, "punched": punched, "remapped": remapped,
                "errors": errors}  # fmt: skip

    def open_crafted(self, prefix: str, kind: str, mib: int) -> dict[str, Any]:
        size = mib << 20
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if kind == "hugetlb" else 0)
        fd = os.memfd_create("crafted", flags)
        os.ftruncate(fd, size)  # no page backed
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        # The good tensor's storage now claims to live in the crafted memfd: the daemon maps that one.
        base = self.kv.untyped_storage().data_ptr()
        client_memory._segments[base] = SharedMemory("", size, fd)
        return self.open(prefix)

    def punch(self) -> dict[str, Any]:
        segment = segment_of(self.kv)
        assert segment is not None and segment.sealed
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        assert libc.fallocate(segment.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, segment.size) == 0
        return self.save("punched", 2)

    def park(self, prefix: str, sessions: int) -> dict[str, Any]:
        fd = os.memfd_create("parked", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        parked = 0
        self.parked: list[SidecarClient] = []
        for _ in range(sessions):
            client = SidecarClient.connect(
                self.target, model=self.model, layout=EngineLayout(), num_kv_heads=1, hash_block_size=BLOCK_TOKENS,
                groups=[GroupSpec("full_attention", BLOCK_TOKENS)], cache_prefix=prefix,
            )  # fmt: skip
            self.parked.append(client)
            keeper = client._keeper
            session = keeper.session or keeper.recover(None, time.monotonic() + 30, "park")
            try:
                keeper.side.send_fds(session.id, session.side_secret, [fd] * MAX_MEMFDS, 30)
            except SidecarError as exc:
                return {"ok": True, "parked": parked, "code": exc.code.name if exc.code else "", "reason": str(exc)}
            parked += MAX_MEMFDS
        return {"ok": True, "parked": parked}

    def tickets(self, n: int) -> dict[str, Any]:
        side = client_memory_side(self.target)
        for minted in range(n):
            try:
                side.ticket(10)
            except SidecarError as exc:
                return {"ok": True, "minted": minted, "code": exc.code.name if exc.code else "", "reason": str(exc)}
        return {"ok": True, "minted": n}

    def hold_side(self, n: int, seconds: float) -> dict[str, Any]:
        import socket

        path = side_socket_path(self.target.removeprefix("unix://").removeprefix("unix:"))
        held: list[socket.socket] = []
        busy = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for sock in list(held):  # the daemon answers a silent peer after its I/O timeout: reconnect
                sock.setblocking(False)
                try:
                    reply = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    reply = b""
                if b"busy" in reply:
                    busy += 1
                held.remove(sock)
                sock.close()
            while len(held) < n:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.connect(path)
                held.append(sock)
            time.sleep(0.01)
        for sock in held:
            sock.close()
        return {"ok": True, "busy": busy}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for client in getattr(self, "parked", []):
            client.close()


def client_memory_side(target: str) -> Any:
    from kvsidecar_client._side import side_socket_for

    return side_socket_for(target)


def drop_privileges(uid: int, gid: int) -> None:
    """Become uid:gid with no supplementary groups (irreversibly)."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def main() -> None:
    spec = json.loads(sys.argv[1])
    engine = Engine(spec["target"], spec.get("model", "org/model"), spec.get("blocks", 32), spec.get("floats", 1024))
    if any(step[0] == "open_named" for step in spec["steps"]):
        engine.named_kv = shared_tensor(tuple(engine.kv.shape), torch.float32, named=True)
    if "uid" in spec:
        drop_privileges(spec["uid"], spec["gid"])
    answers = []
    for step in spec["steps"]:
        op, *args = step
        try:
            if op in ("open", "open_named"):
                answers.append(engine.open(args[0], named=op == "open_named"))
            elif op == "flood":
                answers.append(engine.save(args[0], int(args[1]), fill=False))
            elif op in ("save", "hits", "load"):
                answers.append(getattr(engine, op)(args[0], int(args[1])))
            elif op == "touch":
                open(args[0], "w").close()
                answers.append({"ok": True})
            elif op == "open_crafted":
                answers.append(engine.open_crafted(args[0], args[1], int(args[2])))
            elif op == "park":
                answers.append(engine.park(args[0], int(args[1])))
            elif op == "tickets":
                answers.append(engine.tickets(int(args[0])))
            elif op == "hold_side":
                answers.append(engine.hold_side(int(args[0]), float(args[1])))
            elif op == "hostile":
                answers.append(engine.hostile(float(args[0])))
            elif op == "stats_until":
                answers.append(engine.stats_until(args[0], args[1], float(args[2])))
            elif op == "wait_for":
                answers.append(engine.wait_for(args[0], float(args[1])))
            else:
                answers.append(getattr(engine, op)())
        except SidecarError as exc:
            answers.append({"error": type(exc).__name__, "code": exc.code.name if exc.code else "", "reason": str(exc)})
    engine.close()
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
