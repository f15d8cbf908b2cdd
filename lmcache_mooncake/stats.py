"""Counters of what the connector did (hits, writes, failures), one set per engine.

The worker side writes them as JSON to ``<run_dir>/stats-rank<N>.json`` so
tests, the demo and operators can read what happened inside vLLM's worker
process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Stats:
    """A thread-safe counter with a JSON dump."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._dirty = False
        self._last_dump = 0.0
        self._providers: list[tuple[str, Callable[[], dict[str, Any]]]] = []

    def register(self, prefix: str, provider: Callable[[], dict[str, Any]]) -> None:
        """Include ``provider()``'s integer counters, named ``prefix + name``, in every snapshot."""
        with self._lock:
            self._providers.append((prefix, provider))

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n
            self._dirty = True

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            data = dict(self._counts)
            providers = list(self._providers)
        for prefix, provider in providers:
            for name, value in provider().items():
                if isinstance(value, int) and not isinstance(value, bool):
                    data[prefix + name] = value
        return data

    def dump(self, path: Path, force: bool = False, min_interval_s: float = 0.5) -> None:
        """Write the counters to ``path`` atomically, if they may have changed since the
        last dump and (unless ``force``) ``min_interval_s`` has passed."""
        now = time.monotonic()
        with self._lock:
            if not force and (not (self._dirty or self._providers) or now - self._last_dump < min_interval_s):
                return
            self._dirty = False
            self._last_dump = now
        data = self.snapshot()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)


def read_stats(run_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Sum the counters every process of an instance (scheduler, workers) wrote under ``run_dir``."""
    total: Counter[str] = Counter()
    for p in Path(run_dir).glob("stats-*.json"):
        total.update(json.loads(p.read_text()))
    return dict(total)
