"""Many requests in one call, each answered on its own: its result, or its own error.

SaveBatch and LoadBatch carry an engine step's requests in one call, and every layer that handles them (the
client, the daemon's handlers, its data path) holds them in one `Batch`: the items in the order they came, each
still open (holding what the layer works on now) or answered. A step that fails on one item answers that item
alone; a step over every open item (one RPC, one store call) answers each from its share. So a change to how one
item fails is one function per layer, and nothing is matched by position by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Batch"]

T = TypeVar("T")
U = TypeVar("U")
R = TypeVar("R")


class _Item:
    """One item: its value while open, its answer (a result or an error) once answered."""

    __slots__ = ("answered", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.answered = False

    def answer(self, outcome: Any) -> None:
        self.value, self.answered = outcome, True


class Batch(Generic[T, R]):
    """Items in their order, each open (a value of type T) or answered (an R, or the Exception it failed with).

    Batches made by `step` and `parts` share this one's items: answering an item there answers it here.
    """

    __slots__ = ("_items",)

    def __init__(self, values: Iterable[T] = ()) -> None:
        self._items = [_Item(v) for v in values]

    @classmethod
    def _of(cls, items: list[_Item]) -> Batch[Any, Any]:
        batch: Batch[Any, Any] = cls.__new__(cls)
        batch._items = items
        return batch

    def __len__(self) -> int:
        return len(self._items)

    def open(self) -> list[T]:
        """The open items' values, in order."""
        return [item.value for item in self._items if not item.answered]

    def step(self, fn: Callable[[T], U]) -> Batch[U, R]:
        """Each open item's value through fn; an item fn raises for is answered with its error, that item alone."""
        for item in self._open_items():
            try:
                item.value = fn(item.value)
            except Exception as exc:
                item.answer(exc)
        return self._of(self._items)

    def vet(self, check: Callable[[T], object]) -> None:
        """Run check on each open item; one it raises for is answered with its error, the others stay as they are."""
        for item in self._open_items():
            try:
                check(item.value)
            except Exception as exc:
                item.answer(exc)

    def settle(self, fn: Callable[[T], R | None]) -> None:
        """Answer each open item fn has a result for (None: it stays open); one fn raises for, with its error."""
        for item in self._open_items():
            try:
                result = fn(item.value)
            except Exception as exc:
                item.answer(exc)
                continue
            if result is not None:
                item.answer(result)

    def answer(self, outcomes: Sequence[R | Exception]) -> None:
        """One outcome per open item, in order (one call's answers for every item it carried)."""
        items = self._open_items()
        if len(outcomes) != len(items):
            raise ValueError(f"{len(outcomes)} outcomes for {len(items)} open items")
        for item, outcome in zip(items, outcomes, strict=True):
            item.answer(outcome)

    def fail(self, error: Exception) -> None:
        """Every open item answered with error (a call that failed as a whole)."""
        for item in self._open_items():
            item.answer(error)

    def answer_spans(self, size: Callable[[T], int], fn: Callable[[T, slice], R]) -> None:
        """Answer each open item from its span of one list holding size(value) entries per open item, in order
        (one store call's results for all of them): fn(value, its span), or the error fn raises."""
        start = 0
        for item in self._open_items():
            end = start + size(item.value)
            try:
                item.answer(fn(item.value, slice(start, end)))
            except Exception as exc:
                item.answer(exc)
            start = end

    def parts(self, cost: Callable[[T], Sequence[int]], most: Sequence[int]) -> list[Batch[T, R]]:
        """The open items cut, in order, into runs whose costs sum to at most `most`, every one of them (a run
        holds at least one item); each run's answers are this batch's."""
        runs: list[list[_Item]] = []
        run: list[_Item] = []
        total = [0] * len(most)
        for item in self._open_items():
            each = cost(item.value)
            if run and any(t + c > m for t, c, m in zip(total, each, most, strict=True)):
                runs.append(run)
                run, total = [], [0] * len(most)
            run.append(item)
            total = [t + c for t, c in zip(total, each, strict=True)]
        if run:
            runs.append(run)
        return [self._of(r) for r in runs]

    def outcomes(self) -> list[R | Exception]:
        """Every item's answer, in order (every item must be answered by now)."""
        if not all(item.answered for item in self._items):
            raise RuntimeError("an item of the batch was left unanswered")
        return [item.value for item in self._items]

    def result(self) -> R:
        """The one item's result, or raises its error (a request sent alone is a batch of one)."""
        (outcome,) = self.outcomes()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _open_items(self) -> list[_Item]:
        return [item for item in self._items if not item.answered]
