"""Process-wide counters of what the connector did (hits, writes, failures).

The worker side writes them as JSON to ``<run_dir>/stats-rank<N>.json`` so
tests, the demo and operators can read what happened inside vLLM's worker
process.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path


class Stats:
    """A thread-safe counter with a JSON dump."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._dirty = False

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n
            self._dirty = True

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def dump(self, path: Path, force: bool = False) -> None:
        """Write the counters to ``path`` atomically, if they changed since the last dump."""
        with self._lock:
            if not (self._dirty or force):
                return
            data = dict(self._counts)
            self._dirty = False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)


STATS = Stats()


def read_stats(run_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Sum the counters every worker of an instance wrote under ``run_dir``."""
    total: Counter[str] = Counter()
    for p in Path(run_dir).glob("stats-rank*.json"):
        total.update(json.loads(p.read_text()))
    return dict(total)
