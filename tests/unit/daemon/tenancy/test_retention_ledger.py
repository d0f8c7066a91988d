"""The retention ledger on a hand-driven clock: budgets, priorities, whole boundaries, peers' boundaries, renewals,
expiry, hard pins and what undoes them (docs/retention.md)."""

from __future__ import annotations

import pytest

from kvsidecar.store import Pin
from kvsidecar.tenancy.retention import Action, Entry, RetentionLedger, Usage
from kvsidecar.values import RetentionArgs

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ledger(budget: int = 10 * MIB, max_seconds: float = 3600.0) -> tuple[RetentionLedger, Clock]:
    clock = Clock()
    return RetentionLedger(lambda tenant: budget if tenant == "a" else 0, max_seconds=max_seconds, clock=clock), clock


def prompt(n: int, groups: int = 1, size: int = MIB, name: str = "p") -> list[tuple[str, list[tuple[str, int]]]]:
    """n boundaries, each with one value of `size` per group."""
    return [(f"{name}{b}", [(f"{name}{b}@g{g}", size) for g in range(groups)]) for b in range(n)]


def actions(verdicts: list) -> str:
    return "".join({Action.PIN: "P", Action.RENEW: "R", Action.KEPT: "K", Action.OVER: "-"}[v.action] for v in verdicts)


@pytest.mark.parametrize(
    ("boundaries", "groups", "priority", "expected", "retained"),
    [
        (4, 1, 100, "PPPP", 4),
        (12, 1, 100, "PPPPPPPPPP--", 10),  # admission stops at the first boundary past the budget
        (12, 1, 50, "PPPPP-------", 5),  # priority 50 fills half the budget at most
        (12, 1, 0, "------------", 0),  # priority 0: ordinary cache
        (4, 3, 100, "PPPPPPPPP---", 9),  # three groups: a boundary's values together, never 10 of 12
    ],
)
def test_a_request_is_admitted_boundary_by_boundary_within_priority_percent_of_its_budget(
    boundaries: int, groups: int, priority: int, expected: str, retained: int
) -> None:
    led, _ = ledger()
    verdicts = led.admit("a", "ns", prompt(boundaries, groups), RetentionArgs(60, priority))
    assert actions(verdicts) == expected
    assert [v.pin for v in verdicts if v.retained] == [Pin(ttl_ms=60_000)] * retained
    assert led.usage().get("a", Usage()) == Usage(retained * MIB, 0, retained) if retained else led.usage() == {}


def test_a_tenant_without_a_budget_retains_nothing_and_the_times_are_capped():
    led, _ = ledger(max_seconds=30)
    assert actions(led.admit("b", "ns", prompt(2), RetentionArgs(60))) == "--"
    assert led.admit("a", "ns", prompt(1), RetentionArgs(60))[0].pin == Pin(ttl_ms=30_000)
    assert led.ttl_ms(RetentionArgs(0.0004)) == 1  # whole milliseconds, at least one


def test_a_boundary_a_peer_rank_admitted_is_admitted_for_this_rank_over_the_budget():
    led, _ = ledger(budget=4 * MIB)
    # Rank 0 of a TP=2 hybrid: its attention and its own state shard of two boundaries fill the budget.
    assert actions(led.admit("a", "ns", prompt(2, groups=2, name="h"), RetentionArgs(60))) == "PPPP"
    # Rank 1's state shards of the same boundaries follow rank 0's admission, whatever the budget says now.
    rank1 = [(b, [(f"{b}@rank1", MIB)]) for b, _ in prompt(3, name="h")]
    assert actions(led.admit("a", "ns", rank1, RetentionArgs(60))) == "PP-"
    # Another engine's namespace does not ride on it.
    assert actions(led.admit("a", "other", [("h0", [("x@h0", MIB)])], RetentionArgs(60))) == "-"


def test_retained_values_are_kept_renewed_at_most_once_an_eighth_of_their_time_and_expire():
    led, clock = ledger()
    led.admit("a", "ns", prompt(2), RetentionArgs(80))
    assert actions(led.admit("a", "ns", prompt(2), RetentionArgs(80, renew=True))) == "KK"  # pinned just now
    clock.now += 11  # past an eighth of 80 s
    assert actions(led.admit("a", "ns", prompt(2), RetentionArgs(80))) == "KK"  # not asked to renew
    renewed = led.admit("a", "ns", prompt(2), RetentionArgs(80, renew=True))
    assert actions(renewed) == "RR" and renewed[0].previous is not None
    assert led.entry("p0@g0") == Entry("a", MIB, clock.now + 81, False)
    clock.now += 81.5
    assert led.usage() == {} and led.entry("p0@g0") is None
    assert actions(led.admit("a", "ns", prompt(2), RetentionArgs(80))) == "PP"  # ordinary again: pinned afresh


def test_what_the_store_did_not_do_is_restored():
    led, clock = ledger()
    first = led.admit("a", "ns", prompt(2), RetentionArgs(80))
    led.restore(first[1:])
    assert led.usage()["a"] == Usage(MIB, 0, 1)
    clock.now += 20
    renewed = led.admit("a", "ns", prompt(1), RetentionArgs(80, renew=True))
    led.restore(renewed)  # the rewrite failed: the old pin and its deadline stand
    assert led.entry("p0@g0") == Entry("a", MIB, 100 + 81, False)


def test_hard_pins_are_outside_the_budget_never_replaced_by_soft_ones_and_dropped_whole():
    led, clock = ledger(budget=MIB)
    led.admit("a", "ns", prompt(1), RetentionArgs(60))
    hard = led.admit("a", "ns", prompt(3), RetentionArgs(0, hard=True))
    assert actions(hard) == "PPP" and {v.pin for v in hard} == {Pin(hard=True)}
    assert hard[0].previous == Entry("a", MIB, 161, False)  # the soft pin it replaced
    assert led.usage()["a"] == Usage(0, 3 * MIB, 3)
    clock.now += 10_000
    assert actions(led.admit("a", "ns", prompt(3), RetentionArgs(60, renew=True))) == "KKK"
    assert [v.pin for v in led.admit("a", "ns", prompt(1), RetentionArgs(60))] == [Pin(hard=True)]
    dropped = led.drop("a")
    assert sorted(k for k, _ in dropped) == ["p0@g0", "p1@g0", "p2@g0"] and all(e.hard for _, e in dropped)
    assert led.usage() == {}


def test_a_reset_forgets_its_prefix_and_nothing_else():
    led, _ = ledger()
    led.admit("a", "ns", prompt(2, name="kvs1@x@m~"), RetentionArgs(60))
    led.admit("a", "ns", prompt(1, name="kvs1@y@m~"), RetentionArgs(60))
    assert led.forget_prefix("kvs1@x@") == 2
    assert led.usage()["a"] == Usage(MIB, 0, 1)


def test_retention_after_a_spent_budget_keeps_what_is_retained_and_counts_nothing_new():
    led, _ = ledger(budget=2 * MIB)
    led.admit("a", "ns", prompt(2), RetentionArgs(60))
    verdicts = led.admit("a", "ns", prompt(2) + prompt(1, name="q"), RetentionArgs(60))
    assert actions(verdicts) == "KK-"
    with pytest.raises(ValueError, match="max_seconds"):
        RetentionLedger(lambda t: 0, max_seconds=0)
