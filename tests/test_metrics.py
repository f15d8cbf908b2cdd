"""Our counters as vLLM connector stats and Prometheus metrics, read back by metrics_client (no vLLM started)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lmcache_mooncake.obs.kv_events import ChunkEvents, KVEventLog
from lmcache_mooncake.obs.metric_names import FAMILIES, ROUTES
from lmcache_mooncake.obs.metrics import LMCacheMooncakePromMetrics, LMCacheMooncakeStats
from lmcache_mooncake.obs.metrics_client import MetricsSnapshot, parse, read_offline
from lmcache_mooncake.obs.stats import Stats

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def test_take_returns_increases_since_the_last_take():
    s = Stats()
    cumulative = {"reconnects": 2}
    s.register("store_client_", lambda: dict(cumulative))
    s.add("loaded_tokens", 5)
    s.observe("load_s", 0.25)
    first = s.take()
    assert first == {"counters": {"loaded_tokens": 5, "store_client_reconnects": 2}, "samples": {"load_s": [0.25]}}
    assert s.take() == {"counters": {}, "samples": {}}
    s.add("loaded_tokens", 3)
    cumulative["reconnects"] = 3
    assert s.take()["counters"] == {"loaded_tokens": 3, "store_client_reconnects": 1}
    assert s.snapshot()["loaded_tokens"] == 8  # the offline dump stays cumulative


def test_stats_aggregate_reduce_and_empty():
    a = LMCacheMooncakeStats(data={"counters": {"store_hits": 2}, "samples": {"load_s": [0.1]}})
    b = LMCacheMooncakeStats(data={"counters": {"store_hits": 1, "lookups": 4}, "samples": {"load_s": [0.3]}})
    merged = a.aggregate(b)
    assert merged.data == {"counters": {"store_hits": 3, "lookups": 4}, "samples": {"load_s": [0.1, 0.3]}}
    assert merged.reduce() == {"lookups": 4, "store_hits": 3, "load_count": 2, "load_avg_ms": 200.0}
    assert not merged.is_empty()
    assert LMCacheMooncakeStats().is_empty()
    assert LMCacheMooncakeStats(data={"counters": {"x": 0}, "samples": {}}).is_empty()


class _Config:
    kv_transfer_config = None


def _prom(registry: CollectorRegistry) -> LMCacheMooncakePromMetrics:
    def bound(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(
            self, *a, registry=registry, **kw)})

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    return LMCacheMooncakePromMetrics(_Config(), types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})


def test_prometheus_metrics_add_increases_per_engine_and_tier():
    registry = CollectorRegistry()
    prom = _prom(registry)
    prom.observe({"counters": {"store_hits": 3, "disk_hits": 1, "loaded_tokens": 700, "unknown": 9},
                  "samples": {"load_s": [0.02, 0.04]}}, engine_idx=0)
    prom.observe({"counters": {"store_hits": 2}, "samples": {}}, engine_idx=1)
    m = parse(generate_latest(registry).decode())
    assert m.count("vllm:lmcm_chunk_hits", tier="store") == 5
    assert m.count("vllm:lmcm_chunk_hits", tier="store", engine="0") == 3
    assert m.count("vllm:lmcm_chunk_hits", tier="disk") == 1
    assert m.count("vllm:lmcm_loaded_tokens") == 700
    assert m.count("vllm:lmcm_load_seconds_count") == 2
    assert m.value("vllm:lmcm_load_seconds_sum") == pytest.approx(0.06)
    assert m.labels("vllm:lmcm_chunk_hits", "tier") == {"disk": 1.0, "store": 5.0}
    # Every metric is exposed (at zero) before anything happened.
    for fam in FAMILIES:
        assert fam.name + ("_total" if fam.kind == "counter" else "_count") in m.names(), fam.name


def test_every_internal_counter_name_feeds_one_metric():
    names = [src for fam in FAMILIES for src in fam.sources]
    assert len(names) == len(set(names)) == len(ROUTES)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert all(re.fullmatch(r"vllm:lmcm_[a-z_]+", f.name) for f in FAMILIES)


def test_every_metric_is_documented():
    text = DOCS.read_text()
    missing = [f.name for f in FAMILIES if f"`{f.name}" not in text]
    assert not missing, f"add these metrics to {DOCS}: {missing}"


def test_offline_runs_read_back_under_the_same_names(tmp_path):
    s = Stats()
    s.add("store_puts", 3)
    s.add("disk_writes", 2)
    s.add("store_client_timeouts")
    s.dump(tmp_path / "stats-rank0.json", force=True)
    other = Stats()
    other.add("consumer_requests", 4)
    other.dump(tmp_path / "stats-scheduler.json", force=True)
    m = read_offline(tmp_path)
    assert m.count("vllm:lmcm_chunks_written", tier="store") == 3
    assert m.count("vllm:lmcm_chunks_written") == 5
    assert m.count("vllm:lmcm_store_errors", kind="timeout") == 1
    assert m.count("vllm:lmcm_consumer_requests_total") == 4
    assert read_offline(tmp_path / "none").count("vllm:lmcm_chunks_written") == 0


def test_snapshots_add_up():
    a = parse('# TYPE x counter\nx_total{tier="disk"} 2\n')
    b = parse('# TYPE x counter\nx_total{tier="disk"} 3\nx_total{tier="store"} 1\n')
    assert (a + b).count("x", tier="disk") == 5 and (a + b).count("x") == 6
    assert MetricsSnapshot().count("x") == 0


def test_kv_event_log_and_container():
    log = KVEventLog()
    log.stored([b"\1" * 32, b"\2" * 32], None, list(range(300)), 256, None)
    log.stored([], None, [], 256, None)  # nothing stored: no event
    log.removed([b"\1" * 32], "disk")
    events = log.take()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == [b"\1" * 32, b"\2" * 32] and events[0].medium == "lmcm"
    assert events[1].medium == "lmcm_disk" and log.take() == []
    box = ChunkEvents(events[:1])
    box.add_events(events[1:])
    box.increment_workers()
    assert box.get_all_events() == events and box.get_number_of_workers() == 2
    box.clear_events()
    assert box.get_all_events() == []


METRICS_TEXT = """\
# TYPE vllm:lmcm_chunk_hits counter
vllm:lmcm_chunk_hits_total{engine="0",model_name="m",tier="store"} 6
vllm:lmcm_chunk_hits_total{engine="0",model_name="m",tier="disk"} 1
# TYPE vllm:lmcm_chunk_misses counter
vllm:lmcm_chunk_misses_total{engine="0",model_name="m",tier="store"} 2
# TYPE vllm:lmcm_loaded_tokens counter
vllm:lmcm_loaded_tokens_total{engine="0",model_name="m"} 1500
# TYPE vllm:lmcm_verify_failures counter
vllm:lmcm_verify_failures_total{engine="0",model_name="m",tier="disk"} 3
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 2000
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1500
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 1000
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_unspecified"} 500
"""


@pytest.fixture
def instance():
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = METRICS_TEXT.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_stats_report_and_table(instance):
    from lmcache_mooncake.commands.stats import render, report

    rep = report([instance, "http://127.0.0.1:9"], None, read_store=False, timeout_s=2)
    r = rep["instances"][instance + "/metrics"]
    assert r["external_hit_rate"] == 0.75 and r["loaded_tokens"] == 1500
    assert r["tiers"]["store"]["chunk_hits"] == 6 and r["tiers"]["store"]["chunk_hit_rate"] == 0.75
    assert r["failures"] == {"verify_failures{tier=disk}": 3}
    assert r["cached_tokens_by_source"] == {"external_unspecified": 500, "host": 1000}
    assert "could not read metrics from http://127.0.0.1:9/metrics" in rep["instances"]["http://127.0.0.1:9/metrics"]["error"]
    table = render(rep)
    assert "75.0%" in table and "verify_failures{tier=disk} = 3" in table and "127.0.0.1:9 " in table
    assert "external_unspecified 500, host 1000" in table


def test_up_demo_names_the_tier_that_served():
    from lmcache_mooncake.commands.up import _tier

    zero = parse(METRICS_TEXT.replace(" 6\n", " 0\n").replace(" 1500\n", " 0\n"))
    full = parse(METRICS_TEXT)
    assert _tier(zero, full, cached=1499) == "Mooncake store"
    assert _tier(parse(METRICS_TEXT.replace(" 1500\n", " 0\n")), full, cached=1499) == "CPU tier"
    assert _tier(full, full, cached=1499) == "vLLM prefix cache"
    assert _tier(full, full, cached=0) == "-"
