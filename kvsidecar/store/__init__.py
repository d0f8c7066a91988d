"""The store: the only code that touches Mooncake, behind one whole interface (base.Store), with the in-memory
double for unit tests, the one place that knows Mooncake's numbers (codes), what its setup prints (setup_output) and
which of its builds is installed (build).

Imports: errors; mooncake.
"""

from kvsidecar.store.base import Pin, Presence, Store, StoreHealth, StoreUnavailable
from kvsidecar.store.codes import StoreCode

__all__ = ["Pin", "Presence", "Store", "StoreCode", "StoreHealth", "StoreUnavailable"]
