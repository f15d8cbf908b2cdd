"""Our counters as vLLM connector stats and Prometheus metrics (documented in docs/metrics.md).

How the figures travel (vLLM 0.32, three processes):

- the worker process (engine, tiers) and the EngineCore process (scheduler
  side) each own a :class:`~lmcache_mooncake.obs.stats.Stats`; after every step
  vLLM calls ``get_kv_connector_stats`` on both, and we hand over
  :meth:`Stats.take` (what changed since the last call) wrapped in
  :class:`LMCacheMooncakeStats`;
- the scheduler aggregates worker and scheduler stats
  (:meth:`LMCacheMooncakeStats.aggregate`) and sends the plain dict to the
  API process, where vLLM logs :meth:`~LMCacheMooncakeStats.reduce` in its
  periodic "KV Transfer metrics" line and feeds
  :meth:`LMCacheMooncakePromMetrics.observe`, which adds the increases to the
  Prometheus metrics of :data:`FAMILIES` on ``/metrics``.

The names are in :mod:`lmcache_mooncake.obs.metric_names`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from lmcache_mooncake.obs.metric_names import FAMILIES, ROUTES, SECONDS_BUCKETS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

@dataclass
class LMCacheMooncakeStats(KVConnectorStats):
    """Increases since the last hand-over: ``{"counters": {name: n}, "samples": {name: [s]}}``.

    Plain data, so vLLM can send it between processes."""

    data: dict[str, Any] = field(default_factory=lambda: {"counters": {}, "samples": {}})

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("samples", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "samples": {}}

    def aggregate(self, other: KVConnectorStats) -> LMCacheMooncakeStats:
        counters, samples = self.data["counters"], self.data["samples"]
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        for k, v in other.data.get("samples", {}).items():
            samples.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's non-zero counters, and each timing's count and mean in ms (vLLM's log line)."""
        out: dict[str, int | float] = {k: v for k, v in sorted(self.data["counters"].items()) if v}
        for k, v in sorted(self.data["samples"].items()):
            if v:
                out[f"{k.removesuffix('_s')}_count"] = len(v)
                out[f"{k.removesuffix('_s')}_avg_ms"] = round(1000 * sum(v) / len(v), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not any(self.data["samples"].values())


class LMCacheMooncakePromMetrics(KVConnectorPromMetrics):
    """Registers :data:`FAMILIES` with vLLM's Prometheus classes and adds each interval's increases."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for fam in FAMILIES:
            names = [*labelnames, fam.label] if fam.label else list(labelnames)
            if fam.kind == "counter":
                metric = self._counter_cls(name=fam.name, documentation=fam.doc, labelnames=names)
            else:
                metric = self._histogram_cls(name=fam.name, documentation=fam.doc, labelnames=names,
                                             buckets=list(SECONDS_BUCKETS))
            self._metrics[fam.name] = metric
            if not fam.label:
                for labelvalues in per_engine_labelvalues.values():
                    metric.labels(*labelvalues)  # present at 0 before the first request
            else:
                for labelvalues in per_engine_labelvalues.values():
                    for value in fam.sources.values():
                        metric.labels(*labelvalues, value)

    def _child(self, internal: str, engine_idx: int) -> Any | None:
        route = ROUTES.get(internal)
        if route is None:
            return None
        fam, value = route
        labelvalues = self.per_engine_labelvalues[engine_idx]
        metric = self._metrics[fam.name]
        return metric.labels(*labelvalues, value) if fam.label else metric.labels(*labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in transfer_stats_data.get("counters", {}).items():
            child = self._child(name, engine_idx)
            if child is not None and n > 0:
                child.inc(n)
        for name, values in transfer_stats_data.get("samples", {}).items():
            child = self._child(name, engine_idx)
            if child is not None:
                for v in values:
                    child.observe(v)
