"""Where a cached prompt's time to first token goes, step by step, in a real vLLM server.

A writer server computes one prompt (default 8,193 tokens, Qwen2-0.5B shape,
float32) and stores it to the disk tier and the store. Then, for each mode, a
fresh server is started with ``benchmarks/step_trace`` on its ``PYTHONPATH``
(time stamps of the connector's and vLLM's step calls in the API server, the
engine core and the worker, on the one host-wide monotonic clock) and sent the
prompt once. The script prints each run's timeline and a summary that splits
the TTFT into:

- ``before``: request received until the first scheduler step that asks for it
  (HTTP, tokenisation, the API server to the engine core);
- ``lookup``: that first ask until the step whose ask returns the hit (the
  worker's lookup, and the steps vLLM runs while it is not answered);
- ``to load``: from there until the worker starts loading (the step that
  carries the load to the worker);
- ``load``: ``WorkerSide._load`` (the copy into paged KV, with its reads and checks);
- ``to forward``: load finished until the forward that computes the last token
  starts (the load is reported through ``get_finished`` and a new step scheduled;
  0 for a synchronous load, which runs in the forward's own step);
- ``forward``: that ``execute_model`` (a one-token forward over the whole
  context; in ``plain`` the same forward is the whole of vLLM's work);
- ``after``: the forward's end until the client has the answer.

Modes: ``disk`` (the disk tier, ``verify_on_lookup`` on: the lookup reads and
checks every chunk into the CPU tier, the load copies from there),
``disk-one-pass`` (the lookup only sees the files; the load reads each into
paged KV and checks it there), ``store-shm`` (the store over shared memory),
``plain`` (vLLM with no connector, asked twice: the second request is served by
its own prefix cache, the floor). A mode with ``+sync`` appended (e.g.
``disk-one-pass+sync``) runs the same with ``async_loading: false``: the load
runs in the forward's own step. Each mode runs ``--repeat`` fresh servers;
the summary shows medians. Every server gets both cores
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, as in ``ttft.py``).

    .venv/bin/python benchmarks/step_timeline.py [--tokens 8193] [--modes disk,disk-one-pass,store-shm,plain] [--repeat 2]

About 1 minute per server on 2 cores. Writes ``benchmarks/results/step_timeline.json``.
Not part of ``make bench``: a profiling tool (``docs/performance.md`` lists it under
"How to reproduce").
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ttft import Server, ours, write_config  # noqa: E402

MODES = ("disk", "disk-one-pass", "store-shm", "plain")
#: Mode suffixes: connector settings that override the mode's.
VARIANTS: dict[str, dict] = {"sync": {"async_loading": False}}
PHASES = ("before", "lookup", "to load", "load", "to forward", "forward", "after")


def split_mode(mode: str) -> tuple[str, str]:
    """``"disk+sync"`` -> ``("disk", "sync")``; ``"disk"`` -> ``("disk", "")``."""
    base, _, variant = mode.partition("+")
    return base, variant


def read_events(trace_dir: Path, t0: float, t1: float) -> list[tuple[float, int, str, str, str]]:
    """Trace lines of all processes between ``t0`` and ``t1``, in time order."""
    out = []
    for f in trace_dir.glob("*"):
        for line in f.read_text().splitlines():
            parts = line.split(" ", 4)
            if len(parts) < 4:
                continue
            ts = float(parts[0])
            if t0 <= ts <= t1:
                out.append((ts, int(parts[1]), parts[2], parts[3], parts[4] if len(parts) > 4 else ""))
    return sorted(out)


def spans(events: list) -> list[dict]:
    """Begin/end pairs as ``{name, pid, b, e, result}``, in order of their begin."""
    opened: dict[tuple[int, str], float] = {}
    out = []
    for ts, pid, name, phase, extra in events:
        if phase == "B":
            opened[(pid, name)] = ts
        elif phase == "E" and (pid, name) in opened:
            out.append({"name": name, "pid": pid, "b": opened.pop((pid, name)), "e": ts, "result": extra})
        elif phase == "I":
            out.append({"name": name, "pid": pid, "b": ts, "e": ts, "result": extra})
    return sorted(out, key=lambda s: s["b"])


def summarize(sp: list[dict], t0: float, t1: float) -> dict[str, float]:
    """The phases of one request's TTFT (see the module docstring), in seconds."""
    asks = [s for s in sp if s["name"] == "SchedulerSide.get_num_new_matched_tokens"]
    hit = next((s for s in asks if not s["result"].startswith("(None")), None)
    load = next((s for s in sp if s["name"] == "WorkerSide._load"), None)
    steps = [s for s in sp if s["name"] == "GPUModelRunner.execute_model"]
    first_sched = next((s for s in sp if s["name"] == "Scheduler.schedule"), None)
    inside = None  # a synchronous load runs in the step of the forward, before it
    if load is not None:
        # The step that ran the load also ran the forward when it went on >10 ms past the load
        # (an idle step ends within a millisecond of its load).
        inside = next((s for s in steps if s["b"] <= load["b"] and s["e"] > load["e"] + 0.01), None)
        fwd = inside or next((s for s in steps if s["b"] >= load["e"]), None)
    else:
        fwd = max(steps, key=lambda s: s["e"] - s["b"], default=None)
    if fwd is None:
        raise RuntimeError("no forward step in the trace: is the tracer on PYTHONPATH?")
    out = {"ttft": t1 - t0, "forward": fwd["e"] - (load["e"] if inside else fwd["b"]), "after": t1 - fwd["e"]}
    if load is None:  # plain: the request goes straight to its forward
        out["before"] = fwd["b"] - t0
        return out
    start = asks[0]["b"] if asks else (first_sched["b"] if first_sched else t0)
    out.update(before=start - t0, lookup=hit["e"] - start if hit else 0.0,
               load=load["e"] - load["b"], **{"to forward": 0.0 if inside else fwd["b"] - load["e"]})
    out["to load"] = load["b"] - (hit["e"] if hit else start)
    return out


def print_timeline(sp: list[dict], t0: float) -> None:
    for s in sp:
        if s["name"] == "threads":
            print(f"    {'':>18s} threads in the step (pid/tid/name:cpu ms:run-queue ms): "
                  + "  ".join(s["result"].split(";")[:6]))
            continue
        if s["e"] - s["b"] < 0.0005 and s["name"] != "WorkerSide.get_finished":
            continue
        print(f"    {(s['b'] - t0) * 1e3:7.1f} .. {(s['e'] - t0) * 1e3:7.1f} ms  {s['name']:42s} "
              f"{(s['e'] - s['b']) * 1e3:7.2f} ms  {s['result'][:80]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8193, help="prompt length (default 8,193: one past a block)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {','.join(MODES)}")
    ap.add_argument("--repeat", type=int, default=2, help="fresh servers per mode (medians are reported)")
    ap.add_argument("--quiet", action="store_true", help="the summary only, no per-run timelines")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "step_timeline.json")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(m for m in modes if split_mode(m) not in
                     {(b, v) for b in MODES for v in ("", *VARIANTS) if not (b == "plain" and v)})
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}, each but plain "
                 f"optionally with {' or '.join('+' + v for v in VARIANTS)}")

    from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
    from lmcache_mooncake.testing.models import ModelSpec, build_model

    model = str(build_model(ModelSpec(arch="qwen2", size="0.5b", seed=0, max_position_embeddings=16384)))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompt = [rng.randrange(10, vocab - 10) for _ in range(args.tokens)]
    max_len = args.tokens + 64
    work = Path(tempfile.mkdtemp(prefix="step-timeline-"))
    store_dir, disk, trace_root = work / "store", work / "disk", work / "trace"
    shm = {"master_address": "auto", "metadata_server": "auto", "store_dir": str(store_dir)}
    configs = {
        "disk": write_config(work / "disk.yaml", disk=disk, store=None),
        "disk-one-pass": write_config(work / "one-pass.yaml", disk=disk, store=None, verify_on_lookup=False),
        "store-shm": write_config(work / "shm.yaml", disk=None, store=shm),
    }
    runs: list[dict] = []
    start_store(StoreSpec(state_dir=store_dir, memory_bytes=2 << 30))
    try:
        if any(split_mode(m)[0] != "plain" for m in modes):
            w = Server("writer", model, work, ours(write_config(work / "all.yaml", disk=disk, store=shm)), False,
                       max_len)
            print(f"writer: {args.tokens} tokens computed and stored in {w.ttft(prompt)[0]:.1f} s", flush=True)
            w.stop()
        for rep in range(args.repeat):
            for mode in modes:  # alternating, so drift in the machine hits every mode alike
                trace = trace_root / f"{mode}-{rep}"
                env = {"PYTHONPATH": str(HERE / "step_trace"), "STEP_TRACE_DIR": str(trace)}
                base, variant = split_mode(mode)
                plain = base == "plain"
                s = Server(f"{mode}-{rep}", model, work,
                           None if plain else ours(configs[base], **VARIANTS.get(variant, {})), plain, max_len,
                           env=env)
                try:
                    if plain:
                        s.ttft(prompt)  # computed; the request below is vLLM's own prefix-cache hit
                    time.sleep(2)
                    t0 = time.monotonic()
                    ttft, cached = s.ttft(prompt)
                    t1 = time.monotonic()
                    time.sleep(0.5)
                finally:
                    s.stop()
                sp = spans(read_events(trace, t0, t1))
                summary = summarize(sp, t0, t1)
                runs.append({"mode": mode, "cached": cached, "phases_s": summary, "spans": sp, "t0": t0})
                if not args.quiet:
                    print(f"\n{mode} (server {rep + 1}): TTFT {ttft * 1e3:.1f} ms, {cached} tokens cached")
                    print_timeline(sp, t0)
    finally:
        stop_store(store_dir)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.tokens} tokens; medians of {args.repeat} fresh servers per mode, ms")
    print(f"{'mode':20s} {'TTFT':>7s} " + " ".join(f"{p:>10s}" for p in PHASES))
    table = {}
    for mode in modes:
        rs = [r["phases_s"] for r in runs if r["mode"] == mode]
        med = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in ("ttft", *PHASES)}
        table[mode] = med
        print(f"{mode:20s} {med['ttft'] * 1e3:7.1f} " + " ".join(
            f"{med[p] * 1e3:10.1f}" if any(p in r for r in rs) else f"{'-':>10s}" for p in PHASES))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"tokens": args.tokens, "medians_s": table, "runs": runs}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
