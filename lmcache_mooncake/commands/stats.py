"""``lmcache-mooncake stats``: one table of what a running stack's caches did.

Reads each vLLM instance's ``/metrics`` (our ``vllm:lmcm_*`` metrics and vLLM's
external prefix-cache counters, :mod:`lmcache_mooncake.obs.metrics_client`) and,
when the embedded store runs (its state folder), the Mooncake master's
metrics port (capacity, use, keys). Prints, per instance: the external hit
rate, hits and bytes per tier, tokens loaded and saved, cached prompt tokens
by the tier that supplied them (vLLM's ``vllm:prompt_tokens_cached_by_source``),
and the largest failure counts; ``--json`` prints the same as JSON;
``--watch N`` refreshes every N seconds until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lmcache_mooncake.obs.metric_names import PREFIX
from lmcache_mooncake.obs.metrics_client import MetricsSnapshot, fetch, metrics_url
from lmcache_mooncake.runtime.procs import format_bytes

#: ``lmcache-mooncake serve``'s default port.
DEFAULT_URL = "http://127.0.0.1:8000"
TIERS = ("disk", "store")
#: Counters shown as failures, with the label they are split by (if any).
FAILURES = (("verify_failures", "tier"), ("read_errors", "tier"), ("write_errors", "tier"),
            ("store_errors", "kind"), ("load_failures", None), ("save_failures", None),
            ("consumer_short_hits", None))


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser("stats", help=help, description=__doc__.split("\n\n", 1)[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=None, metavar="URL",
                   help=f"a vLLM instance (http://host:port or its /metrics URL); repeat for several "
                        f"(default {DEFAULT_URL}, the port of 'lmcache-mooncake serve'; 'up' prints its ports)")
    p.add_argument("--state-dir", default=None,
                   help="the embedded store's state folder, for its capacity and use (default: the store "
                        "command's default; nothing is shown if no store runs there)")
    p.add_argument("--no-store", action="store_true", help="do not read the store's metrics")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--watch", type=float, default=None, metavar="N", help="refresh every N seconds (Ctrl-C stops)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each URL (default 5)")
    p.set_defaults(run=run)
    return p


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def instance_report(m: MetricsSnapshot) -> dict[str, Any]:
    """Our counters of one instance, grouped for the table."""
    def c(name: str, **labels: str) -> int:
        return m.count(PREFIX + name, **labels)

    tiers = {}
    for t in TIERS:
        hits, misses = c("chunk_hits", tier=t), c("chunk_misses", tier=t)
        tiers[t] = {"lookups": c("tier_lookups", tier=t), "chunk_hits": hits, "chunk_misses": misses,
                    "chunk_hit_rate": _ratio(hits, hits + misses), "chunks_written": c("chunks_written", tier=t),
                    "read_bytes": c("read_bytes", tier=t), "written_bytes": c("written_bytes", tier=t),
                    "evictions": c("evictions", tier=t)}
    failures: dict[str, int] = {}
    for name, label in FAILURES:
        if label is None:
            failures[name] = c(name)
        else:
            for value, n in m.labels(PREFIX + name, label).items():
                failures[f"{name}{{{label}={value}}}"] = int(n)
    queries, hits = m.value("vllm:external_prefix_cache_queries"), m.value("vllm:external_prefix_cache_hits")
    by_source = m.labels("vllm:prompt_tokens_cached_by_source", "source")
    return {
        "lookups": c("lookups"),
        "external_hit_rate": _ratio(hits, queries),
        "lookup_hit_tokens": c("lookup_hit_tokens"),
        "loaded_tokens": c("loaded_tokens"),
        "saved_tokens": c("saved_tokens"),
        "load_seconds_avg": _ratio(m.value(PREFIX + "load_seconds_sum"), m.value(PREFIX + "load_seconds_count")),
        # device: vLLM's own prefix cache; host, disk: our CPU and disk tiers; external_unspecified: the store.
        "cached_tokens_by_source": {k: int(v) for k, v in sorted(by_source.items()) if v},
        "tiers": tiers,
        "failures": dict(sorted(((k, v) for k, v in failures.items() if v), key=lambda kv: -kv[1])),
    }


def store_report(state_dir: str | None, timeout_s: float) -> dict[str, Any] | None:
    """The Mooncake master's capacity, use and keys; None if no embedded store runs in ``state_dir``."""
    from lmcache_mooncake.store.launcher import default_state_dir, read_state

    sd = Path(state_dir or default_state_dir()).expanduser()
    state = read_state(sd)
    if state is None or not state.metrics_port:
        return None
    url = f"http://{state.host}:{state.metrics_port}/metrics"
    try:
        m = fetch(url, timeout_s)
    except OSError as e:
        return {"url": url, "error": str(e)}
    return {"url": url, "capacity_bytes": int(m.value("master_total_capacity_bytes")),
            "used_bytes": int(m.value("master_allocated_bytes")), "keys": int(m.value("master_key_count"))}


def report(urls: list[str], state_dir: str | None, read_store: bool, timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"instances": {}, "store": None}
    for u in urls:
        try:
            out["instances"][metrics_url(u)] = instance_report(fetch(u, timeout_s))
        except OSError as e:
            out["instances"][metrics_url(u)] = {"error": str(e)}
    if read_store:
        out["store"] = store_report(state_dir, timeout_s)
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(rep: dict[str, Any]) -> str:
    """The report as a text table."""
    lines = [f"{'instance':<34} {'hit rate':>8} {'lookups':>8} {'loaded tok':>10} {'saved tok':>10} "
             f"{'disk hits':>9} {'store hits':>10} {'store hit%':>10} {'read':>10} {'written':>10}"]
    failures: list[str] = []
    sources: list[str] = []
    for url, r in rep["instances"].items():
        name = url.removesuffix("/metrics").removeprefix("http://")
        if "error" in r:
            lines.append(f"{name:<34} {r['error']}")
            continue
        t = r["tiers"]
        read = sum(x["read_bytes"] for x in t.values())
        written = sum(x["written_bytes"] for x in t.values())
        lines.append(f"{name:<34} {_pct(r['external_hit_rate']):>8} {r['lookups']:>8} {r['loaded_tokens']:>10} "
                     f"{r['saved_tokens']:>10} {t['disk']['chunk_hits']:>9} {t['store']['chunk_hits']:>10} "
                     f"{_pct(t['store']['chunk_hit_rate']):>10} {format_bytes(read):>10} {format_bytes(written):>10}")
        failures += [f"  {name}: {k} = {v}" for k, v in list(r["failures"].items())[:5]]
        if r["cached_tokens_by_source"]:
            sources.append(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in r["cached_tokens_by_source"].items()))
    if sources:
        lines.append("\ncached prompt tokens by source (device: vLLM's prefix cache, host: CPU tier, disk, "
                     "external_unspecified: the store or unknown):")
        lines += sources
    s = rep.get("store")
    if s is not None:
        if "error" in s:
            lines.append(f"\nstore: {s['error']}")
        else:
            lines.append(f"\nstore ({s['url']}): {format_bytes(s['used_bytes'])} used of "
                         f"{format_bytes(s['capacity_bytes'])} "
                         f"({_pct(_ratio(s['used_bytes'], s['capacity_bytes']))}), {s['keys']} objects")
    lines.append("\nfailures:" if failures else "\nfailures: none")
    lines += failures
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    urls = args.url or [DEFAULT_URL]
    try:
        while True:
            rep = report(urls, args.state_dir, not args.no_store, args.timeout)
            text = json.dumps(rep, indent=2) if args.json else render(rep)
            if args.watch:
                print("\033[2J\033[H" + time.strftime("%H:%M:%S") if sys.stdout.isatty() else "", flush=True)
            print(text, flush=True)
            if not args.watch:
                return 0 if all("error" not in r for r in rep["instances"].values()) else 1
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
