"""Per-account gates: one account's calls beyond its share wait; another account's never wait behind them."""

from __future__ import annotations

import asyncio

from kvsidecar.rpc.gates import AccountGates


def test_an_account_past_its_share_waits_and_another_does_not():
    async def scenario() -> list[str]:
        gates = AccountGates(1)
        order: list[str] = []
        release = asyncio.Event()

        async def call(account: str, name: str, hold: bool) -> None:
            async with gates.hold(account):
                order.append(name)
                if hold:
                    await release.wait()

        first = asyncio.create_task(call("uid 1", "a1", True))
        await asyncio.sleep(0)
        second = asyncio.create_task(call("uid 1", "a2", False))
        other = asyncio.create_task(call("uid 2", "b1", False))
        await other  # not behind uid 1's held slot
        assert order == ["a1", "b1"]
        release.set()
        await asyncio.gather(first, second)
        assert not gates._gates  # nothing kept once no call holds a gate
        return order

    assert asyncio.run(scenario()) == ["a1", "b1", "a2"]
