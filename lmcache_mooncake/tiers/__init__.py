"""Storage tiers plugged into LMCache, and the count of their unfinished writes.

LMCache's remote backend tracks single puts but not batched ones, so a
process cannot tell from LMCache when the chunks it handed to a slower tier
are written. Our tiers count their own writes from the moment LMCache submits
them (``begin``) to their end (``end``); :func:`lmcache_mooncake.engine.drain`
waits for zero.
"""

from __future__ import annotations

import threading


class PendingWrites:
    def __init__(self) -> None:
        self._n = 0
        self._cond = threading.Condition()

    def begin(self, n: int = 1) -> None:
        with self._cond:
            self._n += n

    def end(self, n: int = 1) -> None:
        with self._cond:
            self._n -= n
            self._cond.notify_all()

    @property
    def count(self) -> int:
        with self._cond:
            return self._n

    def wait(self, timeout: float) -> bool:
        """True once no write is pending; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n <= 0, timeout)


PENDING = PendingWrites()
