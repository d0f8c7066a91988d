"""DataPath on its own, over the in-memory store: saves, lookups and loads with their exact bytes, the blocks that
fail with the store's codes, and the bounds it keeps (a tenant's write budget, a full store's backoff, the client's
deadline, --max-lookup-hashes).

A rank here is one full-attention group of one layer (K and V regions, two KV heads, TP 1) over plain memory whose
blocks hold bytes from the byte oracle (support.stateranks); a value is one block's K bytes then its V bytes.
"""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from kvsidecar.datapath.backoff import NoSpaceBackoff
from kvsidecar.datapath.retries import RetryPolicy
from kvsidecar.datapath.transfers import DataPath
from kvsidecar.errors import BadRequest
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.movers.trailer import ChecksumSettings
from kvsidecar.reasons import Reason
from kvsidecar.store import StoreCode
from kvsidecar.store.base import StoreUnavailable
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.budget import WriteBudget
from kvsidecar.values import Failure, LoadArgs, LookupArgs, SaveArgs, SaveOutcome
from kvsidecar_contract.placement import NO_BLOCK, save_plan
from kvsidecar_testing.hashes import chained_hashes
from support.stateranks import Attention, Latent, Model, Rank

MODEL = Model((Attention(),), kv_heads=2, layers=1)
HASHES = chained_hashes("prompt", 4)
TOKENS = 64
WRITER_IDS = [1, 3, 5, 6]
READER_IDS = [7, 2, 0, 4]
VALUE_BYTES = 2 * 256  # K and V of one block: 16 tokens x 2 heads x 4 fp16 elements each


def rank(store: MemoryStore, tenant: str = "") -> Rank:
    r = Rank(MODEL, MODEL.layout(1), store)
    r.session.tenant = tenant
    return r


def filled(store: MemoryStore, tenant: str = "") -> Rank:
    r = rank(store, tenant)
    r.fill(HASHES, WRITER_IDS)
    return r


def keys(r: Rank, block_ids: list[int] = WRITER_IDS) -> list[str]:
    """Each block's key, in prompt order."""
    return [c.key for c in save_plan(r.session.geometry, HASHES, [block_ids], TOKENS, 0).chunks]


def value(r: Rank, block_id: int) -> bytes:
    return r.regions[0].read(block_id) + r.regions[1].read(block_id)


def path(store: MemoryStore, **kw: object) -> DataPath:
    return DataPath(store, Metrics(CollectorRegistry()), **kw)  # type: ignore[arg-type]


def save(dp: DataPath, r: Rank, deadline: float | None = None) -> SaveOutcome:
    return dp.save(r.session, SaveArgs(HASHES, [WRITER_IDS], TOKENS), deadline)


def load(dp: DataPath, r: Rank, hit_tokens: int = TOKENS) -> list[Failure]:
    return list(dp.load(r.session, LoadArgs(HASHES, [READER_IDS], hit_tokens, (hit_tokens,))).failures)


def test_a_save_writes_each_block_once_and_a_load_brings_back_exactly_its_bytes():
    store = MemoryStore()
    dp = path(store)
    writer = filled(store)
    assert save(dp, writer) == SaveOutcome(4, 0, (), 0, 4 * VALUE_BYTES)
    assert store.keys() == sorted(keys(writer))
    for key, block in zip(keys(writer), WRITER_IDS, strict=True):
        assert store.value(key) == value(writer, block)
    # Saved again (another rank of a replica, a retried step): found there, nothing written twice.
    assert save(dp, writer) == SaveOutcome(0, 4, (), 0, 0)
    assert store.used_bytes == 4 * VALUE_BYTES

    reader = rank(store)
    assert load(dp, reader) == []
    for got, put in zip(READER_IDS, WRITER_IDS, strict=True):
        assert value(reader, got) == value(writer, put)
    untouched = [b for b in range(8) if b not in READER_IDS]
    assert all(value(reader, b) == value(rank(store), b) for b in untouched)


def test_a_load_of_the_groups_it_carries_reads_those_and_reports_no_other_groups_blocks_failed():
    # One group per call, as SGLang moves its pools: the other group's blocks are NO_BLOCK and not part of the load.
    model = Model((Attention(), Latent()), kv_heads=2, layers=1)
    store, metrics = MemoryStore(), Metrics(CollectorRegistry())
    dp = DataPath(store, metrics)
    writer = Rank(model, model.layout(1), store)
    writer.fill(HASHES, WRITER_IDS)
    assert dp.save(writer.session, SaveArgs(HASHES, [WRITER_IDS, WRITER_IDS], TOKENS)).written == 8
    reader = Rank(model, model.layout(1), store)
    latent_only = [[NO_BLOCK] * 4, READER_IDS]
    out = dp.load(reader.session, LoadArgs(HASHES, latent_only, TOKENS, (TOKENS, TOKENS), carried=[1]))
    assert (out.loaded, out.failures) == (4, ())
    assert [reader.regions[-1].read(b) for b in READER_IDS] == [writer.regions[-1].read(b) for b in WRITER_IDS]
    failed = {"group_kind": "full_attention", "reason": Reason.NO_BLOCK.value}
    assert not metrics.registry.get_sample_value("kvsidecar_load_failed_blocks_total", failed)
    # Without carried groups the same load reports the attention group's four blocks failed (what it did before).
    out = dp.load(reader.session, LoadArgs(HASHES, latent_only, TOKENS, (TOKENS, TOKENS)))
    assert [f.reason for f in out.failures] == [Reason.NO_BLOCK] * 4
    assert metrics.registry.get_sample_value("kvsidecar_load_failed_blocks_total", failed) == 4


def test_a_lookup_hits_up_to_the_first_missing_block_and_a_failed_probe_is_a_degraded_miss():
    store = MemoryStore()
    dp = path(store)
    writer = filled(store)
    save(dp, writer)
    scheduler = rank(store).session
    out = dp.lookup(scheduler, LookupArgs(HASHES, TOKENS + 1))
    assert (out.hit_tokens, out.degraded, out.detail) == (TOKENS, False, "")
    # The third block gone: a hit never extends past a miss.
    store.remove([keys(writer)[2]])
    assert dp.lookup(scheduler, LookupArgs(HASHES, TOKENS + 1)).hit_tokens == 32
    # A probe the store cannot answer counts as missing, and the answer says it may be short.
    store.fail_keys(StoreCode.RPC_TIMEOUT, [keys(writer)[1]], ["exists"])
    out = dp.lookup(scheduler, LookupArgs(HASHES, TOKENS + 1))
    assert out.hit_tokens == 16 and out.degraded and "existence probes failed" in out.detail


def test_blocks_failing_in_the_store_are_named_with_its_code_and_the_others_go_through():
    store = MemoryStore()
    dp = path(store)
    writer = filled(store)
    store.fail_keys(StoreCode.TRANSFER_FAILED, [keys(writer)[1]], ["put"])
    out = save(dp, writer)
    assert (out.written, out.failures) == (3, (Failure(0, 3, Reason.TRANSFER_FAILED),))
    assert keys(writer)[1] not in store.keys() and len(store.keys()) == 3
    store.set_fault(None)
    assert save(dp, writer).written == 1  # the retry writes only what failed

    store.fail_keys(StoreCode.RPC_FAILED, [keys(writer)[0], keys(writer)[3]], ["get"])
    reader = rank(store)
    assert load(dp, reader) == [Failure(0, 7, Reason.RPC_FAILED), Failure(0, 4, Reason.RPC_FAILED)]
    assert value(reader, 2) == value(writer, 3) and value(reader, 0) == value(writer, 5)
    assert value(reader, 7) == value(rank(store), 7)  # a failed read leaves the block as it was


@pytest.mark.parametrize("checksums", ["off", "all"])
def test_a_store_call_that_fails_whole_fails_each_of_its_blocks_and_is_counted_once(checksums):
    store = MemoryStore()
    registry = CollectorRegistry()
    movers = Movers(store, Metrics(registry), checksums=ChecksumSettings(checksums))
    dp = path(store)
    writer = Rank(MODEL, MODEL.layout(1, checksum_every=movers.checksum_every), store, movers)
    writer.fill(HASHES, WRITER_IDS)

    def down(op: str, key: str) -> None:
        if op != "exists":
            raise StoreUnavailable("master unreachable")

    store.set_fault(down)
    out = save(dp, writer)
    assert out.written == 0 and out.failures == tuple(Failure(0, b, Reason.UNAVAILABLE) for b in WRITER_IDS)
    store.set_fault(None)
    assert save(dp, writer).written == 4
    reader = Rank(MODEL, MODEL.layout(1, checksum_every=movers.checksum_every), store, movers)
    store.set_fault(down)
    assert load(dp, reader) == [Failure(0, b, Reason.UNAVAILABLE) for b in READER_IDS]
    assert all(value(reader, b) == value(rank(store), b) for b in range(8))  # nothing read, nothing written
    for operation in ("put", "get"):
        labels = {"operation": operation, "reason": StoreCode.UNAVAILABLE.value}
        assert registry.get_sample_value("kvsidecar_store_errors_total", labels) == 1


def test_a_load_tries_again_what_the_master_did_not_answer_in_time_within_its_deadline(caplog):
    store = MemoryStore()
    registry = CollectorRegistry()
    quick = RetryPolicy(waits=(0.0, 0.0, 0.0), call_s=1.0)
    dp = DataPath(store, Metrics(registry), retries=quick)
    writer = filled(store)
    save(dp, writer)
    retried = {"operation": "get", "reason": "rpc_timeout"}
    # Two tries of every value time out; the third brings them all, exactly.
    store.fail_next(StoreCode.RPC_TIMEOUT, 8, ["get"])
    reader = rank(store)
    assert (
        dp.load(reader.session, LoadArgs(HASHES, [READER_IDS], TOKENS, (TOKENS,)), time.monotonic() + 60).failures == ()
    )
    assert [value(reader, b) for b in READER_IDS] == [value(writer, b) for b in WRITER_IDS]
    assert registry.get_sample_value("kvsidecar_store_retries_total", retried) == 8
    # Tries run out: what is left is named with its cause, counted by cause, and logged once for the request.
    store.fail_next(StoreCode.RPC_TIMEOUT, 100, ["get"])
    with caplog.at_level(logging.WARNING, logger="kvsidecar"):
        assert {f.reason for f in load(dp, rank(store))} == {Reason.RPC_TIMEOUT}
    assert registry.get_sample_value("kvsidecar_store_retries_total", retried) == 8 + 3 * 4
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith(": 4 of 4 blocks failed (rpc_timeout: 4); the engine recomputes them"), line
    failed = {"group_kind": "full_attention", "reason": "rpc_timeout"}
    assert registry.get_sample_value("kvsidecar_load_failed_blocks_total", failed) == 4
    # A retry that could end past the client's deadline is not started: the engine may reuse its blocks by then.
    store.fail_next(StoreCode.RPC_TIMEOUT, 4, ["get"])
    soon = time.monotonic() + quick.call_s / 2
    assert len(dp.load(rank(store).session, LoadArgs(HASHES, [READER_IDS], TOKENS, (TOKENS,)), soon).failures) == 4
    # Only what may succeed on another try is tried again: not a value that is not there.
    store.fail_next(StoreCode.NOT_FOUND, 1, ["get"])
    assert [f.reason for f in load(dp, rank(store))] == [Reason.NOT_FOUND]
    assert registry.get_sample_value("kvsidecar_store_retries_total", retried) == 8 + 3 * 4


def test_a_retry_waits_as_told_and_never_past_the_deadline():
    policy = RetryPolicy(waits=(0.1, 0.5), call_s=2.0)
    assert policy.wait_before(0, None, 0.0) == 0.1
    assert policy.wait_before(1, 10.0, 7.5) == 0.5  # ends at 10.0 at the latest
    assert policy.wait_before(1, 10.0, 7.6) is None
    assert policy.wait_before(2, None, 0.0) is None  # every retry used


def test_a_tenant_past_its_write_budget_writes_what_fits_in_prompt_order():
    store = MemoryStore()
    budget = WriteBudget(0, 2 * VALUE_BYTES + 1, clock=lambda: 0.0)
    dp = path(store, budget_of=lambda tenant: budget if tenant == "a" else None)
    out = save(dp, filled(store, "a"))
    assert out.written == 2
    assert out.failures == (Failure(0, 5, Reason.TENANT_BUDGET), Failure(0, 6, Reason.TENANT_BUDGET))
    assert save(dp, filled(store, "b")).written == 2  # another tenant's budget is its own (here: none)


def test_a_full_store_is_not_asked_again_until_its_backoff_ends():
    now = [0.0]
    store = MemoryStore(capacity_bytes=VALUE_BYTES)
    dp = path(store, backoff=NoSpaceBackoff(first=1.0, clock=lambda: now[0]))
    writer = filled(store)
    out = save(dp, writer)
    assert out.written == 1 and [f.reason for f in out.failures] == [Reason.NO_SPACE] * 3
    # Room again, but the store is still evicting: within the backoff nothing is tried.
    store.remove(store.keys())
    out = save(dp, writer)
    assert out.written == 0 and [f.block_id for f in out.failures] == WRITER_IDS and not store.keys()
    now[0] = 1.5
    assert save(dp, writer).written == 1  # tried again after it: one fits


def test_a_save_past_its_deadline_writes_nothing():
    store = MemoryStore()
    dp = path(store)
    out = save(dp, filled(store), deadline=time.monotonic() - 1)
    assert out.written == 0 and out.failures == tuple(Failure(0, b, Reason.DEADLINE_EXCEEDED) for b in WRITER_IDS)
    assert store.keys() == []


def test_a_lookup_of_more_hashes_than_the_limit_is_refused_naming_it():
    store = MemoryStore()
    dp = path(store, max_lookup_hashes=3)
    with pytest.raises(BadRequest, match=r"a Lookup of 4 block hashes: at most 3 per call \(--max-lookup-hashes\)"):
        dp.lookup(rank(store).session, LookupArgs(HASHES, TOKENS + 1))
    assert dp.lookup(rank(store).session, LookupArgs(HASHES[:3], 49)).hit_tokens == 0
