"""Read our counters back: from a vLLM instance's ``/metrics``, or from an offline run's folder.

``fetch(url).value("vllm:lmcm_chunk_hits", tier="store")`` is the number of
chunks that instance read from the store; tests, ``up``, the demo, the
benchmarks and ``lmcache-mooncake stats`` all read counters this way.
Counter names may be given with or without ``_total``; labels that are not
given are summed over (all engines, all tiers).
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from lmcache_mooncake.obs.metric_names import samples_from_counters

Labels = tuple[tuple[str, str], ...]


@dataclass
class MetricsSnapshot:
    """Samples of one read: ``{(sample name, sorted labels): value}``."""

    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` (or ``name_total``) whose labels include ``labels``."""
        names = {name, name + "_total"} if not name.endswith("_total") else {name}
        want = set(labels.items())
        return sum(v for (n, lab), v in self.samples.items() if n in names and want <= set(lab))

    def count(self, name: str, **labels: str) -> int:
        """:meth:`value` as an int (counters)."""
        return int(self.value(name, **labels))

    def labels(self, name: str, label: str) -> dict[str, float]:
        """``{label value: summed value}`` of ``name`` split by ``label``."""
        names = {name, name + "_total"}
        out: dict[str, float] = {}
        for (n, lab), v in self.samples.items():
            d = dict(lab)
            if n in names and label in d:
                out[d[label]] = out.get(d[label], 0.0) + v
        return out

    def names(self, prefix: str = "") -> set[str]:
        return {n for n, _ in self.samples if n.startswith(prefix)}

    def __add__(self, other: MetricsSnapshot) -> MetricsSnapshot:
        merged = dict(self.samples)
        for k, v in other.samples.items():
            merged[k] = merged.get(k, 0.0) + v
        return MetricsSnapshot(merged)


def parse(text: str) -> MetricsSnapshot:
    """Prometheus text exposition -> snapshot."""
    samples: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + float(s.value)
    return MetricsSnapshot(samples)


def metrics_url(url: str) -> str:
    """``http://host:port`` or ``.../metrics`` -> the ``/metrics`` URL."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch(url: str, timeout_s: float = 5.0) -> MetricsSnapshot:
    """Read ``url``'s ``/metrics``. Raises OSError (naming the URL) when it does not answer."""
    target = metrics_url(url)
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            return parse(resp.read().decode())
    except OSError as e:
        raise OSError(f"could not read metrics from {target}: {e}; is the instance running?") from e


def fetch_all(urls: Iterable[str], timeout_s: float = 5.0) -> MetricsSnapshot:
    """The sum of several instances' metrics."""
    total = MetricsSnapshot()
    for u in urls:
        total = total + fetch(u, timeout_s)
    return total


def read_offline(run_dir: str | os.PathLike[str]) -> MetricsSnapshot:
    """The counters an offline run (vLLM's ``LLM``, no ``/metrics``) left in ``run_dir``, under the
    same names ``/metrics`` uses (counters only, no timings)."""
    from lmcache_mooncake.obs.stats import read_dumps

    return MetricsSnapshot(samples_from_counters(read_dumps(run_dir)))
