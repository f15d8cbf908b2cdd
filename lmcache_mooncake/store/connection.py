"""The health of a store client's connection, and when and how it tries again.

:class:`Connection` is the state machine behind
:class:`~lmcache_mooncake.store.client.StoreClient`'s "never hang, degrade to
misses, resume when the store is back":

- **healthy**: calls go to Mooncake.
- **unhealthy** (after a timeout, an RPC-class error, a failed setup or probe):
  calls fail at once until :attr:`Connection.next_attempt`; the back-off
  starts at ``retry_interval_s`` and doubles up to ``max_retry_interval_s``.
- **an attempt** (made lazily by the next call once due): every target must
  accept a plain TCP connect (:meth:`Connection.targets_reachable`), then the
  client either probes its Mooncake client or builds a new one
  (:meth:`Connection.wants_rebuild`: no client yet, ``rebuild_after`` failed
  probes, or always in ``shm`` mode).

The client holds its caller lock around everything but the flag updates, which
the worker thread also makes (they take this object's own lock). Mooncake is
never called from here.
"""

from __future__ import annotations

import logging
import threading
import time

from lmcache_mooncake.runtime.procs import can_connect

log = logging.getLogger(__name__)


class Connection:
    """Health, back-off and probe/rebuild decisions of one client (``mode`` "tcp" or "shm").

    ``targets``: the ``(host, port)`` that must accept connections before an attempt
    (:func:`~lmcache_mooncake.store.endpoint.connect_targets`). ``stats``: the client's
    counters; ``reconnects`` is counted here.
    """

    def __init__(self, *, mode: str, targets: list[tuple[str, int]], retry_interval_s: float,
                 max_retry_interval_s: float, rebuild_after: int, stats: dict[str, int]):
        self.mode = mode
        self.targets = targets
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max_retry_interval_s
        self.rebuild_after = rebuild_after
        self._stats = stats
        self._lock = threading.Lock()
        #: True while calls may go to Mooncake (the client also checks that it is not closed).
        self.healthy = False
        #: Why the connection last failed ("" before any failure).
        self.last_error = ""
        #: ``time.monotonic()`` before which no attempt is made (unless forced).
        self.next_attempt = 0.0
        self._backoff = retry_interval_s
        self._probe_failures = 0

    def mark_unhealthy(self, reason: str) -> None:
        """Calls fail at once until the next attempt, one back-off step from now (logged once
        per healthy -> unhealthy change)."""
        with self._lock:
            if self.healthy:
                log.warning(
                    "Mooncake store client unhealthy: %s; calls return misses until it reconnects", reason
                )
                self._backoff = self.retry_interval_s
            self.healthy = False
            self.last_error = reason
            self.next_attempt = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.max_retry_interval_s)

    def mark_healthy(self, how: str) -> None:
        """A setup or probe succeeded: reset the back-off and the failed probes; counts a
        reconnect (and logs it) when the client was unhealthy."""
        with self._lock:
            was = self.healthy
            self.healthy = True
            self._probe_failures = 0
            self._backoff = self.retry_interval_s
        if not was:
            self._stats["reconnects"] += 1
            log.info("Mooncake store client connected (%s, %s mode)", how, self.mode)

    def mark_closed(self) -> None:
        """The client is closing: no longer healthy (nothing logged, nothing scheduled)."""
        self.healthy = False

    def attempt_due(self, now: float, force: bool = False) -> bool:
        """Whether an attempt may be made at ``now`` (``force``: whatever the back-off says)."""
        return force or now >= self.next_attempt

    def targets_reachable(self, deadline: float, now: float) -> bool:
        """Whether every target accepts a TCP connection (each check bounded by 0.5 s and the
        ``deadline``). If one does not: unhealthy, and in ``shm`` mode the next attempt rebuilds."""
        for host, port in self.targets:
            if not can_connect(host, port, max(min(0.5, deadline - now), 0.01)):
                if self.mode == "shm":
                    # The storage process is gone, and with it its mapping of our
                    # shared memory: when it is back, attach anew (a probe would pass).
                    self._probe_failures = self.rebuild_after
                self.mark_unhealthy(f"nothing accepts connections at {host}:{port}")
                return False
        return True

    def wants_rebuild(self, has_store: bool) -> bool:
        """Whether the next attempt builds a new Mooncake client rather than probing the one it has.

        In shm mode a probe cannot tell whether the storage process answering is the one that
        maps our shared memory: restarted within the back-off, it answers, and every put is then
        refused (-600). Attaching again is cheap there (a local RPC and a memfd): always do it."""
        return not has_store or self._probe_failures >= self.rebuild_after or self.mode == "shm"

    def probe_failed(self, reason: str) -> None:
        """A probe of the existing Mooncake client failed: one more toward a rebuild; unhealthy."""
        self._probe_failures += 1
        self.mark_unhealthy(reason)

    def rebuild_next(self) -> None:
        """Make the next attempt build a new Mooncake client (the current one cannot be trusted)."""
        self._probe_failures = self.rebuild_after
