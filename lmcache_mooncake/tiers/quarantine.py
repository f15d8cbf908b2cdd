"""LMCache buffers given up for good because a Mooncake call that may still write them timed out.

A direct get from the store (:meth:`StoreClient.batch_get_split`) writes
straight into LMCache buffers. When it times out, the call keeps running
inside Mooncake and may write those buffers at any later time, so they must
never go back to LMCache's allocator (another chunk would get them and be
overwritten). :class:`Quarantine` keeps a reference to each such buffer for
the life of the engine (LMCache never frees a buffer something still
references), counts them (``store_quarantined_chunks`` /
``store_quarantined_bytes`` in the engine's stats) and logs each event once
with how many bytes it cost.

It is bounded: once ``limit_bytes`` are held the tier stops direct gets and
loads through the client's staging region again, which never leaks (an
abandoned call there only ever touches the client's own region).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from lmcache_mooncake.obs.stats import Stats
from lmcache_mooncake.runtime.procs import format_bytes

logger = logging.getLogger(__name__)


class Quarantine:
    """Buffers held forever; see the module docstring."""

    def __init__(self, stats: Stats, limit_bytes: int):
        self._stats = stats
        self.limit_bytes = int(limit_bytes)
        self._lock = threading.Lock()
        self._held: list[Any] = []
        self.nbytes = 0

    @property
    def full(self) -> bool:
        """True once ``limit_bytes`` are held: direct gets must stop."""
        return self.nbytes >= self.limit_bytes

    def hold(self, objs: Sequence[Any], names: Sequence[str]) -> None:
        """Keep ``objs`` (LMCache memory objects a timed-out get may still write) for good."""
        if not objs:
            return
        nbytes = sum(o.tensor.numel() * o.tensor.element_size() for o in objs)
        with self._lock:
            was_full = self.full
            self._held.extend(objs)
            self.nbytes += nbytes
            total, now_full = self.nbytes, self.full
        self._stats.add("store_quarantined_chunks", len(objs))
        self._stats.add("store_quarantined_bytes", nbytes)
        logger.warning(
            "Mooncake tier: a direct get of %d chunks (first %s) timed out; the Mooncake call may still write "
            "their LMCache buffers, so those %s are given up for good (%s in all, limit %s); the chunks are "
            "recomputed", len(objs), names[0] if names else "?", format_bytes(nbytes), format_bytes(total),
            format_bytes(self.limit_bytes))
        if now_full and not was_full:
            logger.warning(
                "Mooncake tier: %s of LMCache memory given up after timed-out gets, over the limit of %s; "
                "loads from the store go through the client's staging region from now on (one copy more, "
                "nothing given up). A store that times out this often needs looking at "
                "('lmcache-mooncake store status')", format_bytes(total), format_bytes(self.limit_bytes))
