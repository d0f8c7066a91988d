"""Engine tensors described as the MemoryRegion messages the daemon maps: each block's place in its mapping, the
dense pieces of a block, CUDA IPC handles, and the regions of one registration with their KV-head cuts."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.memory import segment_of
from kvsidecar_contract.limits import MAX_REGIONS
from kvsidecar_contract.proto import sidecar_pb2 as pb

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_OUTER_PIECES",
    "RegionGeometry",
    "cuda_ipc_handle",
    "dense_pieces",
    "describe_region",
    "describe_regions",
    "device_uuid",
    "region_geometry",
]

_U32 = 2**32 - 1


class RegionGeometry(NamedTuple):
    """Where block b lives in a mapping: [offset + b * block_stride, + block_bytes)."""

    offset: int
    block_stride: int
    block_bytes: int
    num_blocks: int


def _block_is_dense(tensor: torch.Tensor) -> bool:
    """Whether one block (dim 0 fixed) is a single gap-free byte range, in any order of its dims."""
    expected = 1
    for size, stride in sorted(
        ((size, stride) for size, stride in zip(tensor.shape[1:], tensor.stride()[1:], strict=True) if size > 1),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def dense_pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Views of a tensor (dim 0 = blocks) whose blocks are each one dense byte range; together, every block's bytes.

    A block that is already dense (vLLM's LBHNC, LBNHC, BLHNC, BLNHC: any permutation of its dims) is one piece;
    otherwise the block dim with the largest stride is split (the head dim of LHBNC and BHLNC) until every piece is
    dense. Pieces come in index order of the dims split, so every rank with the same layout lists them alike.
    """
    if tensor.dim() < 1:
        raise InvalidRequest("a KV-cache tensor needs at least one dimension (dim 0 indexes blocks)")
    split = [d for d in range(1, tensor.dim()) if tensor.shape[d] > 1]
    if any(tensor.stride(d) < 1 for d in split):
        raise InvalidRequest(
            f"a block of a tensor of shape {tuple(tensor.shape)} and stride {tensor.stride()} repeats its own bytes "
            "(a stride of 0): register the underlying tensor instead of an expanded view"
        )
    pieces = [tensor]
    while not all(_block_is_dense(piece) for piece in pieces):
        piece = pieces[0]
        dims = [d for d in range(1, piece.dim()) if piece.shape[d] > 1]
        outer = max(dims, key=piece.stride)
        if len(pieces) * piece.shape[outer] > MAX_REGIONS:
            raise InvalidRequest(
                f"a tensor of shape {tuple(tensor.shape)} and stride {tensor.stride()} splits into more than "
                f"{MAX_REGIONS} dense pieces per block"
            )
        # Every piece has the same shape and strides, so one rule splits them all alike.
        pieces = [part.select(outer, i) for part in pieces for i in range(part.shape[outer])]
    _check_disjoint(tensor, pieces)
    return pieces


def _check_disjoint(tensor: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
    size = tensor.element_size()
    spans = sorted(
        (piece.storage_offset() * size, (piece.storage_offset() + _block_numel(piece)) * size) for piece in pieces
    )
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise InvalidRequest(
                f"the elements of one block of a tensor of shape {tuple(tensor.shape)} and stride {tensor.stride()} "
                "overlap each other"
            )


def _block_numel(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:])


def region_geometry(tensor: torch.Tensor) -> RegionGeometry:
    """Offsets of a tensor whose dim 0 indexes blocks, in bytes from the start of its storage."""
    import torch

    if tensor.layout != torch.strided:
        raise InvalidRequest(f"a KV-cache tensor must be strided, got layout {tensor.layout}")
    if tensor.dim() < 1:
        raise InvalidRequest("a KV-cache tensor needs at least one dimension (dim 0 indexes blocks)")
    num_blocks = tensor.shape[0]
    if not 1 <= num_blocks <= _U32:
        raise InvalidRequest(f"a KV-cache tensor needs 1..{_U32} blocks in dim 0, got {num_blocks}")
    # The daemon copies one byte range per block: a block with gaps is split by dense_pieces first.
    if not _block_is_dense(tensor):
        raise InvalidRequest(
            f"block 0 of a tensor of shape {tuple(tensor.shape)} and stride {tensor.stride()} is not contiguous in "
            "any order of its dims; split it with dense_pieces (register does) or register the underlying tensor"
        )
    size = tensor.element_size()
    block_bytes = _block_numel(tensor) * size
    block_stride = tensor.stride(0) * size
    if num_blocks == 1:
        # With one block the stride is never used, and torch may report anything for a size-1 dim.
        block_stride = max(block_stride, block_bytes)
    if block_bytes < 1 or block_stride < block_bytes:
        raise InvalidRequest(
            f"blocks overlap: block stride {block_stride} bytes is less than the block's {block_bytes} bytes"
        )
    # With every stride positive the block's first element is its lowest address.
    return RegionGeometry(int(tensor.storage_offset()) * size, block_stride, block_bytes, num_blocks)


def _as_bytes(value: Any) -> bytes:
    # torch hands out bytes, but None where there is nothing to share (no event to wait on).
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def cuda_ipc_handle(share: Sequence[Any]) -> pb.CudaIpcHandle:
    """The contract's CudaIpcHandle from the 8-tuple of torch's `UntypedStorage._share_cuda_()`."""
    if len(share) != 8:
        raise InvalidRequest(f"expected the 8 fields of _share_cuda_(), got {len(share)}")
    device, handle, size, offset, ref_counter, ref_counter_offset, event, event_sync = share
    if not handle:
        raise InvalidRequest("the CUDA storage has no IPC handle (an empty storage cannot be shared)")
    return pb.CudaIpcHandle(
        device=int(device),
        handle=_as_bytes(handle),
        storage_size=int(size),
        storage_offset=int(offset),
        ref_counter_handle=_as_bytes(ref_counter),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=_as_bytes(event),
        event_sync_required=bool(event_sync),
    )


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID, by which the daemon finds it whatever index this process gives it (per-process
    CUDA_VISIBLE_DEVICES makes every rank's GPU its cuda:0)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def describe_region(
    tensor: torch.Tensor,
    groups: Sequence[int],
    *,
    cuda_handles: dict[tuple[int, int], pb.CudaIpcHandle] | None = None,
    fds: list[int] | None = None,
) -> pb.MemoryRegion:
    """One MemoryRegion for a KV-cache tensor: its handle, mapping size, block geometry and groups.

    `cuda_handles` memoizes CUDA IPC handles by (device, storage address) across the regions of one registration.
    `fds` collects the memfds the registration passes over the side socket (a region names its fd by index);
    None means there is no side socket (a TCP daemon), where only named segments can be registered.
    """
    if not groups or any(not isinstance(g, int) or g < 0 for g in groups):
        raise InvalidRequest(f"a region needs one or more group indices >= 0, got {groups!r}")
    geometry = region_geometry(tensor)
    device = tensor.device.type
    region = pb.MemoryRegion(
        offset=geometry.offset,
        block_stride=geometry.block_stride,
        block_bytes=geometry.block_bytes,
        num_blocks=geometry.num_blocks,
        groups=list(groups),
    )
    if device == "cpu":
        segment = segment_of(tensor)
        if segment is None:
            raise InvalidRequest(
                "a CPU KV-cache tensor must live in shared memory the daemon can open: allocate it with "
                "kvsidecar_client.shared_tensor(shape, dtype)"
            )
        if segment.sealed:
            if fds is None:
                raise InvalidRequest(
                    "a sealed memfd tensor reaches the daemon over its Unix socket only: for a daemon reached over "
                    "TCP allocate with kvsidecar_client.shared_tensor(shape, dtype, named=True) (trusted ranks only)"
                )
            if segment.fd not in fds:
                fds.append(segment.fd)
            region.memfd.index = fds.index(segment.fd)
        else:
            region.shm.name = segment.name
        region.mapping_bytes = segment.size
    elif device == "cuda":
        # The handle names the caching allocator's whole block; storage_offset says where this storage starts in
        # it, and the region's offset counts from there.
        storage = tensor.untyped_storage()
        key = (tensor.device.index or 0, storage.data_ptr())
        handle = None if cuda_handles is None else cuda_handles.get(key)
        if handle is None:
            # Every _share_cuda_() call takes a new slot in torch's IPC reference counter, which only the daemon
            # releases, and the daemon maps views of one storage once: so share each storage once per registration.
            handle = cuda_ipc_handle(storage._share_cuda_())  # type: ignore[no-untyped-call]
            handle.device_uuid = device_uuid(tensor.device)
            if cuda_handles is not None:
                cuda_handles[key] = handle
        region.cuda.CopyFrom(handle)
        region.mapping_bytes = region.cuda.storage_size
    else:
        raise InvalidRequest(f"KV-cache tensors must be on cpu or cuda, got {tensor.device}")
    end = geometry.offset + (geometry.num_blocks - 1) * geometry.block_stride + geometry.block_bytes
    if end > region.mapping_bytes:
        raise InvalidRequest(f"the tensor's blocks end at byte {end}, past its {region.mapping_bytes}-byte mapping")
    return region


def describe_regions(
    memory: Sequence[tuple[torch.Tensor, Sequence[int], int | None]],
    fds: list[int] | None = None,
    cuts: Sequence[tuple[int, int]] = (),
) -> list[pb.MemoryRegion]:
    """The regions of one registration: each tensor's dense pieces in order; views of one CUDA storage share a handle,
    of one memfd one descriptor.

    Done once at registration: the daemon then moves every block as the same list of byte ranges, with no
    per-block work in Python on either side. fds (filled here) are the memfds to pass over the side socket first;
    None: no side socket. Each entry is (tensor, its groups, its KV-head dim or None); cuts[g] = (values per
    block, the rank's KV heads) with more than one value (a group shared across TP sizes: docs/placement.md rule
    11) needs that dim.
    """
    cuda_handles: dict[tuple[int, int], pb.CudaIpcHandle] = {}
    regions = []
    for index, (tensor, groups, head_dim) in enumerate(memory):
        heads = _heads_of(index, tensor, groups, head_dim, cuts)
        if heads > 1:
            assert head_dim is not None  # _heads_of refuses a cut without it
            pieces = _head_major_pieces(index, tensor, head_dim)
        else:
            pieces = dense_pieces(tensor)
        for piece in pieces:
            region = describe_region(piece, groups, cuda_handles=cuda_handles, fds=fds)
            region.heads = heads if heads > 1 else 0
            regions.append(region)
    if len(regions) > MAX_REGIONS:
        raise InvalidRequest(
            f"{len(memory)} tensors split into {len(regions)} dense regions, more than the {MAX_REGIONS} a session "
            "may register"
        )
    return regions


def _heads_of(
    index: int, tensor: torch.Tensor, groups: Sequence[int], head_dim: int | None, cuts: Sequence[tuple[int, int]]
) -> int:
    """The KV heads a tensor's block holds head-major, where its groups cut values by heads (else 1), checked."""
    wanted = {cuts[g] for g in groups if 0 <= g < len(cuts)} or {(1, 1)}
    if len(wanted) > 1:
        raise InvalidRequest(f"tensor {index} serves groups cut into different numbers of values per block")
    values, heads = wanted.pop()
    if values == 1:
        return 1
    where = f"tensor {index} (shape {tuple(tensor.shape)}, stride {tensor.stride()})"
    if head_dim is None:
        raise InvalidRequest(
            f"{where}: its group stores {values} values per block across TP sizes, cut from this rank's {heads} KV "
            "heads, so register must be told which dim holds the KV heads (head_dims)"
        )
    if not 1 <= head_dim < tensor.dim() or tensor.shape[head_dim] != heads:
        raise InvalidRequest(f"{where}: dim {head_dim} should hold this rank's {heads} KV heads")
    return heads


# At most this many pieces per block are made to bring a block's KV heads outermost (K and V of a block-outermost
# layout: 2); more (a token-major layout: one piece per token) would make every value hundreds of tiny slices.
MAX_OUTER_PIECES = 4


def _head_major_pieces(index: int, tensor: torch.Tensor, head_dim: int) -> list[torch.Tensor]:
    """Views of a tensor whose blocks are each one dense range with the KV heads outermost, in the order of the dims
    split (a block-outermost [blocks, K|V, heads, ...] cache gives its K and its V), so one head's bytes of every
    piece are one range; refused with the reason where that takes more than MAX_OUTER_PIECES pieces."""
    where = f"tensor {index} (shape {tuple(tensor.shape)}, stride {tensor.stride()})"
    outer = sorted(
        (d for d in range(1, tensor.dim()) if d != head_dim and tensor.shape[d] > 1),
        key=tensor.stride,
        reverse=True,
    )
    outer = [d for d in outer if tensor.stride(d) > tensor.stride(head_dim)]
    if math.prod(tensor.shape[d] for d in outer) > MAX_OUTER_PIECES:
        raise InvalidRequest(
            f"{where}: the KV heads (dim {head_dim}) are not the outermost dim of a block (a token-major layout such "
            "as NHD), so one head's bytes are many small ranges; share values across TP sizes with a head-major "
            "layout (HND), or open the session without share_across_tp"
        )
    pieces = [tensor]
    for d in sorted(outer, key=tensor.stride, reverse=True):
        # Selecting dim d of every piece; dims after it shift down by one in the pieces, and so does the head dim.
        shift = sum(1 for e in outer if tensor.stride(e) > tensor.stride(d) and e < d)
        pieces = [p.select(d - shift, i) for p in pieces for i in range(tensor.shape[d])]
    for piece in pieces:
        if not _block_is_dense(piece):
            raise InvalidRequest(
                f"{where}: its blocks do not split into dense ranges with the KV heads outermost (the heads are "
                "outside the blocks, as in LHBNC or BHLNC); share values across TP sizes with a layout whose blocks "
                "hold their heads (HND), or open the session without share_across_tp"
            )
    return pieces
