"""How the Mooncake tier finds its store: now, later, or again after a restart.

A store that is missing when vLLM starts is a miss, never a start-up failure,
whether the ``mooncake:`` section names its addresses or says ``auto`` (the
store recorded by ``lmcache-mooncake store up``):

- :class:`StoreAttachment` resolves the endpoint once at start-up and, if it
  resolves, connects as before (bounded by the client's timeouts). If it does
  not resolve (``auto`` and no state file) or the store does not answer, it
  logs **one** warning naming the state file or address and what to do.
- Later calls to :meth:`StoreAttachment.client` never block: before a store
  is known they return None (the tier counts a miss) and, at most once per
  back-off interval (``retry_s`` doubling to ``max_retry_s``), re-read the
  state file. Once it resolves, the client is built on a background thread
  and used from the call after it is ready.
- With ``auto``, a client that is unhealthy while the state file names
  another store (``store up`` again, on new ports) is replaced the same way.
  With explicit addresses the client reconnects by itself
  (:class:`~lmcache_mooncake.store.client.StoreClient`).

Counters: :meth:`StoreAttachment.stats` gives the current client's counters,
summed with those of clients it replaced, plus ``attach_*`` counters of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from lmcache_mooncake.config import MooncakeConfig
from lmcache_mooncake.runtime import affinity
from lmcache_mooncake.store.client import StoreClient, StoreEndpoint
from lmcache_mooncake.store.errors import StoreError

logger = logging.getLogger(__name__)

ClientFactory = Callable[[StoreEndpoint], StoreClient]


def describe_endpoint(endpoint: StoreEndpoint) -> str:
    if endpoint.mode == "shm":
        return f"storage process {endpoint.client_addr} (shm mode)"
    return f"master {endpoint.master_addr}, metadata {endpoint.metadata_url} (tcp mode)"


class StoreAttachment:
    """The tier's :class:`StoreClient`, attached when a store exists; see the module docstring."""

    def __init__(
        self,
        config: MooncakeConfig,
        resolve: Callable[[], StoreEndpoint],
        factory: ClientFactory,
        *,
        retry_s: float = 0.5,
        max_retry_s: float = 5.0,
    ):
        self.config = config
        self._resolve = resolve
        self._factory = factory
        self._auto = config.master_address == "auto" or config.metadata_server == "auto"
        self._retry_s = float(retry_s)
        self._max_retry_s = float(max(max_retry_s, retry_s))
        self._lock = threading.Lock()
        self._client: StoreClient | None = None
        self._endpoint: StoreEndpoint | None = None
        self._building = False
        self._closed = False
        self._backoff = self._retry_s
        self._next_check = 0.0
        self._retired: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._warned = False
        endpoint = self._try_resolve()
        if endpoint is not None:
            self._install(endpoint, factory(endpoint))
            if not self._client.healthy:  # type: ignore[union-attr]
                self._warn(
                    f"the Mooncake store at {describe_endpoint(endpoint)} does not answer "
                    f"({self._client.stats().get('last_error') or 'no reason given'})"  # type: ignore[union-attr]
                )
        self._schedule_check()

    # -- what the tier calls ---------------------------------------------------
    def client(self) -> StoreClient | None:
        """The client to use now, or None (no store yet: a miss). Never blocks."""
        with self._lock:
            client = self._client
            due = not self._closed and not self._building and time.monotonic() >= self._next_check
            if due and client is not None and (client.healthy or not self._auto):
                due = False  # healthy, or reconnecting by itself to fixed addresses
            if due:
                self._schedule_check_locked()
        if due:
            self._check()
        return client

    @property
    def endpoint(self) -> StoreEndpoint | None:
        return self._endpoint

    def stats(self) -> dict[str, Any]:
        """Client counters (summed over replaced clients) and ``attach_*`` counters."""
        with self._lock:
            client = self._client
            out: Counter[str] = Counter(self._retired)
            own = dict(self._counts)
        if client is not None:
            for name, value in client.stats().items():
                if isinstance(value, int) and not isinstance(value, bool):
                    out[name] += value
        data: dict[str, Any] = dict(out)
        data.update({f"attach_{k}": v for k, v in own.items()})
        data["attached"] = int(client is not None)
        return data

    def close(self) -> None:
        """Detach; the counters keep what the client counted (the last dump shows them)."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            if client is not None:
                self._retire(client)
        if client is not None:
            client.close()

    def _retire(self, client: StoreClient) -> None:
        for name, value in client.stats().items():
            if isinstance(value, int) and not isinstance(value, bool):
                self._retired[name] += value

    # -- internals ---------------------------------------------------------------
    def _warn(self, what: str, todo: str | None = None) -> None:
        if self._warned:
            return
        self._warned = True
        if todo is None and self._auto:
            todo = ("Check it with 'lmcache-mooncake store status' or start it with 'lmcache-mooncake store up'; "
                    "this instance re-reads the state file and attaches by itself")
        elif todo is None:
            todo = ("Start the store or fix mooncake.master_address / mooncake.metadata_server; "
                    "this instance reconnects by itself")
        logger.warning("Mooncake tier: %s. Until then chunks are neither loaded from nor saved to the store "
                       "(requests are computed, never wrong). %s.", what.rstrip("."), todo.rstrip("."))

    def _try_resolve(self) -> StoreEndpoint | None:
        self._counts["resolves"] += 1
        try:
            return self._resolve()
        except StoreError as e:
            self._warn(str(e), "This instance attaches by itself once a store is recorded there")
            return None

    def _schedule_check(self) -> None:
        with self._lock:
            self._schedule_check_locked()

    def _schedule_check_locked(self) -> None:
        self._next_check = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._max_retry_s)

    def _check(self) -> None:
        endpoint = self._try_resolve()
        if endpoint is None or endpoint == self._endpoint:
            return
        with self._lock:
            if self._building or self._closed:
                return
            self._building = True
        threading.Thread(target=self._build, args=(endpoint,), name="lmcm-store-attach", daemon=True).start()

    def _build(self, endpoint: StoreEndpoint) -> None:
        affinity.widen_current_thread("lmcm-store-attach")
        client: StoreClient | None = None
        try:
            client = self._factory(endpoint)
        except Exception as e:  # a bad state file or binding: try again later
            logger.warning("Mooncake tier: attaching to %s failed (%s); retrying", describe_endpoint(endpoint), e)
            self._counts["failures"] += 1
        with self._lock:
            self._building = False
            closed = self._closed
        if client is None:
            return
        if closed:
            client.close()
            return
        old = self._install(endpoint, client)
        if old is not None:
            old.close()
        logger.info("Mooncake tier: attached to the store at %s (connected: %s)",
                       describe_endpoint(endpoint), client.healthy)

    def _install(self, endpoint: StoreEndpoint, client: StoreClient) -> StoreClient | None:
        with self._lock:
            old = self._client
            if old is not None:
                self._retire(old)
            self._client, self._endpoint = client, endpoint
            self._counts["attached_clients"] += 1
            self._backoff = self._retry_s
        return old
