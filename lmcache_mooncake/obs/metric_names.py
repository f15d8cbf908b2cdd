"""The names of our metrics and the internal counters behind each (documented in docs/metrics.md).

Names follow vLLM's own connector metrics (``vllm:nixl_xfer_time_seconds``):
the ``vllm:`` namespace every vLLM metric has, then ``lmcm_`` for this
connector. Every metric carries vLLM's ``model_name`` and ``engine`` labels;
per-tier metrics add ``tier`` (``disk``, ``store``). This module imports
nothing heavy, so readers (``lmcache-mooncake stats``, tests) use it too.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "vllm:lmcm_"

#: Histogram buckets in seconds: lookups take microseconds to a timeout, loads up to seconds.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class Family:
    """One Prometheus metric and the internal counters (or sample names) that feed it.

    ``sources`` maps a :class:`~lmcache_mooncake.obs.stats.Stats` name to the value
    of ``label`` it is reported under ("" when the family has no extra label).
    Counters appear on ``/metrics`` as ``<name>_total``.
    """

    name: str
    kind: str  # "counter" or "histogram"
    doc: str
    sources: dict[str, str]
    label: str | None = None


def _c(short: str, doc: str, sources: dict[str, str] | str, label: str | None = None) -> Family:
    src = {sources: ""} if isinstance(sources, str) else sources
    return Family(PREFIX + short, "counter", doc, src, label)


def _h(short: str, doc: str, source: str) -> Family:
    return Family(PREFIX + short, "histogram", doc, {source: ""})


FAMILIES: tuple[Family, ...] = (
    _c("lookups", "Prefix lookups answered by the worker (one or more per request).", "lookups"),
    _c("lookup_hit_tokens", "Prompt tokens the tiers held, summed over lookups.", "lookup_hit_tokens"),
    _c("tier_lookups", "Lookups that reached a tier (LMCache asks a tier only past the faster tiers' hits).",
       {"disk_lookups": "disk", "store_lookups": "store"}, "tier"),
    _c("chunk_hits", "Chunks read and verified from a tier (disk: also chunks verified at lookup).",
       {"disk_hits": "disk", "store_hits": "store"}, "tier"),
    _c("chunk_misses", "Chunks a tier was asked for and did not hold.", {"store_misses": "store"}, "tier"),
    _c("chunks_written", "Chunks written to a tier.", {"disk_writes": "disk", "store_puts": "store"}, "tier"),
    _c("read_bytes", "Bytes read from a tier (headers included).",
       {"disk_bytes_read": "disk", "store_bytes_read": "store"}, "tier"),
    _c("written_bytes", "Bytes written to a tier (headers included).",
       {"disk_bytes_written": "disk", "store_bytes_written": "store"}, "tier"),
    _c("verify_failures", "Chunks that failed their header or checksum check (counted as misses, recomputed).",
       {"disk_verify_failures": "disk", "store_verify_failures": "store"}, "tier"),
    _c("evictions", "Chunks a tier evicted to stay within its size.", {"disk_evictions": "disk"}, "tier"),
    _c("read_errors", "Chunk reads that failed for another reason than a miss.",
       {"store_get_failures": "store"}, "tier"),
    _c("write_errors", "Chunks a tier refused to store.", {"store_put_failures": "store"}, "tier"),
    _c("write_batch_errors", "Write batches that raised (their chunks are not stored).",
       {"lmcm_mooncake_write_errors": "store", "lmcm_disk_write_errors": "disk"}, "tier"),
    _c("bad_removed", "Damaged chunks removed from a tier so that a good copy can replace them.",
       {"store_bad_removed": "store"}, "tier"),
    _c("foreign_kept", "Chunks that failed this instance's check because another chunk format version or chunk "
       "auth secret wrote them: misses here, left in place for the instances that can read them.",
       {"disk_foreign_kept": "disk", "store_foreign_kept": "store"}, "tier"),
    _c("store_reads", "Chunks read from the store, by path: direct (straight into LMCache's buffer, tcp mode) "
       "or staged (through the client's staging region, one copy more).",
       {"store_direct_reads": "direct", "store_staged_reads": "staged"}, "path"),
    _c("quarantined_bytes", "LMCache buffer bytes given up for good because a direct store get into them timed "
       "out (the Mooncake call may still write them).", "store_quarantined_bytes"),
    _c("store_errors", "Mooncake store calls that failed, by kind (timeout, unavailable, connection).",
       {"store_client_timeouts": "timeout", "store_client_unavailable": "unavailable",
        "store_client_connection_errors": "connection"}, "kind"),
    _c("store_reconnects", "Times the store client reconnected to the Mooncake master.", "store_client_reconnects"),
    _c("loaded_tokens", "Prompt tokens loaded into vLLM's paged KV.", "loaded_tokens"),
    _c("loads", "Requests whose cached KV was loaded, by mode (async, sync).",
       {"loads_async": "async", "loads_sync": "sync"}, "mode"),
    _c("load_failures", "Loads that delivered fewer tokens than planned (vLLM recomputes the rest).",
       "load_failures"),
    _c("loads_failed_recomputed", "Requests whose load failed and that were then computed, not loaded again.",
       "loads_failed_recomputed"),
    _c("load_failed_tokens", "Planned tokens that were not loaded and were recomputed.", "load_failed_tokens"),
    _c("saved_tokens", "Prompt tokens handed to the tiers to store.", "saved_tokens"),
    _c("lookup_deferred_steps", "Scheduler steps a waiting request sat out because the worker had not answered its "
       "lookup within 10 ms (vLLM asks again the next step).", "lookup_deferred_steps"),
    _c("layerwise_steps", "Layer-wise mode: saves and loads copied layer by layer (staged), and those that fell "
       "back (save: from paged KV after the step; load: recomputed) because vLLM skipped the per-layer hooks.",
       {"layerwise_saves": "save", "layerwise_loads": "load", "layerwise_save_fallbacks": "save_fallback",
        "layerwise_load_fallbacks": "load_fallback"}, "kind"),
    _c("save_failures", "Saves that raised (the prompt is not cached).", "save_failures"),
    _c("consumer_requests", "Consumer requests that came with a producer's promise of stored chunks.",
       "consumer_requests"),
    _c("consumer_short_hits", "Promised requests that found fewer tokens than promised after waiting.",
       "consumer_short_hits"),
    _c("consumer_missing_tokens", "Promised tokens not found after waiting (recomputed).",
       "consumer_missing_tokens"),
    _c("producer_requests_held", "Producer requests whose blocks vLLM kept until their chunks were durable.",
       "producer_requests_held"),
    _c("producer_requests_durable", "Producer requests reported finished once their chunks were written.",
       "producer_requests_durable"),
    _h("lookup_seconds", "Time of one worker lookup (all tiers).", "lookup_s"),
    _h("load_seconds", "Time to load one request's chunks into paged KV.", "load_s"),
    _h("save_seconds", "Time to hand one request's chunks to the tiers (the copy out of paged KV).", "save_s"),
    _h("consumer_wait_seconds", "Time a consumer request waited for promised chunks.", "consumer_wait_s"),
)

#: Internal name -> (family, label value).
ROUTES: dict[str, tuple[Family, str]] = {src: (f, v) for f in FAMILIES for src, v in f.sources.items()}


def samples_from_counters(counters: dict[str, int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Cumulative internal counters as ``/metrics`` samples would read (counters only, no engine labels):
    ``{(sample name, ((label, value), ...)): value}``; the offline fallback's view."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name, n in counters.items():
        route = ROUTES.get(name)
        if route is None or route[0].kind != "counter":
            continue
        fam, value = route
        labels = ((fam.label, value),) if fam.label else ()
        key = (fam.name + "_total", labels)
        out[key] = out.get(key, 0.0) + n
    return out
