"""The one batch shape: every item answered on its own, in its order, whichever layer answered it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar_contract.batches import Batch


def odd(n: int) -> None:
    if not n % 2:
        raise ValueError(f"{n} is even")


def test_a_step_that_fails_on_one_item_answers_that_item_alone_and_the_rest_go_on():
    batch: Batch[int, str] = Batch([1, 0, 2, 3])
    halves = batch.step(lambda n: 10 // n)  # 0 cannot be divided by
    halves.settle(lambda n: "small" if n < 4 else None)  # 10 // 3 == 3: answered without going further
    assert halves.open() == [10, 5]
    halves.vet(odd)
    assert halves.open() == [5]
    halves.answer(["five"])
    even, zero, first, small = batch.outcomes()
    assert isinstance(zero, ZeroDivisionError) and isinstance(even, ValueError) and "10 is even" in str(even)
    assert (first, small) == ("five", "small")


def test_one_flat_call_answers_each_item_from_its_span():
    batch: Batch[list[str], list[str]] = Batch([["a", "b"], [], ["c"], ["d", "e", "f"]])
    results = [x.upper() for part in batch.open() for x in part]
    batch.answer_spans(len, lambda part, span: results[span] if part != ["c"] else 1 // 0)
    assert batch.outcomes()[:2] == [["A", "B"], []] and batch.outcomes()[3] == ["D", "E", "F"]
    assert isinstance(batch.outcomes()[2], ZeroDivisionError)


def test_a_call_that_fails_whole_fails_every_open_item_and_a_batch_of_one_raises_its_error():
    batch: Batch[int, int] = Batch([1, 2])
    batch.settle(lambda n: n if n == 1 else None)
    batch.fail(TimeoutError("gone"))
    assert batch.outcomes()[0] == 1 and isinstance(batch.outcomes()[1], TimeoutError)
    with pytest.raises(TimeoutError, match="gone"):
        Batch._of(batch._items[1:]).result()
    with pytest.raises(RuntimeError, match="left unanswered"):
        Batch([1]).outcomes()
    with pytest.raises(ValueError, match="2 outcomes for 1 open items"):
        Batch([1]).answer([1, 2])


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=30), st.integers(1, 6), st.integers(1, 6))
def test_parts_keep_the_order_stay_within_the_limits_and_answer_into_the_batch(costs, most_a, most_b):
    batch: Batch[tuple[int, int], int] = Batch(costs)
    parts = batch.parts(lambda c: c, (most_a, most_b))
    assert [c for part in parts for c in part.open()] == costs
    for part in parts:
        values = part.open()
        assert values  # never an empty part
        over = sum(a for a, _ in values) > most_a or sum(b for _, b in values) > most_b
        assert not over or len(values) == 1  # only an item past the limits alone goes alone
        part.answer([a + b for a, b in values])
    assert batch.outcomes() == [a + b for a, b in costs]
