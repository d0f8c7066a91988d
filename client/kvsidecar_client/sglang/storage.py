"""`KVSidecarStorage`: SGLang's HiCache L3 tier in the node's kvsidecar daemon, loaded by the `dynamic` backend.

SGLang's factory constructs it with the storage config alone; the host pools arrive in `register_mem_pool_host`
(the KV pool, again in `register_mem_host_pool_v2(pool, "kv")`) and, for a hybrid model, `register_mem_host_pool_v2`
(its Mamba or sliding-window pool); each is shared with the daemon in place as it arrives (sharing.py), and the
session opens once the pools are known (`on_host_pools_registered`, or the first call), one group per pool
(groups.py). A page is a block of the session: SGLang's page hashes are its block hashes, the pool's page index its
block id, so keys come from the daemon's placement as for vLLM and the daemon decides which rank writes what.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvsidecar_client.client import SidecarClient
from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.sglang.blocks import PageMemory
from kvsidecar_client.sglang.groups import model_window, session_shape
from kvsidecar_client.sglang.pages import PagePool, page_pool, pool_buffers, value_identity
from kvsidecar_client.sglang.paging import HASH_BYTES, PageCalls
from kvsidecar_client.sglang.settings import StorageSettings
from kvsidecar_client.sglang.sharing import share_pool

__all__ = ["KVSidecarStorage"]

logger = logging.getLogger(__name__)


class _Pool(NamedTuple):
    """A host pool SGLang registered: the pool, its pages as the daemon sees them, whether it moved in place."""

    pool: Any
    pages: PagePool
    in_place: bool


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
        # SGLang's pool name -> the pool as registered, in the order they came.
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._client: SidecarClient | None = None
        self._calls: PageCalls | None = None
        self._groups: dict[str, int] = {}
        self._window_pages = 0

    # ---- pools and the session ----

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor pool (KV): shared with the daemon now, registered with the session."""
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of the hybrid cache by name (the anchor pool again under "kv" is the same registration)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._add_pool(str(host_pool_name), host_pool)

    def on_host_pools_registered(self) -> None:
        """Every pool is known: open the session and register the memory now, so a bad setup fails the attach
        instead of the first transfer."""
        self._session()

    def _add_pool(self, name: str, pool: Any) -> None:
        with self._lock:
            known = self._pools.get(name)
            if known is not None and known.pool is pool:
                return
            if self._client is not None:
                raise InvalidRequest(f"host pool {name!r} came after the session opened: attach the backend again")
            if known is not None:
                raise InvalidRequest(f"a second host pool named {name!r}")
            pages = page_pool(name, pool)  # refuses a pool it cannot store, with the reason, at the attach
            # SGLang registers pools on its control path, with nothing in flight (sharing.py): the one time a pool
            # may move.
            why = share_pool(pool, pool_buffers(pool)) if self._settings.zero_copy else "zero_copy is false"
            if why is not None:
                logger.info("kvsidecar: host pool %s is copied through the staging area: %s", name, why)
            self._pools[name] = _Pool(pool, pages, why is None)

    def _session(self) -> PageCalls:
        with self._lock:
            if self._calls is not None:
                return self._calls
            if "kv" not in self._pools:
                raise InvalidRequest("no KV host pool registered (register_mem_pool_host)")
            names = ["kv", *(n for n in self._pools if n != "kv")]
            entries = [self._pools[n] for n in names]
            pages = [entry.pages for entry in entries]
            config = self._config
            model = str(config.model_name)
            shape = session_shape(
                pages,
                tp_size=config.tp_size,
                tp_rank=config.tp_rank,
                pp_size=config.pp_size,
                pp_rank=config.pp_rank,
                window=self._window(model, pages),
            )
            identity = value_identity(model, pages, pinned=self._settings.model_identity)
            client = SidecarClient.connect(
                self._settings.socket,
                model=model,
                layout=shape.layout,
                num_kv_heads=shape.num_kv_heads,
                hash_block_size=shape.page_tokens,
                groups=shape.groups,
                cache_prefix=self._settings.cache_prefix,
                value_identity=identity,
                hash_bytes=HASH_BYTES,
                deadlines=self._settings.deadlines,
            )
            try:
                memory = PageMemory(
                    [(entry.pages, pool_buffers(entry.pool)) for entry in entries],
                    [entry.in_place for entry in entries],
                    self._settings.staging_pages,
                )
                client.register(*memory.tensors())
                calls = PageCalls(client, memory, shape.page_tokens)
            except BaseException:
                client.close()
                raise
            logger.info(
                "kvsidecar: session open on %s: %s, pages of %d tokens, value identity %s",
                self._settings.socket,
                ", ".join(f"{e.pages.name} {e.pages.kind} ({e.pages.page_bytes} bytes, "
                          f"{'in place' if e.in_place else 'staged'})" for e in entries),
                shape.page_tokens,
                identity,
            )  # fmt: skip
            self._client, self._calls = client, calls
            self._groups = {name: g for g, name in enumerate(names)}
            self._window_pages = shape.window_pages
            return calls

    def _window(self, model: str, pages: Sequence[PagePool]) -> int:
        """SGLang's restored sliding-window tokens: the extra config's, else the model's (only a window pool asks)."""
        if self._settings.sliding_window or not any(p.kind.startswith("sliding") for p in pages):
            return self._settings.sliding_window
        return model_window(model)

    # ---- v1: KV pages by host index ----

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each key's KV page; True where the page is stored (written now or already there)."""
        calls = self._session()
        pages = self._page_ids("kv", keys, host_indices)
        return [False] * len(keys) if pages is None else calls.save(0, keys, pages, _parent(extra_info))

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load each key's KV page into the host pool; False where it is not stored (SGLang keeps the leading
        Trues)."""
        calls = self._session()
        pages = self._page_ids("kv", keys, host_indices)
        return [False] * len(keys) if pages is None else calls.load(0, keys, pages)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages of the longest stored prefix of keys, from the daemon's staged lookup (every TP rank's share, every
        pool of a hybrid)."""
        return self._session().lookup(keys)

    def exists(self, key: str) -> bool:
        """Whether one page is stored."""
        return self.batch_exists([key]) == 1

    # ---- v2: the hybrid cache's pools ----

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix of keys every pool can serve: the daemon asks every group (its KV pages, the window's
        last pages, a Mamba state at exactly the end), whichever pools the call names."""
        calls = self._session()
        for transfer in pool_transfers or []:
            problem = self._trailing_problem(transfer)
            if problem is not None:
                logger.error("kvsidecar: answering a miss: %s", problem)
                return PoolTransferResult(0, {}, [])
        pages = calls.lookup(keys)
        # One stop point: the daemon's quorum already holds every rank's share, so every rank answers the same.
        return PoolTransferResult(pages, {}, [pages] if pages else [])

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Load each transfer's pages into its pool; per pool, True per page loaded."""
        return self._transfer_v2(transfers, load=True)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages of its pool; per pool, True per page stored."""
        return self._transfer_v2(transfers, load=False, parent=_parent(extra_info))

    def _transfer_v2(
        self, transfers: Sequence[PoolTransfer], *, load: bool, parent: str | None = None
    ) -> dict[str, list[bool]]:
        calls = self._session()
        out: dict[str, list[bool]] = {}
        for transfer in transfers:
            name, keys = str(transfer.name), list(transfer.keys or [])
            pages = self._page_ids(name, keys, transfer.host_indices) if name in self._groups else None
            if pages is None:
                out[name] = [False] * len(keys)
            elif load:
                out[name] = calls.load(self._groups[name], keys, pages)
            else:
                out[name] = calls.save(self._groups[name], keys, pages, parent)
        return out

    def _trailing_problem(self, transfer: PoolTransfer) -> str | None:
        """Why the daemon's rule for a pool would not answer SGLang's hit policy for it, or None."""
        name, count = str(transfer.name), len(transfer.keys or []) or 1
        if name not in self._groups:
            return f"pool {name!r} is not registered with this backend"
        kind = self._pools[name].pages.kind
        if name == "kv":
            return None
        if transfer.hit_policy != PoolHitPolicy.TRAILING_PAGES:
            return f"pool {name!r} asks {transfer.hit_policy}, not its trailing pages"
        wanted = self._window_pages if kind != "mamba" else 1
        if count != wanted:
            return (
                f"pool {name!r} asks its last {count} pages, the session's {kind} group needs {wanted}: set "
                "sliding_window in the extra config to SGLang's swa_retain_window"
            )
        return None

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
        self._session()
        assert self._client is not None
        removed = self._client.reset()
        logger.info("kvsidecar: cleared %d stored pages", removed)
        return True

    def close(self) -> None:
        """End the session (SGLang detaches the backend); the pools stay shared in place for a later attach."""
        with self._lock:
            client, self._client, self._calls = self._client, None, None
        if client is not None:
            client.close()

    # ---- input ----

    def _page_ids(self, name: str, keys: Sequence[str], host_indices: torch.Tensor | None) -> torch.Tensor | None:
        """The pool's page of each key (key i's page starts at host_indices[i * page_size]), or None."""
        page_size = self._pools[name].pages.page_size
        if host_indices is None or host_indices.numel() != len(keys) * page_size:
            count = 0 if host_indices is None else host_indices.numel()
            logger.error("kvsidecar: %d host indices for %d keys of %d-slot pages of %s", count, len(keys),
                         page_size, name)  # fmt: skip
            return None
        starts = host_indices.reshape(-1)[::page_size].to(device="cpu", dtype=torch.int64)
        if bool((starts % page_size).any()):
            logger.error("kvsidecar: host indices of %s do not start pages", name)
            return None
        return starts // page_size


def _parent(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    """The key before a call's first key, where SGLang passes the chain before it (`prefix_keys`)."""
    prefix = extra_info.prefix_keys if extra_info is not None else None
    return prefix[-1] if prefix else None


_BY_INDEX = (
    'KVSidecarStorage moves pages by host index: set "interface_v1": 1 in --hicache-storage-backend-extra-config'
)
