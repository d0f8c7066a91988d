"""The save backoff after a full store, with a fake clock."""

from kvsidecar.datapath.transfers import NoSpaceBackoff


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_no_space_backoff_doubles_and_resets():
    clock = Clock()
    b = NoSpaceBackoff(first=0.25, longest=1.0, clock=clock)
    assert not b.active()
    b.record(full=True)
    assert b.active()
    clock.now += 0.3
    assert not b.active()
    b.record(full=True)  # 0.5 s now
    clock.now += 0.3
    assert b.active()
    b.record(full=True)  # 1.0 s
    b.record(full=True)  # capped at 1.0 s
    clock.now += 0.9
    assert b.active()
    clock.now += 0.2
    assert not b.active()
    b.record(full=False)
    b.record(full=True)  # back to the first delay
    clock.now += 0.3
    assert not b.active()
