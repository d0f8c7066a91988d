"""Shared-memory tensors and the MemoryRegion description of tensors and their views."""

import gc
import mmap
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from kvsidecar_client import InvalidRequest, shared_tensor
from kvsidecar_client.descriptions import (
    cuda_ipc_handle,
    dense_pieces,
    describe_region,
    describe_regions,
    region_geometry,
)
from kvsidecar_client.memory import SHM_DIR, segment_of
from kvsidecar_contract.proto import sidecar_pb2 as pb


def read_segment(name, size):
    """The segment's bytes as another process sees them: opened by path, like the daemon does."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            return bytes(view)
    finally:
        os.close(fd)


def test_shared_tensor_is_zeroed_named_private_and_visible_by_path():
    kv = shared_tensor((4, 16, 576), torch.bfloat16, named=True)
    segment = segment_of(kv)
    assert kv.shape == (4, 16, 576) and kv.dtype == torch.bfloat16 and kv.device.type == "cpu"
    assert kv.is_contiguous()
    assert re.fullmatch(rf"kvsidecar-{os.getpid()}-\d+-[0-9a-f]{{16}}", segment.name)
    assert segment.size == 4 * 16 * 576 * 2
    stat = os.stat(os.path.join(SHM_DIR, segment.name))
    assert stat.st_size == segment.size
    assert stat.st_mode & 0o777 == 0o600
    assert read_segment(segment.name, segment.size) == bytes(segment.size)
    assert not kv.any()

    kv[2, 3].fill_(1.5)
    expected = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    expected[2, 3] = 1.5
    assert read_segment(segment.name, segment.size) == bytes(expected.view(torch.uint8).flatten().tolist())


def test_writes_through_the_path_show_in_the_tensor():
    kv = shared_tensor(8, torch.int32, named=True)
    segment = segment_of(kv)
    fd = os.open(os.path.join(SHM_DIR, segment.name), os.O_RDWR)
    try:
        with mmap.mmap(fd, segment.size) as view:
            view[4:8] = (123456).to_bytes(4, "little")
    finally:
        os.close(fd)
    assert kv.tolist() == [0, 123456, 0, 0, 0, 0, 0, 0]


def test_names_are_unique():
    a, b = shared_tensor(4, torch.uint8, named=True), shared_tensor(4, torch.uint8, named=True)
    assert segment_of(a).name != segment_of(b).name


def test_segment_lives_as_long_as_any_view_and_is_unlinked_after():
    kv = shared_tensor((2, 3, 4), torch.float16, named=True)
    name = segment_of(kv).name
    path = os.path.join(SHM_DIR, name)
    view = kv[1]
    assert segment_of(view).name == name
    del kv
    gc.collect()
    assert os.path.exists(path)
    view.fill_(2.0)  # still mapped
    del view
    gc.collect()
    assert not os.path.exists(path)


def test_exit_unlinks_and_a_forked_child_does_not(tmp_path):
    # A real process: the creator's exit removes its segments; a child it forked exits without touching them.
    script = textwrap.dedent(
        """
        import os, sys, torch
        from kvsidecar_client import shared_tensor
        from kvsidecar_client.memory import segment_of
        kv = shared_tensor((2, 8), torch.float32, named=True)
        name = segment_of(kv).name
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs atexit handlers in the child
        os.waitpid(pid, 0)
        print(name, os.path.exists("/dev/shm/" + name), flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    name, alive_after_child = done.stdout.split()
    assert alive_after_child == "True"
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert "leaked" not in done.stderr  # unlinked by us, not by the resource tracker


@pytest.mark.parametrize("shape", [(), (0, 4), (2, -1)])
def test_shared_tensor_refuses_empty_shapes(shape):
    with pytest.raises(InvalidRequest, match="positive sizes"):
        shared_tensor(shape, torch.float32, named=True)


def region(**fields):
    return pb.MemoryRegion(**fields)


def test_region_of_a_whole_tensor():
    kv = shared_tensor((10, 16, 576), torch.bfloat16, named=True)
    name = segment_of(kv).name
    assert describe_region(kv, [0, 3]) == region(
        shm=pb.SharedMemoryHandle(name=name),
        mapping_bytes=10 * 16 * 576 * 2,
        offset=0,
        block_stride=16 * 576 * 2,
        block_bytes=16 * 576 * 2,
        num_blocks=10,
        groups=[0, 3],
    )


def test_vllm_key_and_value_views_are_two_regions_of_one_segment():
    # vLLM's FlashAttention layout: (2, num_blocks, block_size, heads, head_dim); K is [0], V is [1].
    kv = shared_tensor((2, 7, 16, 4, 64), torch.float16, named=True)
    name = segment_of(kv).name
    block = 16 * 4 * 64 * 2
    for index in (0, 1):
        assert describe_region(kv[index], (1,)) == region(
            shm=pb.SharedMemoryHandle(name=name),
            mapping_bytes=2 * 7 * block,
            offset=index * 7 * block,
            block_stride=block,
            block_bytes=block,
            num_blocks=7,
            groups=[1],
        )


def test_blocks_first_layout_with_key_and_value_inside_each_block():
    # (num_blocks, 2, block_size, heads, head_dim): one region, both halves in each block's slice.
    kv = shared_tensor((5, 2, 16, 2, 32), torch.bfloat16, named=True)
    assert region_geometry(kv) == (0, 2 * 16 * 2 * 32 * 2, 2 * 16 * 2 * 32 * 2, 5)
    # Only the keys: a strided view whose blocks are 2 KiB apart but 1 KiB long.
    keys = kv[:, 0]
    assert region_geometry(keys) == (0, 4096, 2048, 5)
    values = kv[:, 1]
    assert region_geometry(values) == (2048, 4096, 2048, 5)


def test_a_slice_of_blocks_starts_at_its_first_block():
    kv = shared_tensor((10, 8), torch.float32, named=True)
    assert region_geometry(kv[3:6]) == (3 * 32, 32, 32, 3)
    assert region_geometry(kv[::2]) == (0, 64, 32, 5)


def test_a_one_dimensional_tensor_has_one_element_per_block():
    state = shared_tensor(6, torch.float64, named=True)
    assert region_geometry(state) == (0, 8, 8, 6)


def test_a_single_block_view_has_a_usable_stride():
    kv = shared_tensor((4, 8), torch.float32, named=True)
    assert region_geometry(kv[2:3]) == (64, 32, 32, 1)


def test_a_permuted_dense_block_is_one_region_of_its_bytes():
    # vLLM's default LBNHC view: [B, H, N, C] over memory laid out [B, N, H, C]; a block is one byte range.
    kv = shared_tensor((4, 16, 2, 8), torch.float16, named=True)
    view = kv.transpose(1, 2)
    assert region_geometry(view) == (0, 512, 512, 4)
    pieces = dense_pieces(view)
    assert len(pieces) == 1 and pieces[0] is view


def test_a_block_with_gaps_is_refused_with_the_reason():
    kv = shared_tensor((4, 2, 16, 8), torch.float16, named=True)
    with pytest.raises(InvalidRequest, match="not contiguous"):
        describe_region(kv[:, :, :8], [0])


def test_heads_outer_blocks_split_into_one_dense_piece_per_head():
    # LHBNC: [H, B, N, C] in memory; block b of head h is [h * B * 256 + b * 256, + 256) elements.
    memory = shared_tensor((2, 4, 16, 16), torch.float16, named=True)
    view = memory.permute(1, 0, 2, 3)
    pieces = dense_pieces(view)
    assert [region_geometry(p) for p in pieces] == [(0, 512, 512, 4), (4 * 512, 512, 512, 4)]
    assert [r.block_bytes for r in describe_regions([(view, (0,), None)])] == [512, 512]


def test_padded_pages_keep_their_stride_and_leave_the_padding_out():
    memory = shared_tensor((4, 1024), torch.int8, named=True)
    assert region_geometry(memory[:, :112].view(4, 1, 1, 112)) == (0, 1024, 112, 4)


def test_overlapping_elements_within_a_block_are_refused():
    memory = shared_tensor(64, torch.float32, named=True)
    with pytest.raises(InvalidRequest, match="overlap"):
        dense_pieces(memory.as_strided((4, 3, 4), (16, 2, 1)))
    with pytest.raises(InvalidRequest, match="stride of 0"):
        dense_pieces(memory.as_strided((4, 3, 4), (16, 0, 1)))


def test_more_pieces_than_a_session_may_register_are_refused():
    memory = shared_tensor((5000, 2, 2), torch.float32, named=True)  # 2 blocks of 5000 gapped pieces each
    with pytest.raises(InvalidRequest, match="dense pieces"):
        dense_pieces(memory.permute(1, 0, 2))


def test_overlapping_blocks_are_refused():
    kv = shared_tensor((1, 8), torch.float32, named=True)
    with pytest.raises(InvalidRequest, match="blocks overlap"):
        region_geometry(kv.expand(4, 8))


def test_a_cpu_tensor_outside_shared_memory_is_refused():
    with pytest.raises(InvalidRequest, match="shared_tensor"):
        describe_region(torch.zeros(4, 8), [0])
    kv = shared_tensor((4, 8), torch.float32, named=True)
    with pytest.raises(InvalidRequest, match="shared_tensor"):
        describe_region(kv.clone(), [0])


@pytest.mark.parametrize("groups", [[], [-1], ["0"]])
def test_regions_need_groups(groups):
    kv = shared_tensor((4, 8), torch.float32, named=True)
    with pytest.raises(InvalidRequest, match="group indices"):
        describe_region(kv, groups)


def test_a_scalar_is_refused():
    with pytest.raises(InvalidRequest, match="at least one dimension"):
        region_geometry(shared_tensor(1, torch.float32, named=True)[0])


def test_other_devices_are_refused():
    with pytest.raises(InvalidRequest, match="cpu or cuda"):
        describe_region(torch.empty(4, 8, device="meta"), [0])


# What UntypedStorage._share_cuda_() returns (torch.multiprocessing.reductions): device, allocation handle, storage
# size, storage offset in the allocation, ref-counter file and offset, event handle (None when not needed), flag.
SHARE = (1, b"\x01" * 64, 1 << 30, 4096, b"/torch_123_456_0", 17, b"\x02" * 64, True)


def test_cuda_ipc_handle_from_the_share_tuple():
    assert cuda_ipc_handle(SHARE) == pb.CudaIpcHandle(
        device=1,
        handle=b"\x01" * 64,
        storage_size=1 << 30,
        storage_offset=4096,
        ref_counter_handle=b"/torch_123_456_0",
        ref_counter_offset=17,
        event_handle=b"\x02" * 64,
        event_sync_required=True,
    )


def test_cuda_ipc_handle_without_an_event():
    handle = cuda_ipc_handle((0, b"\x03" * 64, 2048, 0, "/torch_9_9_0", 0, None, False))
    assert handle.event_handle == b""
    assert not handle.event_sync_required
    assert handle.ref_counter_handle == b"/torch_9_9_0"


def test_cuda_ipc_handle_refuses_bad_tuples():
    with pytest.raises(InvalidRequest, match="8 fields"):
        cuda_ipc_handle(SHARE[:7])
    with pytest.raises(InvalidRequest, match="no IPC handle"):
        cuda_ipc_handle((0, None, 0, 0, b"", 0, None, False))


def test_describe_regions_keeps_registration_order():
    kv = shared_tensor((2, 6, 16, 8), torch.float16, named=True)
    state = shared_tensor((6, 32), torch.float32, named=True)
    memory = [(kv[0], (0,)), (kv[1], (0,)), (state, (1,))]
    assert describe_regions([(t, g, None) for t, g in memory]) == [describe_region(t, g) for t, g in memory]


def test_a_group_cut_per_kv_head_declares_its_heads_when_they_are_outermost():
    # vLLM CPU's (2, blocks, heads, block_size, head_size): after the K/V split each block is heads x (16 x 8).
    kv = shared_tensor((2, 4, 2, 16, 8), torch.float16, named=True)
    regions = describe_regions([(kv[0], (0,), 1), (kv[1], (0,), 1)], cuts=[(2, 2)])
    assert [(r.heads, r.block_bytes) for r in regions] == [(2, 512), (2, 512)]
    # Four heads cut in two values of two heads (share_across_tp 2 at TP=1 with H=4): the block holds 4 heads.
    four = shared_tensor((2, 4, 4, 16, 8), torch.float16, named=True)
    assert describe_regions([(four[0], (0,), 1)], cuts=[(2, 4)])[0].heads == 4
    # One head per rank (T >= H): nothing to cut, nothing declared.
    assert describe_regions([(kv[0], (0,), None)], cuts=[(1, 2)])[0].heads == 0


@pytest.mark.parametrize(
    ("shape", "head_dim", "reason"),
    [
        ((2, 4, 16, 2, 8), 2, "not the outermost dim of a block"),
        ((2, 4, 2, 16, 8), None, "register must be told which dim holds the KV heads"),
        ((2, 4, 2, 16, 8), 3, "dim 3 should hold this rank's 2 KV heads"),
    ],
)
def test_a_group_cut_per_kv_head_refuses_what_cannot_be_cut(shape, head_dim, reason):
    kv = shared_tensor(shape, torch.float16, named=True)
    with pytest.raises(InvalidRequest, match=reason):
        describe_regions([(kv[0], (0,), head_dim)], cuts=[(2, 2)])


def test_a_block_outermost_cache_is_cut_into_its_k_and_its_v_to_bring_the_heads_outermost():
    # vLLM's BLHNC: [blocks, K|V, heads, block_size, head_size]; the heads are outermost once K and V are apart.
    kv = shared_tensor((4, 2, 2, 16, 8), torch.float16, named=True)
    regions = describe_regions([(kv, (0,), 2)], cuts=[(2, 2)])
    base = regions[0].offset
    assert [(r.heads, r.block_bytes, r.block_stride, r.offset - base) for r in regions] == [
        (2, 512, 1024, 0),
        (2, 512, 1024, 512),
    ]
