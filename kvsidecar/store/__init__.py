"""The store: the only code that touches Mooncake, behind a narrow interface."""

from kvsidecar.store.base import Presence, Store, StoreHealth
from kvsidecar.store.codes import StoreCode, StoreError, StoreUnavailable

__all__ = ["Presence", "Store", "StoreCode", "StoreError", "StoreHealth", "StoreUnavailable"]
