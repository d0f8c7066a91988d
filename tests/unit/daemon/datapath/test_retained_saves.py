"""Retention carried out by the data path over the in-memory store: pins at the put, stored values pinned in the
background, budgets that turn a save into ordinary cache and say so, hybrids kept whole, hits that retain what they
read, hard pins for operators only, drops and resets (docs/retention.md)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from kvsidecar.datapath.retention import Dropped, Retainer
from kvsidecar.datapath.transfers import DataPath
from kvsidecar.errors import Forbidden
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.movers.trailer import TRAILER_BYTES, ChecksumSettings
from kvsidecar.sessions.session import Session
from kvsidecar.store import Pin, StoreCode
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.retention import RetentionLedger, Usage
from kvsidecar.values import LoadArgs, RetentionArgs, SaveArgs
from kvsidecar_contract.placement import save_plan
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.states import Mamba2
from support.stateranks import Attention, Model, Rank

ATTENTION = Model((Attention(),), kv_heads=2, layers=1)
HASHES = chained_hashes("system prompt", 4)
IDS = [1, 3, 5, 6]
VALUE = 2 * 256  # one block's K and V
KEEP = RetentionArgs(300)


def operators_only(session: Session) -> None:
    if session.tenant != "ops":
        raise Forbidden("no operator")


def setup(budget: int = 1 << 20, model: Model = ATTENTION) -> tuple[DataPath, MemoryStore, Rank, Metrics]:
    store = MemoryStore()
    metrics = Metrics(CollectorRegistry())
    ledger = RetentionLedger(lambda tenant: budget, max_seconds=3600)
    dp = DataPath(store, metrics, retention=Retainer(store, ledger, metrics, operators_only))
    r = Rank(model, model.layout(1), store)
    r.fill(HASHES, IDS)
    return dp, store, r, metrics


def keys(r: Rank) -> list[str]:
    return [c.key for c in save_plan(r.session.geometry, HASHES, [IDS] * len(r.model.groups), 64, 0).chunks]


def save(dp: DataPath, r: Rank, retention: RetentionArgs | None = KEEP, tokens: int = 64):
    ids = [IDS] * len(r.model.groups)
    return dp.save(r.session, SaveArgs(HASHES, ids, tokens, retention=retention))


def count(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("kvsidecar_retention_values_total", {"outcome": outcome}) or 0.0


def test_a_retained_save_writes_its_values_pinned_and_says_so():
    dp, store, r, metrics = setup()
    out = save(dp, r)
    assert (out.written, out.retained, out.unretained) == (4, 4, 0)
    assert [store.pin_of(k) for k in keys(r)] == [Pin(ttl_ms=300_000)] * 4
    assert dp.retention.usage() == {"": Usage(4 * VALUE, 0, 4)}
    assert metrics.registry.get_sample_value("kvsidecar_tenant_retained_bytes", {"tenant": "", "pin": "soft"}) == (
        4 * VALUE
    )
    # An ordinary save beside it writes ordinary values.
    other = Rank(ATTENTION, ATTENTION.layout(1, cache_prefix="other"), store)
    other.fill(HASHES, IDS)
    out = save(dp, other, retention=None)
    assert (out.written, out.retained) == (4, 0) and all(store.pin_of(k) is None for k in keys(other))


def test_past_the_budget_a_save_is_ordinary_cache_from_the_first_boundary_that_does_not_fit_never_refused():
    dp, store, r, metrics = setup(budget=2 * VALUE + 10)
    out = save(dp, r)
    assert (out.written, out.failures, out.retained, out.unretained) == (4, (), 2, 2)
    assert [store.pin_of(k) is not None for k in keys(r)] == [True, True, False, False]
    assert count(metrics, "over") == 2
    # A request that matters less may fill less of it: half the budget holds one boundary.
    dp, store, r, _ = setup(budget=2 * VALUE + 10)
    assert save(dp, r, RetentionArgs(300, priority=50)).retained == 1


def test_a_prefix_stored_before_is_pinned_in_the_background_and_renewed_when_asked():
    dp, store, r, metrics = setup()
    assert save(dp, r, retention=None).written == 4
    out = save(dp, r)  # the same prefix again, now asking for retention: found stored, pinned from the store
    assert (out.written, out.skipped, out.retained) == (0, 4, 4)
    assert dp.retention.flush(10.0)
    assert [store.pin_of(k) for k in keys(r)] == [Pin(ttl_ms=300_000)] * 4
    assert count(metrics, "pin") == 4
    save(dp, r, RetentionArgs(300, renew=True))  # pinned just now: renewing it again would be a waste
    assert count(metrics, "kept") == 4 and count(metrics, "renew") == 0


def test_a_stored_value_the_store_cannot_pin_is_not_counted():
    dp, store, r, metrics = setup()
    save(dp, r, retention=None)
    store.fail_keys(StoreCode.TRANSFER_FAILED, keys(r)[:1], ["pin"])
    save(dp, r)
    assert dp.retention.flush(10.0)
    assert dp.retention.usage()[""] == Usage(3 * VALUE, 0, 3)
    assert count(metrics, "failed") == 1


def test_a_hybrids_state_and_attention_are_retained_together_or_not_at_all():
    hybrid = Model((Attention(), Mamba2(num_heads=2, head_dim=2, n_groups=1, state_size=2)), kv_heads=2, layers=1)
    dp, store, r, _ = setup(model=hybrid)
    sizes = [len(r.content(g, 0, w, "0")) for g, w in ((0, "k"), (0, "v"), (1, "state"))]
    per_boundary = sizes[0] + sizes[1] + sizes[2]
    # Room for two boundaries and the third one's attention, but not its state.
    dp, store, r, _ = setup(budget=2 * per_boundary + sizes[0] + sizes[1], model=hybrid)
    out = save(dp, r)
    chunks = save_plan(r.session.geometry, HASHES, [IDS, IDS], 64, 0).chunks
    pinned = {(c.group, c.boundary) for c in chunks if store.pin_of(c.key) is not None}
    assert pinned == {(0, 16), (1, 16), (0, 32), (1, 32)}  # two whole boundaries; not the third's attention alone
    assert (out.retained, out.unretained) == (4, 4)


def test_a_hit_retains_what_it_read():
    dp, store, r, _ = setup()
    save(dp, r, retention=None)
    reader = Rank(ATTENTION, ATTENTION.layout(1), store)
    out = dp.load(reader.session, LoadArgs(HASHES, [[7, 2, 0, 4]], 48, (48,), retention=RetentionArgs(60)))
    assert (out.loaded, out.retained) == (3, 3)
    assert dp.retention.flush(10.0)
    assert [store.pin_of(k) for k in keys(r)] == [Pin(ttl_ms=60_000)] * 3 + [None]


def test_values_with_a_checksum_trailer_are_retained_and_dropped_whole():
    # A pin rewrites a stored value whole: one that carries a trailer (--checksums) is that much larger than its
    # blocks, and a pin sized by the blocks alone fails (SIZE_MISMATCH), leaving it ordinary cache.
    store = MemoryStore()
    metrics = Metrics(CollectorRegistry())
    ledger = RetentionLedger(lambda tenant: 1 << 20, max_seconds=3600)
    dp = DataPath(store, metrics, retention=Retainer(store, ledger, metrics, operators_only, checksum_every=1))
    every = Movers(store, metrics, checksums=ChecksumSettings("all"))
    writer = Rank(ATTENTION, dataclasses.replace(ATTENTION.layout(1), checksum_every=1), store, every)
    writer.fill(HASHES, IDS)
    save(dp, writer, retention=None)
    assert all(len(store.value(k)) == VALUE + TRAILER_BYTES for k in keys(writer))
    reader = Rank(ATTENTION, dataclasses.replace(ATTENTION.layout(1), checksum_every=1), store, every)
    out = dp.load(reader.session, LoadArgs(HASHES, [[7, 2, 0, 4]], 48, (48,), retention=RetentionArgs(60)))
    assert (out.loaded, out.retained) == (3, 3)
    assert dp.retention.flush(10.0)
    assert [store.pin_of(k) for k in keys(writer)] == [Pin(ttl_ms=60_000)] * 3 + [None]
    assert count(metrics, "failed") == 0
    assert dp.retention.drop("") == Dropped(3, 3 * VALUE, 0)  # budgets count the values' own bytes
    assert all(store.pin_of(k) is None for k in keys(writer))


def test_hard_pins_are_for_operators_and_an_operator_drops_a_tenants_retentions_keeping_the_bytes():
    dp, store, r, _ = setup()
    with pytest.raises(Forbidden):
        save(dp, r, RetentionArgs(0, hard=True))
    assert store.keys() == []  # refused before anything was written
    r.session.tenant = "ops"
    assert save(dp, r, RetentionArgs(0, hard=True)).retained == 4
    assert {store.pin_of(k) for k in keys(r)} == {Pin(hard=True)}
    assert dp.retention.usage() == {"ops": Usage(0, 4 * VALUE, 4)}
    assert dp.retention.drop("ops") == Dropped(4, 4 * VALUE, 0)
    assert {store.pin_of(k) for k in keys(r)} == {None} and len(store.keys()) == 4
    assert dp.retention.usage() == {}


def test_a_reset_stops_counting_what_it_removed():
    dp, store, r, _ = setup()
    save(dp, r)
    dp.reset(r.session)
    assert dp.retention.usage() == {} and store.keys() == []


def test_values_covered_by_the_request_alone_are_retained():
    dp, store, r, _ = setup()
    out = save(dp, r, RetentionArgs(300, end_tokens=32))  # a system prompt of the first 32 tokens
    assert (out.retained, out.unretained) == (2, 0)
    assert [store.pin_of(k) is not None for k in keys(r)] == [True, True, False, False]


def test_the_device_path_pins_at_the_put_as_the_host_path_does():
    # The GPU path (the CPU standing in for the GPU) writes through its staging area; its puts carry the pin.
    from support.devicepath import hashes, rank

    store = MemoryStore()
    metrics = Metrics(CollectorRegistry())
    ledger = RetentionLedger(lambda tenant: 1 << 20, max_seconds=3600)
    with rank(store) as r:
        r.fill(3)
        dp = DataPath(store, metrics, retention=Retainer(store, ledger, metrics))
        h = hashes("retained", 4)
        out = dp.save(r.session, SaveArgs(h, [IDS], 64, retention=KEEP))
        assert (out.written, out.retained) == (4, 4)
        assert dp.retention.flush(10.0)
        assert sorted(store.pin_of(k) for k in store.keys()) == [Pin(ttl_ms=300_000)] * 4
