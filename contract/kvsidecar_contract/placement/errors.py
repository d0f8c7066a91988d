"""Typed errors of the placement rules: every one says what was wrong."""


class PlacementError(ValueError):
    """A layout or a request that the placement rules cannot accept."""


class InvalidLayout(PlacementError):
    """The engine layout (parallelism, heads, groups, names) is inconsistent."""


class RequestMismatch(PlacementError):
    """A save, lookup or load request does not fit its session's layout (the client's InvalidRequest is what either
    side's refusal of a request becomes for the engine)."""
