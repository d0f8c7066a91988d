"""Per-account gates: one account's calls beyond its share wait; another account's never wait behind them; gRPC
calls (on the event loop) and data-socket calls (on their own threads) draw on the same slots."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvsidecar.errors import TooLate
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
        assert gates.held() == {}  # nothing kept once no call holds a gate
        return order

    assert asyncio.run(scenario()) == ["a1", "b1", "a2"]


def test_a_thread_past_its_share_waits_for_the_slot_a_grpc_call_gives_back():
    gates = AccountGates(1, total=4)
    order: list[str] = []
    waiting = threading.Event()

    async def grpc_call() -> None:
        async with gates.hold("uid 1"):
            order.append("grpc")
            thread.start()
            await asyncio.to_thread(waiting.wait, 10)
            await asyncio.sleep(0.05)  # the thread is blocked on the gate, not merely started
            assert order == ["grpc"] and gates.held() == {"uid 1": 1}
        order.append("grpc done")

    def data_socket_call() -> None:
        waiting.set()
        with gates.hold_blocking("uid 1", timeout=10):
            order.append("data socket")

    thread = threading.Thread(target=data_socket_call)
    asyncio.run(grpc_call())
    thread.join(10)
    assert order == ["grpc", "grpc done", "data socket"]
    assert gates.held() == {}


def test_a_grpc_call_waits_on_the_loop_for_the_slot_a_thread_gives_back():
    gates = AccountGates(1)
    holding, release = threading.Event(), threading.Event()

    def data_socket_call() -> None:
        with gates.hold_blocking("uid 1", timeout=None):
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=data_socket_call)
    thread.start()
    assert holding.wait(10)

    async def scenario() -> list[str]:
        order = []

        async def grpc_call() -> None:
            async with gates.hold("uid 1"):
                order.append("grpc")

        task = asyncio.create_task(grpc_call())
        await asyncio.sleep(0.05)
        order.append("still waiting")  # the loop is free meanwhile
        release.set()
        await asyncio.wait_for(task, 10)
        return order

    assert asyncio.run(scenario()) == ["still waiting", "grpc"]
    thread.join(10)
    assert gates.held() == {}


def test_the_bound_in_all_holds_across_accounts_and_a_wait_past_the_deadline_is_refused():
    gates = AccountGates(2, total=2)
    with gates.hold_blocking("uid 1", None), gates.hold_blocking("uid 2", None):
        assert gates.held() == {"uid 1": 1, "uid 2": 1}
        late = "no lookup slot within the call's deadline: at most 2 lookups per account"
        with pytest.raises(TooLate, match=late), gates.hold_blocking("uid 3", timeout=0.05):
            pass
    assert gates.held() == {}
    with gates.hold_blocking("uid 3", timeout=0.05):  # once given back, the slots serve again
        assert gates.held() == {"uid 3": 1}


def test_a_cancelled_waiter_takes_no_slot():
    gates = AccountGates(1)

    async def scenario() -> None:
        release = asyncio.Event()

        async def holder() -> None:
            async with gates.hold("uid 1"):
                await release.wait()

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        waiter.cancel()  # its client gave up
        release.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())
    assert gates.held() == {}
