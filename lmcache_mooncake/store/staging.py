"""Batches of puts and gets through the store client's registered staging region.

:class:`StagedTransfers` is the part of :class:`~lmcache_mooncake.store.client.StoreClient`
that packs a batch into rounds that fit the staging region (``local_buffer_bytes``),
copies caller buffers in (puts) or out (gets, or hands the bytes to a visitor),
and counts the results. The client provides the connection: ``_begin`` (the
caller lock and a usable connection), ``_attempt``, ``_run`` (a Mooncake call
with a deadline), ``_check_codes``, ``_conn`` (its health), ``_store`` and
``_staging`` (the region itself, :mod:`lmcache_mooncake.store.staging_memory`).

Why a staging region at all: a call that timed out keeps running inside
Mooncake, and it must never read or write memory the caller already got back.
The staging region belongs to the client for its lifetime, so an abandoned
call only ever touches it.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable
from typing import Any

from lmcache_mooncake.store.calls import _Buf, _resolve, _Sized, _tensor_bytes
from lmcache_mooncake.store.codes import (
    ERR_BAD_BUFFER,
    ERR_INTERNAL,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    ERR_UNAVAILABLE,
    NOT_FOUND,
    OK,
)

_ALIGN = 64

#: A get whose bytes are visited in the staging region is fetched in this many parts per round,
#: so the store's copy of one part overlaps the visitor's check and copy of the one before.
GET_PARTS = 4


def split_round(rnd: list, parts: int) -> list[list]:
    """``rnd`` in at most ``parts`` consecutive, non-empty slices of near-equal length."""
    n = min(parts, len(rnd))
    return [rnd[len(rnd) * p // n : len(rnd) * (p + 1) // n] for p in range(n)]


def pack_rounds(items: list[tuple[int, int]], capacity: int) -> list[list[tuple[int, int]]]:
    """``(index, nbytes)`` items, each fitting ``capacity`` once aligned, packed in order into
    rounds of ``(index, offset)`` whose aligned slots fit a staging region of ``capacity`` bytes."""
    rounds: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    off = 0
    for i, nbytes in items:
        size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if cur and off + size > capacity:
            rounds.append(cur)
            cur, off = [], 0
        cur.append((i, off))
        off += size
    if cur:
        rounds.append(cur)
    return rounds


class StagedTransfers:
    """Mixin of :class:`StoreClient`: batched transfers through the staging region."""

    def _transfer(self, keys: list[str], buffers: list[Any], put: bool, timeout_s: float | None = None,
                  visit: Callable[[int, memoryview], None] | None = None) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        n = len(keys)
        if n == 0:
            return []
        self._stats["put_calls" if put else "get_calls"] += 1
        results = [ERR_BAD_BUFFER] * n
        items: list[tuple[int, _Buf]] = []
        sizes_by_index = [0] * n
        for i, b in enumerate(buffers):
            rb = _Buf(None, b.nbytes) if isinstance(b, _Sized) else _resolve(b, writable=not put)
            if rb is None:
                continue
            sizes_by_index[i] = rb.nbytes
            if rb.nbytes > self.local_buffer_bytes:
                results[i] = ERR_TOO_LARGE
                continue
            items.append((i, rb))
        # Pack into rounds that fit the staging region.
        bufs = dict(items)
        rounds = [[(i, bufs[i], off) for i, off in rnd]
                  for rnd in pack_rounds([(i, rb.nbytes) for i, rb in items], self.local_buffer_bytes)]
        if rounds:
            deadline, code = self._begin(timeout_s)
            if code != OK:
                for rnd in rounds:
                    for i, _, _ in rnd:
                        results[i] = code
            else:
                try:
                    self._do_rounds(keys, rounds, results, deadline, put, visit)
                finally:
                    self._lock.release()
        self._count(results, sizes_by_index, put)
        return results

    def _do_rounds(
        self,
        keys: list[str],
        rounds: list[list[tuple[int, _Buf, int]]],
        results: list[int],
        deadline: float,
        put: bool,
        visit: Callable[[int, memoryview], None] | None = None,
    ) -> None:
        what = "batch_put_from" if put else "batch_get_into"

        def fail(code: int, parts: list[list[tuple[int, _Buf, int]]], r: int) -> None:
            for rnd in parts + rounds[r + 1 :]:
                for i, _, _ in rnd:
                    results[i] = code

        for r, rnd in enumerate(rounds):
            code = self._attempt(deadline) if r else OK
            if code == OK and time.monotonic() >= deadline:
                code = ERR_TIMEOUT
            if code != OK:
                fail(code, [rnd], r)
                return
            store, base = self._store, self._staging.ptr
            if put:
                # Our own copy is not the store's time: the call's deadline moves with it.
                t_copy = time.monotonic()
                for _, rb, off in rnd:
                    self._copy_in(rb, off)
                deadline += time.monotonic() - t_copy
            # A visited get is fetched in parts, each into its own slots of the round: while the
            # caller's visitor checks and copies one part, the store writes the next (the
            # visitor's work and the store's copy overlap on two cores).
            parts = split_round(rnd, GET_PARTS) if visit is not None else [rnd]
            call = functools.partial(self._part_call, store, base, keys, put)
            job = self._submit(call(parts[0]), deadline, what)
            for k, part in enumerate(parts):
                ok, val = self._wait(job, deadline, what)
                if not ok:
                    fail(val, parts[k:], r)
                    return
                codes = [int(v) for v in val] + [ERR_INTERNAL] * (len(part) - len(val))
                self._check_codes(codes, what)
                job = None
                if k + 1 < len(parts) and self._conn.healthy:
                    job = self._submit(call(parts[k + 1]), deadline, what)
                try:
                    for (i, rb, off), c in zip(part, codes, strict=False):
                        results[i] = c
                        if not put and c > 0:
                            if visit is not None:
                                visit(i, self._staging.view(off, min(c, rb.nbytes)))
                            else:
                                self._copy_out(rb, off, min(c, rb.nbytes))
                except BaseException:
                    # The next part's call writes into the staging region: it ends (or is
                    # abandoned at the deadline) before the caller lock is given back.
                    self._wait(job, deadline, what)
                    raise
                if not self._conn.healthy:
                    fail(ERR_UNAVAILABLE, parts[k + 1 :], r)
                    if job is not None:
                        self._wait(job, deadline, what)
                    return

    def _part_call(self, store: Any, base: int, keys: list[str], put: bool,
                   part: list[tuple[int, _Buf, int]]) -> Callable[[], Any]:
        """The Mooncake call that moves ``part`` between the staging region at ``base`` and the store."""
        rkeys = [keys[i] for i, _, _ in part]
        ptrs = [base + off for _, _, off in part]
        sizes = [rb.nbytes for _, rb, _ in part]
        if put:
            return functools.partial(store.batch_put_from, rkeys, ptrs, sizes, self._replicate_config())
        return functools.partial(store.batch_get_into, rkeys, ptrs, sizes)

    def _replicate_config(self) -> Any:
        """Mooncake's per-put settings: ``replica_num`` copies, pinned as ``pin`` says."""
        if self._replicate is None:
            from mooncake.store import ReplicateConfig, SoftPinAction

            cfg = ReplicateConfig()
            cfg.replica_num = self.replica_num
            if self.pin == "soft":
                # Both are needed: a TTL alone is refused (-600) by Mooncake 0.3.13.
                cfg.soft_pin_action = SoftPinAction.ENABLE
                cfg.soft_pin_ttl_ms = int(self.pin_ttl_s * 1000)
            elif self.pin == "hard":
                cfg.with_hard_pin = True
            self._replicate = cfg
        return self._replicate

    def _copy_in(self, rb: _Buf, off: int) -> None:
        if rb.parts is not None:
            for part in rb.parts:
                self._copy_in(part, off)
                off += part.nbytes
            return
        if rb.nbytes == 0:
            return
        if rb.tensor is not None:
            self._staging.as_tensor()[off : off + rb.nbytes].copy_(_tensor_bytes(rb.tensor))
        else:
            ctypes.memmove(self._staging.ptr + off, rb.ptr, rb.nbytes)

    def _copy_out(self, rb: _Buf, off: int, n: int) -> None:
        if rb.tensor is not None:
            _tensor_bytes(rb.tensor)[:n].copy_(self._staging.as_tensor()[off : off + n])
        else:
            ctypes.memmove(rb.ptr, self._staging.ptr + off, n)

    def _count(self, results: list[int], sizes: list[int], put: bool) -> None:
        s = self._stats
        for c, size in zip(results, sizes, strict=True):
            if put:
                if c == OK:
                    s["puts_ok"] += 1
                    s["bytes_put"] += size
                else:
                    s["puts_failed"] += 1
            elif c >= 0:
                s["gets_hit"] += 1
                s["bytes_got"] += c
            elif c == NOT_FOUND:
                s["gets_missed"] += 1
            else:
                s["gets_failed"] += 1
