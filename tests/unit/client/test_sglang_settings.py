"""The SGLang backend's extra config: SGLang's own keys pass, ours are checked, anything else is refused."""

from __future__ import annotations

import pytest

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.sglang.settings import DEFAULT_STAGING_PAGES, StorageSettings

SGLANG_OWN = {
    "backend_name": "kvsidecar", "module_path": "kvsidecar_client.sglang", "class_name": "KVSidecarStorage",
    "interface_v1": 1, "allocator": "shm",
}  # fmt: skip


def test_the_documented_flag_set_parses():
    settings = StorageSettings.from_extra_config(
        {**SGLANG_OWN, "socket": "unix:///run/s.sock", "cache_prefix": "team", "timeouts": {"lookup": 1}}
    )
    assert settings.socket == "unix:///run/s.sock" and settings.cache_prefix == "team"
    assert settings.deadlines.lookup == 1.0 and settings.staging_pages == DEFAULT_STAGING_PAGES
    assert settings.zero_copy and settings.sliding_window == 0


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"sokcet": "x"}, "unknown hicache-storage-backend-extra-config keys"),
        ({"timeouts": {"forever": 1}}, "unknown timeouts"),
        ({"timeouts": {"load": 0}}, "deadline load"),
        ({"staging_pages": 0}, "staging_pages"),
        ({"staging_pages": True}, "staging_pages"),
        ({"cache_prefix": 3}, "must be strings"),
        ({"zero_copy": "yes"}, "zero_copy must be true or false"),
        ({"sliding_window": -1}, "sliding_window must be an int"),
    ],
)
def test_a_bad_key_or_value_is_refused_with_the_reason(extra, reason):
    with pytest.raises(InvalidRequest, match=reason):
        StorageSettings.from_extra_config({**SGLANG_OWN, **extra})
