"""A thin, never-hanging client to the Mooncake Store for one process.

:class:`StoreClient` wraps one ``mooncake.store.MooncakeDistributedStore``:

- It attaches **without contributing store memory** (``global_segment_size=0``
  unless ``global_segment_bytes`` is given): objects are kept by the store's
  storage process (see :mod:`lmcache_mooncake.store.launcher`), so they
  survive this process.
- Data moves through one **registered staging region** (registered once at
  connect, reused by every call). ``batch_put`` copies the caller's buffers into
  it and the store reads them from there without a further copy;
  ``batch_get_into`` has the store write into it and copies the bytes read into
  the caller's buffers. The one copy is deliberate: a call that times out keeps
  running inside Mooncake, and it must never touch memory the caller got back.
- **Direct gets** (``tcp`` mode, :mod:`lmcache_mooncake.store.direct`) skip
  that copy for a caller that registers long-lived memory
  (:meth:`StoreClient.register_destination`) and gives up for good the
  destinations of a call that timed out (:meth:`StoreClient.batch_get_split`).
- **Every call has a timeout.** The blocking Mooncake call runs on the
  client's own worker thread; the caller waits at most ``timeout_s`` and then
  gets failures (misses), never an exception and never a hang. After a timeout
  or an RPC-class error (``-900``/``-901``) the client is *unhealthy*: calls
  fail at once with :data:`ERR_UNAVAILABLE` until the next reconnection
  attempt, which is made lazily by a later call after ``retry_interval_s``
  (doubling up to ``max_retry_interval_s``). An attempt first checks with a
  plain TCP connect (bounded, 0.5 s) that the master (``tcp`` mode) or the
  storage process (``shm`` mode) accepts connections, then probes the existing
  Mooncake client (Mooncake reconnects to a restarted master by itself) and,
  after ``rebuild_after`` failed probes, builds a new one; in ``shm`` mode it
  always attaches anew (a storage process restarted behind the same port
  answers a probe but no longer maps our shared memory). So "master down"
  degrades to misses and "master back" resumes, in the same process.

Modes:

- ``mode="tcp"``: the regular Mooncake client (transfer engine, ``protocol``
  "tcp" or "rdma"); works across hosts. It opens two listening ports on all
  interfaces (Mooncake's transfer engine), whatever address is configured.
- ``mode="shm"``: Mooncake's "dummy" client, attached to the storage process
  on the same host (``client_addr``, the storage process's RPC port). The
  staging region is shared memory (a memfd the storage process maps), so data
  is copied by the storage process straight between its segment and our
  staging region, with no TCP. Same host only; opens no listening port.

Return values (all lists are index-aligned with ``keys``):

- :meth:`StoreClient.batch_exists` -> ``list[bool]``: True only if the master
  confirmed the key exists. Errors, timeouts and an unhealthy client give False.
- :meth:`StoreClient.batch_put` -> ``list[int]``: ``0`` stored (also when the
  key already existed: Mooncake keeps the first value, which is right for
  content-hashed keys); negative: not stored. Mooncake codes are passed through
  (e.g. ``-200`` NO_AVAILABLE_HANDLE: store full, ``-900`` RPC_FAIL), plus this
  module's ``ERR_*`` codes.
- :meth:`StoreClient.batch_remove` -> ``list[int]``: ``0`` removed, ``-704``
  missing, ``-706`` leased by a recent read; other negative values: failure.
- :meth:`StoreClient.batch_get_into` -> ``list[int]``: ``>= 0`` the number of
  bytes read into the caller's buffer (the object's size); ``-704``
  (:data:`NOT_FOUND`) missing; ``-600`` buffer smaller than the object; other
  negative values: failure, the buffer's content is then unspecified.

Use :func:`describe` to turn a code into a name.

The parts, one job each: :mod:`~lmcache_mooncake.store.settings` (the
constructor's arguments, checked), :mod:`~lmcache_mooncake.store.endpoint`
(addresses), :mod:`~lmcache_mooncake.store.connection` (health, back-off,
probe or rebuild), :mod:`~lmcache_mooncake.store.staging_memory` (the
registered region), :mod:`~lmcache_mooncake.store.staging` and
:mod:`~lmcache_mooncake.store.direct` (the transfers), and
:mod:`~lmcache_mooncake.store.calls` (the worker thread and its deadlines).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmcache_mooncake.store.binaries import missing_library_hint
from lmcache_mooncake.store.calls import _ABANDONED, _Job, _Sized, _Worker
from lmcache_mooncake.store.codes import (  # noqa: F401 - the client's return codes, re-exported
    _CONNECTION_CODES,
    ERR_BAD_BUFFER,
    ERR_CLOSED,
    ERR_INTERNAL,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    ERR_UNAVAILABLE,
    INVALID_PARAMS,
    NOT_FOUND,
    OK,
    RPC_FAIL,
    RPC_TIMEOUT,
    describe,
)
from lmcache_mooncake.store.connection import Connection
from lmcache_mooncake.store.direct import DirectGets
from lmcache_mooncake.store.endpoint import StoreEndpoint, connect_targets, is_loopback, local_hostname_for
from lmcache_mooncake.store.errors import StoreError
from lmcache_mooncake.store.settings import PINS, ClientSettings, MiB  # noqa: F401 - PINS re-exported
from lmcache_mooncake.store.staging import StagedTransfers
from lmcache_mooncake.store.staging_memory import StagingMemory
from lmcache_mooncake.store.state import read_state

log = logging.getLogger(__name__)

_PROBE_KEY = "__lmcache_mooncake_probe__"

#: Counters of :meth:`StoreClient.stats`.
_STAT_NAMES = (
    "exists_calls",
    "put_calls",
    "get_calls",
    "direct_get_calls",
    "puts_ok",
    "puts_failed",
    "gets_hit",
    "gets_missed",
    "gets_failed",
    "bytes_put",
    "bytes_got",
    "timeouts",
    "unavailable",
    "connection_errors",
    "reconnects",
    "rebuilds",
)


class StoreClient(StagedTransfers, DirectGets):
    """Client to a Mooncake Store for one process. Thread-safe; calls are serialised.

    Build it with :meth:`connect` or :meth:`from_state`.
    """

    def __init__(self, settings: ClientSettings | None = None, **kwargs: Any):
        """``settings``, or the fields of :class:`~lmcache_mooncake.store.settings.ClientSettings`
        as keyword arguments (checked there: StoreError for a wrong value). Does not connect."""
        if settings is None:
            settings = ClientSettings(**kwargs)
        elif kwargs:
            raise TypeError(f"give settings or keyword arguments, not both ({', '.join(kwargs)})")
        self.settings = s = settings
        self.mode = s.mode
        self.master_addr = s.master_addr
        self.metadata_url = s.metadata_url
        self.client_addr = s.client_addr
        self.protocol = s.protocol
        self.rdma_devices = s.rdma_devices
        self.local_buffer_bytes = s.local_buffer_bytes
        self.timeout_s = s.timeout_s
        self.global_segment_bytes = s.global_segment_bytes
        self.retry_interval_s = s.retry_interval_s
        self.max_retry_interval_s = s.max_retry_interval_s
        self.rebuild_after = s.rebuild_after
        self.replica_num = s.replica_num
        #: How puts protect their objects from eviction: "none", "soft" (evicted
        #: only after every unpinned object, for ``pin_ttl_s``) or "hard" (never).
        self.pin = s.pin
        self.pin_ttl_s = s.pin_ttl_s
        self._replicate: Any = None
        targets = connect_targets(s.mode, s.master_addr, s.metadata_url, s.client_addr)
        self.local_hostname = local_hostname_for(s.mode, targets[0][0], s.local_hostname)
        if s.mode == "tcp" and is_loopback(targets[0][0]) and "MC_TCP_BIND_ADDRESS" not in os.environ:
            # Without it Mooncake's transfer engine looks for a LAN address and
            # fails on hosts without one ("not valid LAN address found").
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"

        self._lock = threading.Lock()  # serialises callers
        self._worker = _Worker(f"mooncake-store-{s.mode}")
        self._store: Any = None
        self._staging = StagingMemory(s.local_buffer_bytes, s.mode)
        # Caller memory direct gets may write (register_destination), the Mooncake
        # client it is registered with, and why Mooncake refused it (if it did).
        self._destinations: list[tuple[int, int]] = []
        self._destinations_on: Any = None
        self._register_error: str | None = None
        self._closed = False
        self._stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
        self._conn = Connection(
            mode=s.mode, targets=targets, retry_interval_s=s.retry_interval_s,
            max_retry_interval_s=s.max_retry_interval_s, rebuild_after=s.rebuild_after, stats=self._stats,
        )

    # ------------------------------------------------------------------ build

    @classmethod
    def connect(
        cls,
        master_addr: str = "",
        metadata_url: str = "",
        protocol: str = "tcp",
        rdma_devices: str = "",
        local_buffer_bytes: int = 256 * MiB,
        timeout_s: float = 2.0,
        *,
        mode: str = "tcp",
        client_addr: str = "",
        connect_timeout_s: float = 15.0,
        require: bool = True,
        **kwargs: Any,
    ) -> StoreClient:
        """Attach to a running store.

        ``master_addr`` ("127.0.0.1:P") and ``metadata_url``
        ("http://127.0.0.1:H/metadata") are needed in ``tcp`` mode;
        ``client_addr`` (storage process "127.0.0.1:C") in ``shm`` mode.
        ``local_buffer_bytes`` is the staging region (the largest batch moved in
        one Mooncake call; larger batches are split, a larger single object
        fails with :data:`ERR_TOO_LARGE`). With ``require=True`` a failed first
        connection raises :class:`StoreError`; with ``require=False`` the client
        is returned unhealthy and connects lazily on a later call (what a
        serving process wants). Other keyword arguments go to the constructor.
        """
        self = cls(
            master_addr=master_addr,
            metadata_url=metadata_url,
            mode=mode,
            client_addr=client_addr,
            protocol=protocol,
            rdma_devices=rdma_devices,
            local_buffer_bytes=local_buffer_bytes,
            timeout_s=timeout_s,
            **kwargs,
        )
        _import_store()  # a missing library is an error at once, whatever `require` says
        with self._lock:
            deadline = time.monotonic() + max(connect_timeout_s, timeout_s)
            code = self._attempt(deadline, force=True)
        if code != OK and require:
            reason = self._conn.last_error
            self.close()
            where = self.master_addr if self.mode == "tcp" else self.client_addr
            raise StoreError(
                f"cannot connect to the Mooncake store at {where} ({self.mode} mode): {reason}. "
                "Is it running? Check with: lmcache-mooncake store status"
            )
        return self

    @classmethod
    def from_config(cls, mc: Any, endpoint: StoreEndpoint, **overrides: Any) -> StoreClient:
        """:meth:`connect` with the settings of a ``mooncake:`` section (a
        :class:`~lmcache_mooncake.config.MooncakeConfig`) at ``endpoint``.

        ``overrides``: any :meth:`connect` / constructor argument, e.g.
        ``require=False`` for a serving process, ``local_buffer_bytes`` for a
        tool that moves little data.
        """
        args: dict[str, Any] = dict(
            protocol=mc.protocol, rdma_devices=mc.rdma_devices, local_buffer_bytes=int(mc.local_buffer_size),
            timeout_s=float(mc.timeout), mode=endpoint.mode, client_addr=endpoint.client_addr,
            global_segment_bytes=int(mc.global_segment_size), local_hostname=mc.local_hostname,
            replica_num=int(mc.replica_num), connect_timeout_s=max(float(mc.timeout), 5.0),
            pin=mc.pin, pin_ttl_s=float(mc.pin_ttl),
        )
        args.update(overrides)
        return cls.connect(endpoint.master_addr, endpoint.metadata_url, **args)

    @classmethod
    def from_state(cls, state_dir: Path | str | None = None, mode: str = "tcp", **kwargs: Any) -> StoreClient:
        """:meth:`connect` to the store recorded by the launcher in ``state_dir``."""
        st = read_state(state_dir)
        if st is None:
            raise StoreError(
                f"no store recorded in {state_dir or 'the default state dir'}; "
                "start one with: lmcache-mooncake store up"
            )
        return cls.connect(st.master_addr, st.metadata_url, mode=mode, client_addr=st.client_addr, **kwargs)

    # ------------------------------------------------------------------ state

    @property
    def healthy(self) -> bool:
        return self._conn.healthy and not self._closed

    def stats(self) -> dict[str, Any]:
        """Counters since creation, plus ``healthy``, ``mode`` and ``last_error``."""
        out: dict[str, Any] = dict(self._stats)
        out.update(healthy=self.healthy, mode=self.mode, last_error=self._conn.last_error)
        return out

    def _attempt(self, deadline: float, force: bool = False) -> int:
        """Make the client usable, or say why not. Caller holds ``self._lock``."""
        if self._closed:
            return ERR_CLOSED
        conn = self._conn
        if conn.healthy and self._store is not None:
            return OK
        now = time.monotonic()
        if not conn.attempt_due(now, force) or self._worker.busy():
            return ERR_UNAVAILABLE
        if not conn.targets_reachable(deadline, now):
            return ERR_UNAVAILABLE
        if conn.wants_rebuild(self._store is not None):
            fn, what = self._job_rebuild, "setup"
        else:
            fn, what = self._job_probe, "probe"
        ok, val = self._run(fn, deadline, what)
        if not ok:
            if val == ERR_INTERNAL:  # the binding raised: back off like any failure
                conn.mark_unhealthy(conn.last_error)
            return val
        return OK if conn.healthy else ERR_UNAVAILABLE

    # Jobs (run on the worker thread) -------------------------------------

    def _job_probe(self) -> None:
        store = self._store
        r = store.batch_is_exist([_PROBE_KEY])
        if r and r[0] in (0, 1):
            self._conn.mark_healthy("probe answered")
        else:
            self._conn.probe_failed(f"probe failed ({describe(int(r[0]) if r else -1)})")

    def _job_rebuild(self) -> None:
        MooncakeDistributedStore = _import_store()
        old, self._store = self._store, None
        if old is not None:
            self._release_staging(old)
            with contextlib.suppress(Exception):
                old.close()
        store = MooncakeDistributedStore()
        if self.mode == "shm":
            rc = store.setup_dummy(0, 0, self.client_addr)
        else:
            rc = store.setup(
                self.local_hostname,
                self.metadata_url,
                self.global_segment_bytes,
                0,  # Mooncake's own local buffer: unused, we register our staging region
                self.protocol,
                self.rdma_devices,
                self.master_addr,
            )
        if rc != 0:
            with contextlib.suppress(Exception):
                store.close()
            self._conn.mark_unhealthy(f"Mooncake setup returned {rc}")
            return
        err = self._staging.attach(store, self.timeout_s)
        if err:
            with contextlib.suppress(Exception):
                store.close()
            self._conn.mark_unhealthy(err)
            return
        if self._destinations:
            self._register_destinations(store)
        self._store = store
        self._stats["rebuilds"] += 1
        self._conn.mark_healthy("setup")

    def _release_staging(self, store: Any) -> None:
        """On the worker thread, before ``store`` is closed: unregister the destinations and the
        staging region from it."""
        self._unregister_destinations(store)
        self._staging.release(store)

    # Running a job with a deadline ---------------------------------------

    def _run(self, fn: Callable[[], Any], deadline: float, what: str) -> tuple[bool, Any]:
        """Run ``fn`` on the worker and wait for it until ``deadline``: ``(True, result)``, or
        ``(False, code)`` if it timed out, raised or could not start. Caller holds ``self._lock``."""
        return self._wait(self._submit(fn, deadline, what), deadline, what)

    def _submit(self, fn: Callable[[], Any], deadline: float, what: str) -> _Job | None:
        """Start ``fn`` on the worker without waiting (:meth:`_wait` collects it); None while a call
        abandoned earlier still runs there. Caller holds ``self._lock``."""
        if self._worker.busy():
            self._stats["unavailable"] += 1
            return None
        return self._worker.submit(fn, what, max(deadline - time.monotonic(), 0.0))

    def _wait(self, job: _Job | None, deadline: float, what: str) -> tuple[bool, Any]:
        """Wait for a job :meth:`_submit` started, as :meth:`_run` does."""
        if job is None:
            return False, ERR_UNAVAILABLE
        wait = max(deadline - time.monotonic(), 0.0)
        if not job.done.wait(wait):
            job.abandon(what)
            self._stats["timeouts"] += 1
            self._conn.mark_unhealthy(f"{what} did not finish within {wait:.3g} s")
            return False, ERR_TIMEOUT
        if job.error is not None:
            log.error("Mooncake %s raised %r", what, job.error)
            self._conn.last_error = f"{what} raised {job.error!r}"
            return False, ERR_INTERNAL
        return True, job.result

    def _begin(self, timeout_s: float | None = None) -> tuple[float, int]:
        """Take the caller lock and make sure we are connected. Returns (deadline, code).

        The call's own time starts once the lock is held: waiting behind
        another caller is not the store being slow, and must not mark the
        client unhealthy. A reconnection made first gets its own time too
        (bounded by the same timeout), so a caller waits at most three times
        the timeout.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            self._stats["unavailable"] += 1
            return time.monotonic(), ERR_UNAVAILABLE
        deadline = time.monotonic() + timeout_s
        was_healthy = self.healthy
        try:
            code = self._attempt(deadline)
        except BaseException:
            self._lock.release()
            raise
        if code == OK and not was_healthy:
            deadline = time.monotonic() + timeout_s
        if code != OK:
            self._stats["unavailable"] += 1
            self._lock.release()
        return deadline, code

    def _check_codes(self, codes: Sequence[int], what: str) -> None:
        bad = [c for c in codes if c in _CONNECTION_CODES]
        if bad:
            self._stats["connection_errors"] += 1
            self._conn.mark_unhealthy(f"{what} got {describe(bad[0])}")
        elif self.mode == "shm" and what == "batch_put_from" and INVALID_PARAMS in codes:
            # A put from our shared memory is refused when the storage process
            # does not map it: it restarted since we attached. Attach anew.
            self._stats["connection_errors"] += 1
            self._conn.rebuild_next()
            self._conn.mark_unhealthy(f"{what} got {describe(INVALID_PARAMS)}: the storage process does not map "
                                 "this client's shared memory (restarted?); attaching again")

    # ------------------------------------------------------------------ API

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the store holds. False for missing keys and on any failure."""
        keys = list(keys)
        if not keys:
            return []
        self._stats["exists_calls"] += 1
        ok, val = self._call_once("batch_is_exist", lambda store: store.batch_is_exist(keys))
        if not ok:
            return [False] * len(keys)
        codes = [int(v) for v in val]
        self._check_codes(codes, "batch_is_exist")
        return [c == 1 for c in codes]

    def _call_once(self, what: str, fn: Callable[[Any], Any]) -> tuple[bool, Any]:
        """``fn(store)`` as one Mooncake call, under the caller lock and the client's timeout:
        ``(True, its result)`` or ``(False, a code saying why not)``."""
        deadline, code = self._begin()
        if code != OK:
            return False, code
        try:
            store = self._store
            return self._run(lambda: fn(store), deadline, what)
        finally:
            self._lock.release()

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any], timeout_s: float | None = None) -> list[int]:
        """Store each buffer under its key. Per key: 0 stored (or already present), negative: not stored.

        ``buffers``: bytes-like objects (bytes, bytearray, memoryview, numpy
        arrays) or contiguous torch tensors (CPU or device), any dtype; the
        stored object is their raw bytes. A tuple of such buffers is stored
        as one object, its parts back to back (a chunk's header and payload,
        with no encoded copy of the two). ``timeout_s``: this call's limit
        (default: the client's ``timeout_s``); writes off the request path may
        allow more.
        """
        return self._transfer(list(keys), list(buffers), put=True, timeout_s=timeout_s)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """Remove each key. Per key: 0 removed, -704 missing, -706 leased by a recent read
        (unless ``force``), other negative: failed. ``force`` skips Mooncake's lease and
        replication checks: only for objects nobody should read (a chunk that failed its check)."""
        keys = list(keys)
        if not keys:
            return []
        ok, val = self._call_once("batch_remove", lambda store: store.batch_remove(keys, force))
        if not ok:
            return [val] * len(keys)
        codes = [int(v) for v in val]
        self._check_codes(codes, "batch_remove")
        return codes

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Read each key into its buffer. Per key: bytes read (>= 0), -704 missing, other negative: failed.

        ``buffers`` must be writable and at least as large as the object
        (else -600); only the first ``n`` bytes are written on success.
        """
        return self._transfer(list(keys), list(buffers), put=False)

    def batch_get_visit(
        self, keys: Sequence[str], max_sizes: Sequence[int], visit: Callable[[int, memoryview], None]
    ) -> list[int]:
        """Read each key into the staging region and call ``visit(index, bytes)`` for each one read.

        ``visit`` runs on the caller's thread, with the object's bytes still in
        the staging region (valid only during the call): a reader checks and
        copies them straight into their destination, with no intermediate
        buffer. ``max_sizes[i]``: the largest object expected for ``keys[i]``.
        Returns codes as :meth:`batch_get_into` (an exception in ``visit``
        propagates after the staging region is released).
        """
        return self._transfer(list(keys), [_Sized(n) for n in max_sizes], put=False, visit=visit)

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Detach from the store (bounded by ``timeout_s``). Further calls return ERR_CLOSED / misses."""
        if self._closed:
            return
        got = self._lock.acquire(timeout=self.timeout_s)
        try:
            self._closed = True
            self._conn.mark_closed()
            store, self._store = self._store, None
            if store is not None:

                def _close() -> None:
                    self._release_staging(store)
                    store.close()

                if self._worker.busy():
                    _ABANDONED.append((store, self._staging.mem))
                else:
                    job = self._worker.submit(_close)
                    if not job.done.wait(self.timeout_s):
                        _ABANDONED.append((store, self._staging.mem))
            self._worker.stop()
        finally:
            if got:
                self._lock.release()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _import_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        hint = missing_library_hint(str(e))
        if hint:
            raise StoreError(f"cannot load Mooncake: {hint}") from e
        raise StoreError(
            f"cannot import mooncake.store ({e}); install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
            "(or mooncake-transfer-engine on CUDA hosts)"
        ) from e
    return MooncakeDistributedStore
