"""A bare engine rank over raw gRPC stubs: shared-memory regions it owns and one session.

The daemon's own tests use this instead of the client library, so they can send exactly the bytes they mean,
malformed ones included.
"""

from __future__ import annotations

import contextlib
import ctypes
import secrets
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory

import grpc

from kvsidecar_contract.kinds import PROTO_OF_KIND
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc

KIND = {kind.value: value for kind, value in PROTO_OF_KIND.items()}


class Segment:
    """A named shared-memory segment the test owns (and unlinks)."""

    def __init__(self, size: int) -> None:
        self.name = f"kvsidecar-test-{secrets.token_hex(6)}"
        self.shm = shared_memory.SharedMemory(self.name, create=True, size=size)
        self.size = size
        self.fill(0)  # every page backed by its owner, as the client's segments are (the daemon backs none)

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.shm.buf[offset : offset + n])

    def write(self, offset: int, data: bytes) -> None:
        self.shm.buf[offset : offset + len(data)] = data

    def fill(self, byte: int = 0) -> None:
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(self.shm.buf)), byte, self.size)

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


def group(kind: str, block_size: int, window: int = 0, inner: tuple[str, ...] = ()) -> pb.KVCacheGroup:
    return pb.KVCacheGroup(kind=KIND[kind], block_size=block_size, window=window, inner=[KIND[k] for k in inner])


def open_request(
    groups: list[pb.KVCacheGroup],
    *,
    tp: int = 1,
    rank: int = 0,
    pp: int = 1,
    pp_rank: int = 0,
    dcp: int = 1,
    heads: int = 1,
    u: int = 16,
    model: str = "org/Model",
    prefix: str = "",
    role: int = pb.ROLE_RANK,
    hash_bytes: int = 32,
) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(
        engine=pb.EngineIdentity(model=model, cache_prefix=prefix),
        parallel=pb.ParallelLayout(tp_size=tp, tp_rank=rank, pp_size=pp, pp_rank=pp_rank, dcp_size=dcp),
        num_kv_heads=heads,
        hash_block_size=u,
        groups=groups,
        hash_bytes=hash_bytes,
        role=role,
        client_name="test",
    )


class RawRank:
    """One session with one shared-memory segment per group; block b of group g is a fixed-size slice."""

    def __init__(self, target: str, request: pb.OpenSessionRequest, num_blocks: int = 16, block_bytes: int = 4096):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.SidecarStub(self.channel)
        self.request = request
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        opened = self.stub.OpenSession(request, timeout=10)
        self.session = opened.session_id
        self.lease_s = opened.lease_ms / 1000
        self.segments = [Segment(num_blocks * block_bytes) for _ in request.groups]

    @contextlib.contextmanager
    def kept_alive(self) -> Iterator[None]:
        """Renew the session every lease/3 while the block runs, as an engine's client does while it waits.

        Without it a rank that sends nothing for a lease (a test waiting for a master to come back) loses its session.
        """
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.lease_s / 3):
                # A daemon that is down or busy misses one renewal; the next one, a third of a lease later, counts.
                with contextlib.suppress(grpc.RpcError):
                    self.stub.KeepAlive(pb.KeepAliveRequest(session_id=self.session), timeout=self.lease_s / 3)

        thread = threading.Thread(target=renew, name="rawrank-keepalive", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def register(self) -> pb.RegisterMemoryResponse:
        regions = [
            pb.MemoryRegion(
                shm=pb.SharedMemoryHandle(name=seg.name),
                mapping_bytes=seg.size,
                offset=0,
                block_stride=self.block_bytes,
                block_bytes=self.block_bytes,
                num_blocks=self.num_blocks,
                groups=[g],
            )
            for g, seg in enumerate(self.segments)
        ]
        return self.stub.RegisterMemory(pb.RegisterMemoryRequest(session_id=self.session, regions=regions), timeout=10)

    def block(self, g: int, block_id: int) -> bytes:
        return self.segments[g].read(block_id * self.block_bytes, self.block_bytes)

    def fill_block(self, g: int, block_id: int, data: bytes) -> None:
        assert len(data) == self.block_bytes
        self.segments[g].write(block_id * self.block_bytes, data)

    def save(self, hashes: list[bytes], ids: list[list[int]], num_tokens: int, saved: int = 0) -> pb.SaveResponse:
        req = pb.SaveRequest(
            session_id=self.session,
            block_hashes=hashes,
            block_ids=[pb.BlockIds(ids=i) for i in ids],
            num_tokens=num_tokens,
            saved_tokens=saved,
        )
        return self.stub.Save(req, timeout=30)

    def lookup(self, hashes: list[bytes], num_tokens: int, eagle: bool = False) -> pb.LookupResponse:
        req = pb.LookupRequest(session_id=self.session, block_hashes=hashes, num_tokens=num_tokens, eagle=eagle)
        return self.stub.Lookup(req, timeout=30)

    def load(
        self, hashes: list[bytes], ids: list[list[int]], hit: pb.LookupResponse, start: int = 0
    ) -> pb.LoadResponse:
        req = pb.LoadRequest(
            session_id=self.session,
            block_hashes=hashes,
            block_ids=[pb.BlockIds(ids=i) for i in ids],
            hit_tokens=hit.hit_tokens,
            tail_boundaries=list(hit.tail_boundaries),
            start_tokens=start,
        )
        return self.stub.Load(req, timeout=30)

    def close(self) -> None:
        # The daemon may be gone in fault tests; the segments below are ours to clean regardless.
        with contextlib.suppress(grpc.RpcError):
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session), timeout=10)
        self.channel.close()
        for seg in self.segments:
            seg.close()
