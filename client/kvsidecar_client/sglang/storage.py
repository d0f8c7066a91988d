"""`KVSidecarStorage`: SGLang's HiCache L3 tier in the node's kvsidecar daemon, loaded by the `dynamic` backend.

SGLang's factory constructs it with the storage config alone; the host pool arrives in `register_mem_pool_host`
(again in `register_mem_host_pool_v2(pool, "kv")`), and the session opens once the pools are known
(`on_host_pools_registered`, or the first call). A page is a block of the session: SGLang's page hashes are its
block hashes, the host pool's page index its block id, so keys come from the daemon's placement as for vLLM and
the daemon decides which rank writes what. Pages travel through a sealed staging area of the rank's own
(`staging.py` says why), zero-copy between that area and the store.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvsidecar_client.client import SidecarClient
from kvsidecar_client.errors import InvalidRequest, SidecarError
from kvsidecar_client.layout import EngineLayout, GroupSpec
from kvsidecar_client.results import Hit
from kvsidecar_client.sglang.pages import PagePool, page_pool, value_identity
from kvsidecar_client.sglang.settings import StorageSettings
from kvsidecar_client.sglang.staging import Staging

__all__ = ["KVSidecarStorage"]

logger = logging.getLogger(__name__)

_HASH_BYTES = 32  # SGLang's page hashes are SHA-256 hex strings


def block_hash(key: str) -> bytes:
    """The daemon's block hash of one SGLang page key: its SHA-256 bytes (any other string is hashed to 32 bytes)."""
    if len(key) == 2 * _HASH_BYTES:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


class KVSidecarStorage(HiCacheStorage):  # type: ignore[misc]
    """A HiCache storage backend whose pages live in the kvsidecar daemon's store (docs/sglang.md)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self._config = storage_config
        self._settings = StorageSettings.from_extra_config(storage_config.extra_config)
        if storage_config.attn_cp_size > 1 or storage_config.dcp_size > 1:
            raise InvalidRequest(
                "KVSidecarStorage does not store context-parallel pages yet (attn_cp_size "
                f"{storage_config.attn_cp_size}, dcp_size {storage_config.dcp_size})"
            )
        if not storage_config.model_name:
            raise InvalidRequest("KVSidecarStorage needs the model's name (SGLang's model path) in its storage config")
        self._pools: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._client: SidecarClient | None = None
        self._pages: list[PagePool] = []
        self._staging: Staging | None = None
        self._save_lock = threading.Lock()
        self._load_lock = threading.Lock()

    # ---- pools and the session ----

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor pool (KV): registered with the daemon once, with the session."""
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of the hybrid cache by name; the anchor pool again under "kv" is the same registration."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._add_pool(str(host_pool_name), host_pool)

    def on_host_pools_registered(self) -> None:
        """Every pool is known: open the session and register the staging memory now, so a bad setup fails the
        attach instead of the first transfer."""
        self._session()

    def _add_pool(self, name: str, pool: Any) -> None:
        with self._lock:
            if self._pools.get(name) is pool:
                return
            if self._client is not None:
                raise InvalidRequest(f"host pool {name!r} came after the session opened: attach the backend again")
            if name in self._pools:
                raise InvalidRequest(f"a second host pool named {name!r}")
            self._pools[name] = pool

    def _session(self) -> SidecarClient:
        with self._lock:
            if self._client is not None:
                return self._client
            if "kv" not in self._pools:
                raise InvalidRequest("no KV host pool registered (register_mem_pool_host)")
            kv = self._pools["kv"]
            pages = [page_pool(kv)]
            config = self._config
            mla = pages[0].kind == "mla"
            # MLA's latent is the same bytes on every TP rank, and SGLang writes it from one rank only (its
            # is_storage_writer): every rank is a TP=1 engine of it, one namespace that rank fills alone.
            tp_size, tp_rank = (1, 0) if mla else (config.tp_size, config.tp_rank)
            layout = EngineLayout(tp_size=tp_size, tp_rank=tp_rank, pp_size=config.pp_size, pp_rank=config.pp_rank)
            identity = value_identity(str(config.model_name), pages, pinned=self._settings.model_identity)
            client = SidecarClient.connect(
                self._settings.socket,
                model=str(config.model_name),
                layout=layout,
                num_kv_heads=pages[0].heads * tp_size,
                hash_block_size=pages[0].page_size,
                groups=[GroupSpec(p.kind, p.page_size) for p in pages],
                cache_prefix=self._settings.cache_prefix,
                value_identity=identity,
                hash_bytes=_HASH_BYTES,
                deadlines=self._settings.deadlines,
            )
            try:
                # Saves use slots (block ids) 0..n-1 and loads n..2n-1, so a save and a load can run side by side.
                self._staging = Staging([(pages[0], kv.kv_buffer)], 2 * self._settings.staging_pages)
                client.register(*self._staging.tensors())
            except BaseException:
                client.close()
                raise
            logger.info(
                "kvsidecar: session open on %s, %s pages of %d tokens (%d bytes each), value identity %s",
                self._settings.socket,
                pages[0].kind,
                pages[0].page_size,
                pages[0].page_bytes,
                identity,
            )
            self._pages = pages
            self._client = client
            return client

    # ---- v1: pages by host index ----

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each key's page; True where the page is stored (written now or already there)."""
        client = self._session()
        pages = self._page_ids(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        out = [False] * len(keys)
        page_size = self._pages[0].page_size
        for start, stop in self._chunks(len(keys)):
            hashes = [block_hash(k) for k in keys[start:stop]]
            count = stop - start
            with self._save_lock:
                assert self._staging is not None
                self._staging.gather(0, pages[start:stop], 0)
                try:
                    result = client.save(hashes, [list(range(count))], count * page_size).result()
                except SidecarError as error:
                    logger.warning("kvsidecar: saving %d pages failed: %s", count, error)
                    continue
            failed = {f.block_id for f in result.failures}
            out[start:stop] = [i not in failed for i in range(count)]
        return out

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load each key's page into the host pool; False where it is not stored (SGLang keeps the leading Trues)."""
        client = self._session()
        pages = self._page_ids(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        out = [False] * len(keys)
        page_size = self._pages[0].page_size
        slots = self._settings.staging_pages
        for start, stop in self._chunks(len(keys)):
            hashes = [block_hash(k) for k in keys[start:stop]]
            count = stop - start
            tokens = count * page_size
            with self._load_lock:
                assert self._staging is not None
                try:
                    # Whole pages, each under its own end boundary: the hit a lookup of these pages would answer.
                    result = client.load_detailed(
                        hashes, [list(range(slots, slots + count))], Hit(tokens, (tokens,) * len(self._pages))
                    )
                except SidecarError as error:
                    logger.warning("kvsidecar: loading %d pages failed: %s", count, error)
                    continue
                failed = {b - slots for b in result.failed_block_ids}
                loaded = [i for i in range(count) if i not in failed]
                chunk = pages[start:stop].index_select(0, torch.tensor(loaded, dtype=torch.int64))
                self._staging.scatter(0, chunk, [slots + i for i in loaded])
            for i in loaded:
                out[start + i] = True
        return out

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages of the longest stored prefix of keys, from the daemon's staged lookup (every TP rank's share)."""
        if not keys:
            return 0
        client = self._session()
        page_size = self._pages[0].page_size
        # One token past the pages: the daemon never serves a prompt's last token, and here every page is whole.
        hit = client.lookup([block_hash(k) for k in keys], len(keys) * page_size + 1)
        if hit.degraded:
            logger.warning("kvsidecar: lookup degraded to a miss: %s", hit.detail)
        return hit.hit_tokens // page_size

    def exists(self, key: str) -> bool:
        """Whether one page is stored."""
        return self.batch_exists([key]) == 1

    # ---- SGLang's calls by value, which only a backend without "interface_v1" gets ----

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Not served: pages move by host index (`"interface_v1": 1` in the extra config)."""
        raise NotImplementedError(_BY_INDEX)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """Not served: pages move by host index (`"interface_v1": 1` in the extra config)."""
        raise NotImplementedError(_BY_INDEX)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Not served: pages move by host index (`"interface_v1": 1` in the extra config)."""
        raise NotImplementedError(_BY_INDEX)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Not served: pages move by host index (`"interface_v1": 1` in the extra config)."""
        raise NotImplementedError(_BY_INDEX)

    # ---- the rest of the interface ----

    def clear(self) -> bool:
        """Remove every page of this model under this cache prefix from the store."""
        removed = self._session().reset()
        logger.info("kvsidecar: cleared %d stored pages", removed)
        return True

    def close(self) -> None:
        """End the session (SGLang detaches the backend)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ---- input ----

    def _chunks(self, count: int) -> list[tuple[int, int]]:
        step = self._settings.staging_pages
        return [(start, min(start + step, count)) for start in range(0, count, step)]

    def _page_ids(self, keys: Sequence[str], host_indices: torch.Tensor) -> torch.Tensor | None:
        """The host pool's page of each key (key i's page starts at host_indices[i * page_size]), or None."""
        page_size = self._pages[0].page_size
        if host_indices.numel() != len(keys) * page_size:
            logger.error(
                "kvsidecar: %d host indices for %d keys of %d-token pages", host_indices.numel(), len(keys), page_size
            )
            return None
        starts = host_indices.reshape(-1)[::page_size].to(torch.int64)
        if bool((starts % page_size).any()):
            logger.error("kvsidecar: host indices do not start pages")
            return None
        return starts // page_size


_BY_INDEX = (
    'KVSidecarStorage moves pages by host index: set "interface_v1": 1 in --hicache-storage-backend-extra-config'
)
