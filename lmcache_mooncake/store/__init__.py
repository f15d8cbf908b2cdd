"""A shared Mooncake Store tier: an embedded store on loopback and a client for it.

- :mod:`lmcache_mooncake.store.launcher` starts, inspects and stops an embedded
  store (one ``mooncake_master`` with its HTTP metadata server and one
  ``mooncake_client`` storage process that owns the store memory).
- :mod:`lmcache_mooncake.store.client` is the per-process client
  (:class:`StoreClient`) with a timeout on every call and lazy reconnection.

Nothing here imports ``mooncake`` at module import time, so importing this
package is cheap and works where Mooncake is not installed.
"""

from lmcache_mooncake.store.client import StoreClient, describe
from lmcache_mooncake.store.launcher import (
    StoreError,
    StoreSpec,
    StoreState,
    default_state_dir,
    start_store,
    stop_store,
    store_status,
)

__all__ = [
    "StoreClient",
    "StoreError",
    "StoreSpec",
    "StoreState",
    "default_state_dir",
    "describe",
    "start_store",
    "stop_store",
    "store_status",
]
