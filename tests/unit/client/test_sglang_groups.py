"""The session an SGLang rank opens from its host pools (groups.py): layout, heads, groups and window, by table."""

from __future__ import annotations

import json

import pytest

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.sglang.groups import model_window, session_shape
from kvsidecar_client.sglang.pages import PagePool, PageRun

PAGE = 16


def _pool(name: str, kind: str, heads: int = 1) -> PagePool:
    return PagePool(name, kind, 1 if kind == "mamba" else PAGE, 8, (PageRun(0, 0, 64, 64),), heads, ())


MHA, MLA = _pool("kv", "full_attention", heads=4), _pool("kv", "mla")
MAMBA, SWA = _pool("mamba", "mamba"), _pool("swa", "sliding_window", heads=4)


@pytest.mark.parametrize(
    ("pools", "tp", "window", "expected"),
    [
        # (pools, TP size, SGLang's window) -> (session TP size and rank, H, groups as (kind, block, window))
        ([MHA], 2, 0, ((2, 1), 8, [("full_attention", PAGE, 0)])),
        ([MLA], 4, 0, ((1, 0), 1, [("mla", PAGE, 0)])),  # the latent: one namespace rank 0 fills
        ([MLA, MAMBA], 1, 0, ((1, 0), 1, [("mla", PAGE, 0), ("mamba", PAGE, 0)])),
        # SGLang restores ceil(40 / 16) = 3 pages: the window that needs exactly those is 3 pages + 1 token.
        ([MHA, MAMBA, SWA], 2, 40, ((2, 1), 8, [("full_attention", PAGE, 0), ("mamba", PAGE, 0),
                                               ("sliding_window", PAGE, 3 * PAGE + 1)])),
    ],
)  # fmt: skip
def test_the_session_follows_the_pools(pools, tp, window, expected):
    shape = session_shape(pools, tp_size=tp, tp_rank=tp - 1, pp_size=1, pp_rank=0, window=window)
    (size, rank), heads, groups = expected
    assert (shape.layout.tp_size, shape.layout.tp_rank, shape.num_kv_heads) == (size, rank, heads)
    assert [(g.kind.value, g.block_size, g.window) for g in shape.groups] == groups
    assert shape.page_tokens == PAGE and shape.window_pages == (3 if window else 0)


@pytest.mark.parametrize(
    ("pools", "tp", "window", "reason"),
    [
        ([MLA, MAMBA], 2, 0, "backs the MLA latent up from TP rank 0 only"),
        ([MHA, SWA], 1, 0, "needs its window"),
        ([MHA, _pool("swa", "sliding_window", heads=2)], 1, 16, "one KV head count"),
        ([MAMBA], 1, 0, "no KV host pool"),
    ],
)
def test_what_the_daemon_could_not_store_as_sglang_writes_it_is_refused(pools, tp, window, reason):
    with pytest.raises(InvalidRequest, match=reason):
        session_shape(pools, tp_size=tp, tp_rank=0, pp_size=1, pp_rank=0, window=window)


def test_the_window_comes_from_the_models_config(tmp_path):
    assert model_window(str(tmp_path)) == 0
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"sliding_window": 4096}}))
    assert model_window(str(tmp_path)) == 4096
