"""Hostile traffic for the soak: bad requests interleaved with the engines' well-behaved ones."""

from __future__ import annotations

import os
import random
import threading
import traceback

import grpc

from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.fuzzsessions import Guarded, check_memory
from support.fuzzwire import Wire, check_clean
from support.guarded import Geometry, GuardedSegment, region
from support.soakengine import ENGINE_B, Tally
from support.soakrank import NUM_BLOCKS


class Hostile(threading.Thread):
    """Bad requests interleaved with the engines' traffic: out of range and foreign block ids, wrong hash lengths,
    hits no lookup produced, calls out of order, sessions closed twice. Every answer must be clean, and the hostile
    session's own guarded memory may change only under its own successful loads."""

    def __init__(self, target: str, tally: Tally, stop: threading.Event, pause: float = 0.02) -> None:
        super().__init__(name="hostile", daemon=True)
        self.target, self.tally, self.stop_event, self.pause = target, tally, stop, pause
        self.rng = random.Random(f"hostile-{os.getpid()}")
        self.error: str | None = None

    def run(self) -> None:
        wire = Wire(self.target)
        segments: list[GuardedSegment] = []
        try:
            sid = self._open(wire, ENGINE_B.model)  # the engines' model, its own cache prefix
            geo = Geometry(64, 96, 80, 12)
            segment = GuardedSegment(geo.end + 64, prefix="kvsidecar-soak-hostile")
            segments.append(segment)
            reg = wire.rpc(
                "RegisterMemory", pb.RegisterMemoryRequest(session_id=sid, regions=[region(segment, geo, [0])])
            )
            assert reg.ok, reg
            owner = Guarded(sid, [[(segment, geo)]], [segment])
            while not self.stop_event.wait(self.pause):
                self._one(wire, sid, owner)
            wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=sid))
        except Exception:
            self.error = traceback.format_exc()
        finally:
            for segment in segments:
                segment.close()
            wire.close()

    def _open(self, wire: Wire, model: str, role: int = pb.ROLE_RANK) -> str:
        req = pb.OpenSessionRequest(
            engine=pb.EngineIdentity(model=model, cache_prefix="hostile"),
            parallel=pb.ParallelLayout(tp_size=1),
            num_kv_heads=1,
            hash_block_size=16,
            groups=[pb.KVCacheGroup(kind=pb.FULL_ATTENTION, block_size=16)],
            hash_bytes=32,
            role=role,
            client_name="soak hostile",
        )
        out = wire.rpc("OpenSession", req)
        assert out.ok, out
        return out.response.session_id

    def _hashes(self) -> list[bytes]:
        r = self.rng
        n = r.randrange(0, 12)
        hashes = [r.randbytes(32) for _ in range(n)]
        if hashes and r.random() < 0.4:
            hashes[r.randrange(n)] = r.randbytes(r.choice((0, 1, 31, 33, 64, 65)))
        return hashes

    def _ids(self) -> list[pb.BlockIds]:
        r = self.rng
        pick = (lambda: r.randrange(12), lambda: r.randrange(12, NUM_BLOCKS), lambda: r.choice((12, 2**31, 2**32 - 1)))
        groups = 1 if r.random() < 0.85 else r.choice((0, 2, 3))
        return [pb.BlockIds(ids=[r.choice(pick)() for _ in range(r.randrange(0, 14))]) for _ in range(groups)]

    def _one(self, wire: Wire, sid: str, owner: Guarded) -> None:
        r = self.rng
        kind = r.choice(("save", "load", "load", "lookup", "register_again", "out_of_order", "bad_session"))
        ids: list[pb.BlockIds] = []
        if kind == "save":
            req = pb.SaveRequest(
                session_id=sid, block_hashes=self._hashes(), block_ids=self._ids(),
                num_tokens=r.choice((0, 16, 17, 160, 2**40, 2**64 - 1)), saved_tokens=r.choice((0, 16, 2**63)),
            )  # fmt: skip
            out = wire.rpc("Save", req)
        elif kind == "load":
            ids = self._ids()
            req = pb.LoadRequest(
                session_id=sid, block_hashes=self._hashes(), block_ids=ids,
                hit_tokens=r.choice((0, 16, 32, 17, 2**64 - 1)), tail_boundaries=[r.choice((0, 16, 32, 48, 1))],
                start_tokens=r.choice((0, 0, 16, 64)),
            )  # fmt: skip
            out = wire.rpc("Load", req)
        elif kind == "lookup":
            req = pb.LookupRequest(
                session_id=sid, block_hashes=self._hashes(), num_tokens=r.choice((0, 17, 193, 2**64 - 1))
            )
            out = wire.rpc("Lookup", req)
        elif kind == "register_again":
            out = wire.rpc(
                "RegisterMemory",
                pb.RegisterMemoryRequest(
                    session_id=sid, regions=[region(owner.segments[0], owner.groups[0][0][1], [0])]
                ),
            )
            self._expect(out, {grpc.StatusCode.FAILED_PRECONDITION})
            return
        elif kind == "out_of_order":
            other = self._open(wire, "org/SoakHostile", r.choice((pb.ROLE_RANK, pb.ROLE_SCHEDULER)))
            save = pb.SaveRequest(
                session_id=other, block_hashes=self._hashes()[:1], block_ids=[pb.BlockIds(ids=[0])], num_tokens=16
            )
            order = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED}
            self._expect(wire.rpc("Save", save), order | {grpc.StatusCode.INVALID_ARGUMENT})
            self._expect(wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=other)), {grpc.StatusCode.OK})
            self._expect(
                wire.rpc("CloseSession", pb.CloseSessionRequest(session_id=other)), {grpc.StatusCode.NOT_FOUND}
            )
            self._expect(wire.rpc("Save", save), {grpc.StatusCode.NOT_FOUND})
            return
        else:
            out = wire.rpc("KeepAlive", pb.KeepAliveRequest(session_id=r.choice(("", sid[:-1], sid + "=", "x" * 300))))
            self._expect(out, {grpc.StatusCode.NOT_FOUND})
            return
        self._expect(out, None)
        try:
            check_memory([owner], owner if kind == "load" else None, out, ids)
        except AssertionError as exc:
            self.tally.note("hostile:memory_violations", str(exc))

    def _expect(self, out, allowed) -> None:
        try:
            check_clean(out, allowed)
            self.tally.add(f"hostile:{out.method}:{out.code.name}")
        except AssertionError as exc:
            self.tally.note("hostile:unclean_answers", str(exc))
