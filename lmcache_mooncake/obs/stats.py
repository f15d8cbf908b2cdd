"""Counters and timing samples of what the connector did, one set per engine (or scheduler side).

A :class:`Stats` is owned by the object whose work it counts (an engine's
:class:`~lmcache_mooncake.tiers.base.EngineContext`, the scheduler side). Its
figures leave the process through vLLM's connector stats hook:
:meth:`Stats.take` returns what changed since the last take, which the
connector hands to vLLM (:mod:`lmcache_mooncake.obs.metrics` turns it into
Prometheus metrics and vLLM's periodic log line).

Offline runs (vLLM's ``LLM`` in a child process, used by warm-up and some
tests) have no ``/metrics`` endpoint, and writes that end after a run's last
step never reach vLLM's stats; for them alone the worker also writes its
cumulative counters to ``<run_dir>/stats-<side>.json`` (:meth:`Stats.dump`),
read back as metrics by :func:`lmcache_mooncake.obs.metrics.read_offline_metrics`.
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

#: At most this many timing samples per name are kept between two takes.
MAX_SAMPLES = 4096


class Stats:
    """Thread-safe counters and timing samples; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._samples: dict[str, list[float]] = {}
        self._taken: dict[str, int] = {}
        self._dirty = False
        self._last_dump = 0.0
        self._providers: list[tuple[str, Callable[[], dict[str, Any]]]] = []

    def register(self, prefix: str, provider: Callable[[], dict[str, Any]]) -> None:
        """Include ``provider()``'s cumulative integer counters, named ``prefix + name``, in every snapshot."""
        with self._lock:
            self._providers.append((prefix, provider))

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n
            self._dirty = True

    def observe(self, name: str, value: float) -> None:
        """Record one timing sample (seconds) for the histogram ``name``."""
        with self._lock:
            samples = self._samples.setdefault(name, [])
            if len(samples) < MAX_SAMPLES:
                samples.append(value)
            self._dirty = True

    def snapshot(self) -> dict[str, int]:
        """Cumulative counters since creation (providers included)."""
        with self._lock:
            data = dict(self._counts)
            providers = list(self._providers)
        for prefix, provider in providers:
            for name, value in provider().items():
                if isinstance(value, int) and not isinstance(value, bool):
                    data[prefix + name] = value
        return data

    def take(self) -> dict[str, Any]:
        """``{"counters": {name: increase}, "samples": {name: [seconds]}}`` since the last take
        (only non-zero increases). One reader takes: the connector, for vLLM."""
        snap = self.snapshot()
        with self._lock:
            counters = {k: v - self._taken.get(k, 0) for k, v in snap.items() if v != self._taken.get(k, 0)}
            self._taken = snap
            samples, self._samples = self._samples, {}
        return {"counters": counters, "samples": samples}

    def dump(self, path: Path, force: bool = False, min_interval_s: float = 0.5) -> None:
        """Write the cumulative counters to ``path`` atomically (the offline fallback), if they may
        have changed since the last dump and (unless ``force``) ``min_interval_s`` has passed."""
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


def read_dumps(run_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Sum the cumulative counters every process of an offline run wrote under ``run_dir``."""
    total: Counter[str] = Counter()
    for p in Path(run_dir).glob("stats-*.json"):
        total.update(json.loads(p.read_text()))
    return dict(total)
