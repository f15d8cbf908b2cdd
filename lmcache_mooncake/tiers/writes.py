"""Write tracking: which chunks handed to a slower tier are not written yet.

LMCache's remote backend tracks single puts but not batched ones, so a
process cannot tell from LMCache when the chunks it handed to a slower tier
are written. Our tiers report each write from the moment LMCache hands it to
them (:meth:`WriteTracker.begin`, on LMCache's event loop, shortly after
``engine.store`` returned: :func:`lmcache_mooncake.engine.write_barrier` waits
for that) to its end (:meth:`WriteTracker.end`), per key. That answers "are
all writes done?" (:func:`lmcache_mooncake.engine.drain`) and "are this
request's chunks written?" (a producer holds a request's blocks until they
are). Each engine owns one tracker (:class:`lmcache_mooncake.tiers.base.EngineContext`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class WriteTracker:
    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()
        self._total = 0
        self._cond = threading.Condition()

    def begin(self, keys: Iterable[str]) -> None:
        with self._cond:
            for k in keys:
                self._in_flight[k] += 1
                self._total += 1

    def end(self, keys: Iterable[str]) -> None:
        with self._cond:
            for k in keys:
                self._in_flight[k] -= 1
                if self._in_flight[k] <= 0:
                    del self._in_flight[k]
                self._total -= 1
            self._cond.notify_all()

    @property
    def count(self) -> int:
        """Writes submitted and not finished, over all tiers and keys."""
        with self._cond:
            return self._total

    def any_in_flight(self, keys: Iterable[str]) -> bool:
        with self._cond:
            return any(k in self._in_flight for k in keys)

    def wait(self, timeout: float) -> bool:
        """True once no write is pending; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._total <= 0, timeout)

