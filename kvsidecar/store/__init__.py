"""The store: the only code that touches Mooncake, behind one whole interface (base.Store), with the in-memory
double for unit tests and the one place that knows Mooncake's numbers (codes).

Imports: errors; mooncake.
"""

from kvsidecar.store.base import Presence, Store, StoreHealth
from kvsidecar.store.codes import StoreCode

__all__ = ["Presence", "Store", "StoreCode", "StoreHealth"]
