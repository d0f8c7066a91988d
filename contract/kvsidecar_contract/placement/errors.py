"""Typed errors of the placement rules: every one says what was wrong."""


class PlacementError(ValueError):
    """A layout or a request that the placement rules cannot accept."""


class InvalidLayout(PlacementError):
    """The engine layout (parallelism, heads, groups, names) is inconsistent."""


class InvalidRequest(PlacementError):
    """A save, lookup or load request does not fit its session's layout."""
