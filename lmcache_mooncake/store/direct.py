"""Gets straight into caller memory registered with Mooncake: one copy fewer than staging.

:class:`DirectGets` is the part of :class:`~lmcache_mooncake.store.client.StoreClient`
that reads objects into memory the caller owns (LMCache's CPU pool) instead of
the client's staging region (:mod:`lmcache_mooncake.store.staging`). What
Mooncake 0.3.13 allows, measured against a real store (docs/design.md,
"Direct gets from the store"):

- ``tcp`` mode: any memory of this process registered with ``register_buffer``
  (a torch tensor included) is a valid destination of ``batch_get_into``, and
  ``batch_get_into_multi_buffers`` splits one object over several
  destinations, whose sizes must add up to the object's size exactly
  (larger: TRANSFER_FAIL -800, smaller: INVALID_PARAMS -600). So a reader
  learns each object's size first (:meth:`DirectGets.batch_object_sizes`, the
  replica descriptors: one master RPC), then reads each object's head (a
  chunk's header) into the staging region and the rest straight into its
  destination (:meth:`DirectGets.batch_get_split`).
- ``shm`` mode: the dummy client accepts destinations only inside the storage
  process's shared memory pool (``register_buffer`` of other memory returns
  -1, a get into it -600), and ``batch_get_into_multi_buffers`` returned -600
  even inside the pool. Direct gets are off in ``shm`` mode.

The hazard the staging region exists for: a call that timed out keeps running
inside Mooncake and may still write its destinations. Direct destinations are
the caller's memory, so a split get that timed out returns :data:`ERR_TIMEOUT`
for the keys of the abandoned call, and the caller must never reuse those
destinations (the Mooncake tier gives them up for good). Keys whose call never
started get :data:`ERR_UNAVAILABLE`: their destinations were never handed to
Mooncake. Every other code means the call returned and Mooncake is done with
the memory.

The client provides ``_begin``, ``_call_once``, ``_attempt``, ``_run``, ``_check_codes``,
``_count``, ``_conn`` (its health), ``_store``, ``_staging`` (the staging region,
:mod:`lmcache_mooncake.store.staging_memory`) and ``local_buffer_bytes``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_mooncake.store.codes import (
    ERR_BAD_BUFFER,
    ERR_INTERNAL,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    ERR_UNAVAILABLE,
    NOT_FOUND,
    OK,
)
from lmcache_mooncake.store.staging import _ALIGN, pack_rounds

log = logging.getLogger(__name__)


class DirectGets:
    """Mixin of :class:`StoreClient`: gets into registered caller memory; see the module docstring."""

    # -- destinations ------------------------------------------------------------------
    def register_destination(self, ptr: int, nbytes: int) -> bool:
        """Let :meth:`batch_get_split` write into ``[ptr, ptr + nbytes)``: caller memory that
        outlives this client (LMCache's CPU pool). Mooncake registers it at the next call that
        needs it, and again after every reconnection. False where direct gets are impossible
        (``shm`` mode)."""
        if self.mode != "tcp" or nbytes <= 0:
            return False
        with self._lock:
            self._destinations.append((int(ptr), int(nbytes)))
            self._destinations_on = None
        return True

    @property
    def direct_ready(self) -> bool:
        """True when :meth:`batch_get_split` may be used: ``tcp`` mode, a destination given, and
        Mooncake did not refuse to register it (if it did, that was logged once)."""
        return self.mode == "tcp" and bool(self._destinations) and self._register_error is None

    def _register_destinations(self, store: Any) -> None:
        """On the worker thread: register every destination with ``store`` (a refusal is kept in
        ``_register_error`` and logged once: loads then go through the staging region)."""
        self._destinations_on = None
        for ptr, nbytes in self._destinations:
            rc = store.register_buffer(ptr, nbytes)
            if rc != 0:
                if self._register_error is None:
                    log.warning("Mooncake store client: register_buffer of a %d-byte destination at %#x "
                                "returned %d; loads from the store go through the staging region", nbytes, ptr, rc)
                self._register_error = f"register_buffer returned {rc}"
                return
        self._destinations_on = store

    def _unregister_destinations(self, store: Any) -> None:
        if self._destinations_on is store:
            for ptr, _ in self._destinations:
                with contextlib.suppress(Exception):
                    store.unregister_buffer(ptr)
        self._destinations_on = None

    def _ensure_registered(self, deadline: float) -> int:
        """Caller holds the lock and a usable connection: register the destinations with it if
        not done yet. OK, or a code saying why not (no get was started)."""
        if self._destinations_on is self._store:
            return OK
        store = self._store
        ok, val = self._run(lambda: self._register_destinations(store), deadline, "register_buffer")
        if not ok:
            return val if val != ERR_TIMEOUT else ERR_UNAVAILABLE
        return OK if self._destinations_on is store else ERR_UNAVAILABLE

    def _in_destination(self, ptr: int, nbytes: int) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in self._destinations)

    # -- calls ----------------------------------------------------------------------------
    def batch_object_sizes(self, keys: Sequence[str]) -> list[int]:
        """Size in bytes of each object (> 0), :data:`NOT_FOUND`, or another negative code
        (the client unavailable, a failed call). One master RPC; reads no object bytes."""
        keys = list(keys)
        if not keys:
            return []
        ok, val = self._call_once("batch_get_replica_desc", lambda store: store.batch_get_replica_desc(keys))
        if not ok:
            return [val] * len(keys)
        return [_object_size(val.get(k)) for k in keys]

    def batch_get_split(
        self,
        keys: Sequence[str],
        head_sizes: Sequence[int],
        tails: Sequence[tuple[int, int]],
        visit: Callable[[int, memoryview], None],
    ) -> list[int]:
        """Read each object's first ``head_sizes[i]`` bytes into the staging region and the rest
        straight into ``tails[i] = (address, nbytes)``, inside a registered destination; then call
        ``visit(i, head)`` with the head still in staging (valid only during the call).

        Each object must be exactly ``head_sizes[i] + tails[i][1]`` bytes (learn it with
        :meth:`batch_object_sizes`). Per key: the bytes read (``visit`` was called), or a negative
        code. :data:`ERR_TIMEOUT`: the call was abandoned while it ran: Mooncake may still write
        that tail at any time, so it must never be reused. :data:`ERR_UNAVAILABLE`,
        :data:`ERR_BAD_BUFFER` (a tail outside every destination), any other code: Mooncake is
        done with the tail (or never had it)."""
        keys = list(keys)
        n = len(keys)
        if len(head_sizes) != n or len(tails) != n:
            raise ValueError(f"{n} keys, {len(head_sizes)} head sizes and {len(tails)} tails")
        if n == 0:
            return []
        self._stats["direct_get_calls"] += 1
        results = [ERR_BAD_BUFFER] * n
        sizes = [h + t[1] for h, t in zip(head_sizes, tails, strict=True)]
        heads: list[tuple[int, int]] = []
        for i, (h, (ptr, nbytes)) in enumerate(zip(head_sizes, tails, strict=True)):
            if h <= 0 or nbytes <= 0 or not self._in_destination(ptr, nbytes):
                continue
            if (h + _ALIGN - 1) // _ALIGN * _ALIGN > self.local_buffer_bytes:
                results[i] = ERR_TOO_LARGE
                continue
            heads.append((i, h))
        rounds = pack_rounds(heads, self.local_buffer_bytes)  # (index, offset of its head in staging)
        if rounds:
            deadline, code = self._begin()
            if code != OK:
                _fill(results, rounds, 0, code)
            else:
                try:
                    code = self._ensure_registered(deadline)
                    if code != OK:
                        _fill(results, rounds, 0, code)
                    else:
                        self._split_rounds(keys, head_sizes, tails, rounds, results, deadline, visit)
                finally:
                    self._lock.release()
        self._count(results, sizes, False)
        return results

    def _split_rounds(self, keys: list[str], head_sizes: Sequence[int], tails: Sequence[tuple[int, int]],
                      rounds: list[list[tuple[int, int]]], results: list[int], deadline: float,
                      visit: Callable[[int, memoryview], None]) -> None:
        what = "batch_get_into_multi_buffers"
        for r, rnd in enumerate(rounds):
            code = self._attempt(deadline) if r else OK
            if code != OK or time.monotonic() >= deadline:
                _fill(results, rounds, r, ERR_UNAVAILABLE)  # never started: nothing was handed over
                return
            store, base = self._store, self._staging.ptr
            fn = functools.partial(
                store.batch_get_into_multi_buffers,
                [keys[i] for i, _ in rnd],
                [[base + off, tails[i][0]] for i, off in rnd],
                [[head_sizes[i], tails[i][1]] for i, _ in rnd],
            )
            ok, val = self._run(fn, deadline, what)
            if not ok:
                # ERR_TIMEOUT: abandoned while running; ERR_UNAVAILABLE: never started;
                # ERR_INTERNAL: the binding raised, so the call is over.
                _fill(results, [rnd], 0, val)
                _fill(results, rounds, r + 1, ERR_UNAVAILABLE)
                return
            codes = [int(v) for v in val] + [ERR_INTERNAL] * (len(rnd) - len(val))
            for (i, off), c in zip(rnd, codes, strict=False):
                if c > 0 and c != head_sizes[i] + tails[i][1]:
                    log.error("Mooncake %s read %d bytes of %s, expected %d", what, c, keys[i],
                              head_sizes[i] + tails[i][1])
                    c = ERR_INTERNAL
                results[i] = c
                if c > 0:
                    visit(i, self._staging.view(off, head_sizes[i]))
            self._check_codes(codes, what)
            if not self._conn.healthy:
                _fill(results, rounds, r + 1, ERR_UNAVAILABLE)
                return


def _fill(results: list[int], rounds: list[list[tuple[int, int]]], start: int, code: int) -> None:
    for rnd in rounds[start:]:
        for i, _ in rnd:
            results[i] = code


def _object_size(replicas: Any) -> int:
    """The size of an object from its replica descriptors (a complete memory replica), else NOT_FOUND."""
    from mooncake.store import ReplicaStatus

    for r in replicas or ():
        if r.is_memory_replica() and r.status == ReplicaStatus.COMPLETE:
            size = int(r.get_memory_descriptor().buffer_descriptor.size)
            if size > 0:
                return size
    return NOT_FOUND


__all__ = ["DirectGets", "ERR_TIMEOUT", "ERR_UNAVAILABLE"]
