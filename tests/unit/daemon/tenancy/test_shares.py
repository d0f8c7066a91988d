"""Fair shares: one account using up its share leaves the rest of the daemon's bound to the others."""

from __future__ import annotations

import pytest

from kvsidecar.errors import Exhausted
from kvsidecar.tenancy.shares import Shares, account_of
from kvsidecar.tenancy.tickets import MAX_TICKETS_PER_UID, PeerCred, Tickets


def test_an_account_is_its_tenant_else_its_uid():
    assert account_of("alpha", 1001) == "tenant alpha"
    assert account_of("", 1001) == "uid 1001"
    assert account_of("", None, "CN=x") == "certificate CN=x"
    assert account_of("", None) == "tcp"


def test_the_per_account_and_the_daemon_wide_caps_are_named():
    shares = Shares("open sessions", 2, 3, per_account_setting="--per", total_setting="--all")
    shares.take("uid 1", 2)
    with pytest.raises(Exhausted, match=r"uid 1 holds 2 and asks for 1 more, past its share of 2 \(--per\)"):
        shares.take("uid 1", 1)
    shares.take("uid 2", 1)
    with pytest.raises(Exhausted, match=r"past the daemon-wide cap of 3 \(--all\)"):
        shares.take("uid 3", 1)
    shares.give("uid 1", 2)
    shares.take("uid 3", 1)
    assert shares.held() == 2 and shares.held("uid 1") == 0
    with pytest.raises(Exhausted, match=r"past its share of 0 \(tenants file\)"):
        shares.take("tenant a", 1, limit=0, limit_setting="tenants file")


def test_one_uid_minting_tickets_cannot_use_up_another_uids():
    tickets = Tickets()
    greedy, other = PeerCred(1, 1001, 1001, frozenset()), PeerCred(2, 1002, 1002, frozenset())
    minted = [tickets.issue(greedy) for _ in range(MAX_TICKETS_PER_UID)]
    with pytest.raises(Exhausted, match="uid 1001 has 256 outstanding"):
        tickets.issue(greedy)
    assert tickets.redeem(tickets.issue(other)) == other
    assert tickets.redeem(minted[0]) == greedy
    tickets.issue(greedy)  # a redeemed ticket gives its place back
