"""Serving throughput and latency with vLLM's own benchmark client, in one run on one model.

The client is vLLM's (``vllm bench serve``, through
:mod:`lmcache_mooncake.testing.bench_client`): its datasets, its streamed
``/v1/completions`` requests at a Poisson ``--request-rate``, its metrics. The
setups, each started fresh (so none finds what another cached), on the
generated Llama of ``--size``, ``--dtype float32`` and
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` for all, 1 GiB of vLLM KV cache each:

- ``plain vLLM``: one vLLM OpenAI server, vLLM's prefix cache on, both cores.
- ``vLLM + connector``: the same with our connector (``kv_both``, CPU tier and a
  disk folder, no store), vLLM's prefix cache on as vLLM sets it by default.
- ``up 1P+1D``: ``lmcache-mooncake up``: the store, 1 prefill and 1 decode vLLM
  (a core each) and the proxy (prefix routing, direct decode).
- ``up 1P+2D`` (``--with-2-decode``): ``up --prefill 1 --decode 2``; on 2 cores the
  three instances share them.
- ``up 1P+1D, D saves`` (``up-ds``): ``up --decode-saves`` (decode instances also save
  the prompt tokens they compute) with the proxy's ``--direct-decode-max-uncached
  512`` (straight to decode while at most two chunks are missing, not one): the
  settings for conversations, whose new turns the decode instance then computes and
  saves for the turn after.

Workloads (the same ``--seed`` for every setup; ``--num-prompts`` each):

- ``prefix_repetition``: vLLM's dataset, ``--prefixes`` shared prefixes of
  ``--prefix-len`` tokens, each with its own ``--suffix-len``-token suffixes.
- ``random``: vLLM's random dataset of prompts as long (prefix + suffix), no sharing.
- ``multi-turn chat``: vLLM's ``custom`` dataset from a JSONL this script writes:
  ``--chat-conversations`` conversations of ``--chat-turns`` turns, rendered with the
  model's chat template; each turn's prompt is the previous turn's, its (fixed)
  assistant answer and a new user message of ``--chat-message-tokens`` tokens.
  Ordered turn by turn (turn 1 of every conversation, then turn 2, ...), unshuffled.
- ``chat after restart`` (``chat-restart``; plain vLLM and the connector only): other
  conversations of the same shape; the first half of the turns is sent, the server
  is stopped and started again (the connector keeps its disk folder), and the rest
  of the turns is measured: plain vLLM recomputes each conversation, the connector
  loads it from disk. The ``up`` setups skip it (restarting ``up`` restarts its store).

Setups only named with ``--setups``, to find out where a difference comes from:
``connector-load`` (the connector as ``kv_consumer``: lookups and loads, no
saves), ``connector-cpu`` (CPU tier only, no disk). ``--repeat N``
runs the setups N times in turn, each on a fresh server, so that a difference can
be told from the noise of single 16-request cells; ``--proxy-arg`` passes an
argument to the proxy of the ``up`` setups.

Every request asks for ``--output-len`` tokens with ``--ignore-eos``. Per setup and
workload: request throughput, output tokens/s, TTFT and TPOT p50/p90/p99 (ms),
failed requests, and goodput (requests/s) at the TTFT SLO alone, the TPOT SLO alone
and both (vLLM's own ``--goodput ttft:MS tpot:MS``); for ``up``, how many requests the
proxy sent straight to decode (the store held the prompt) and how many via prefill. Writes
``benchmarks/results/serving.json`` (and vLLM's raw result per run in the work
folder) and ``benchmarks/results/serving.png``; exits 1 if a setup did not start
or a request failed.

    flock /tmp/work/heavy.lock .venv/bin/python benchmarks/serving.py                 # the full run
    flock /tmp/work/heavy.lock .venv/bin/python benchmarks/serving.py --num-prompts 4 \\
        --workloads random --setups plain --json /tmp/serving-smoke.json            # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from ttft import Server, ours, write_config

from lmcache_mooncake.testing.bench_client import BenchClientError, ClientRun, goodput_per_slo, run_client
from lmcache_mooncake.testing.models import ModelSpec, build_model
from lmcache_mooncake.testing.up_stack import UpSpec, up_stack

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MAX_MODEL_LEN = 4096

SETUPS = {"plain": "plain vLLM", "connector": "vLLM + connector", "up": "up 1P+1D", "up-2d": "up 1P+2D",
          "up-ds": "up 1P+1D, D saves",
          # Not in make bench; for finding out where a difference comes from:
          "connector-load": "vLLM + connector, loads only", "connector-cpu": "vLLM + connector, CPU tier only"}
#: ``up-ds``: decode instances save what they compute, and the proxy sends a request straight to
#: decode while at most two chunks of it are missing (a conversation's new turn), not one.
UP_DS_PROXY_ARGS = ("--direct-decode-max-uncached=512",)
WORKLOADS = {"prefix": "prefix_repetition", "random": "random", "chat": "multi-turn chat",
             "chat-restart": "chat after restart"}
UP_SETUPS = ("up", "up-2d", "up-ds")


@dataclass
class Row:
    """One setup x workload: vLLM's figures, and what it could not run (``note``)."""

    setup: str
    workload: str
    num_prompts: int
    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    ttft_ms: dict[str, float] = field(default_factory=dict)  # p50, p90, p99
    tpot_ms: dict[str, float] = field(default_factory=dict)
    #: Requests/s that met the TTFT SLO alone, the TPOT SLO alone, and both (vLLM's goodput).
    goodput: dict[str, float] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    #: The proxy's /stats counters this run added (``up`` setups): requests sent straight to decode, via prefill.
    proxy: dict[str, int] = field(default_factory=dict)
    raw: str = ""  # vLLM's result JSON of this run
    note: str = ""


@dataclass
class Run:
    model: str
    date: str
    settings: dict[str, Any]
    slo_ms: dict[str, float]
    rows: list[Row] = field(default_factory=list)


# -- workloads --------------------------------------------------------------------------------


def chat_jsonl(path: Path, model: str, conversations: int, turns: int, first_tokens: int, message_tokens: int,
               answer_tokens: int, seed: int) -> list[str]:
    """Write the multi-turn JSONL (one ``{"prompt": ...}`` per line, turn by turn); returns the lines."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    words = [w for w in (tok.decode([i]).strip() for i in range(tok.vocab_size)) if w.isalpha() and len(w) > 1]

    def message(n_tokens: int) -> str:
        out: list[str] = []
        while len(tok(" ".join(out), add_special_tokens=False).input_ids) < n_tokens:
            out += [rng.choice(words) for _ in range(8)]
        return " ".join(out)

    chats = [[{"role": "user", "content": message(first_tokens)}] for _ in range(conversations)]
    answer = " ".join(["ok"] * answer_tokens)
    lines = []
    for turn in range(turns):
        for c in chats:
            if turn:
                c += [{"role": "assistant", "content": answer}, {"role": "user", "content": message(message_tokens)}]
            text = tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            lines.append(json.dumps({"prompt": text.removeprefix(tok.bos_token or "")}))
    path.write_text("\n".join(lines) + "\n")
    return lines


def workload_args(name: str, args: argparse.Namespace, chat_file: Path) -> tuple[list[str], int]:
    """``vllm bench serve`` dataset arguments of workload ``name`` and its prompt count."""
    if name == "prefix":
        return (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                 "--prefix-repetition-suffix-len", str(args.suffix_len),
                 "--prefix-repetition-num-prefixes", str(args.prefixes),
                 "--prefix-repetition-output-len", str(args.output_len)], args.num_prompts)
    if name == "random":
        return (["--dataset-name", "random", "--random-input-len", str(args.prefix_len + args.suffix_len),
                 "--random-output-len", str(args.output_len)], args.num_prompts)
    return custom_args(chat_file, args.output_len), args.chat_conversations * args.chat_turns


def custom_args(path: Path, output_len: int) -> list[str]:
    """vLLM's ``custom`` dataset of a JSONL of rendered prompts, in file order."""
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template",
            "--disable-shuffle", "--custom-output-len", str(output_len)]


# -- setups -----------------------------------------------------------------------------------


def warm(url: str, model: str) -> None:
    """One throwaway request: a fresh vLLM's first forward pass pays one-off costs."""
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": [11, 12, 13, 14, 15, 16, 17, 18] * 4,
                                                  "max_tokens": 2}, timeout=300)
    r.raise_for_status()


@contextlib.contextmanager
def plain_server(name: str, model: str, work: Path, kv: dict[str, Any] | None) -> Iterator[str]:
    s = Server(name, model, work, kv, True, MAX_MODEL_LEN, wait=False)
    try:
        s.wait_ready(warm=False)
        warm(s.url, model)
        yield s.url
    finally:
        s.stop(grace_s=15)


@contextlib.contextmanager
def up_setup(name: str, model: str, work: Path, decode: int, decode_saves: bool = False,
             proxy_args: tuple[str, ...] = ()) -> Iterator[str]:
    spec = UpSpec(model=model, work=work / name, decode=decode, store_memory="2GiB", decode_saves=decode_saves,
                  proxy_args=list(proxy_args),
                  vllm_args=["--dtype=float32", f"--max-model-len={MAX_MODEL_LEN}", "--seed=0"], stop_grace_s=30)
    with up_stack(spec) as stack:
        warm(stack.url, model)
        yield stack.url


def setup_factory(key: str, model: str, work: Path,
                  proxy_args: tuple[str, ...] = ()) -> Callable[[], contextlib.AbstractContextManager[str]]:
    if key == "plain":
        return lambda: plain_server("plain", model, work, None)
    if key in ("connector", "connector-load", "connector-cpu"):
        # A fresh disk folder per start: a repeat must not find the last run's chunks.
        disk = None if key == "connector-cpu" else work / f"{key}-disk-{time.monotonic_ns()}"
        cfg = write_config(work / f"{key}.yaml", disk=disk, store=None, cpu_gib=1.0)
        role = "kv_consumer" if key == "connector-load" else "kv_both"
        return lambda: plain_server(key, model, work, ours(cfg, role, run_dir=str(work / key / "run")))
    if key == "up-ds":
        given = any(a.startswith("--direct-decode-max-uncached") for a in proxy_args)
        return lambda: up_setup(key, model, work, decode=1, decode_saves=True,
                                proxy_args=proxy_args if given else (*UP_DS_PROXY_ARGS, *proxy_args))
    return lambda: up_setup(key, model, work, decode=2 if key == "up-2d" else 1, proxy_args=proxy_args)


def proxy_stats(url: str) -> dict[str, int]:
    """The proxy's counters (``GET /stats``); ``{}`` where there is no proxy (a plain vLLM answers 404)."""
    r = httpx.get(f"{url}/stats", timeout=10)
    return r.json() if r.status_code == 200 else {}


# -- the run ----------------------------------------------------------------------------------


def row_from(setup: str, workload: str, n: int, result: dict[str, Any], raw: Path, slo_ms: dict[str, float]) -> Row:
    pct = ("p50", "p90", "p99")
    per = goodput_per_slo(result, slo_ms)
    return Row(setup, workload, n, completed=result["completed"], failed=result["failed"],
               duration_s=result["duration"], request_throughput=result["request_throughput"],
               output_throughput=result["output_throughput"],
               ttft_ms={p: result.get(f"{p}_ttft_ms", math.nan) for p in pct},
               tpot_ms={p: result.get(f"{p}_tpot_ms", math.nan) for p in pct},
               goodput={"ttft": per.get("ttft", math.nan), "tpot": per.get("tpot", math.nan),
                        "both": result.get("request_goodput") or 0.0},
               input_tokens=result["total_input_tokens"], output_tokens=result["total_output_tokens"], raw=str(raw))


def client_row(name: str, key: str, w: str, url: str, model: str, dataset: tuple[list[str], int], where: Path,
               args: argparse.Namespace, slo_ms: dict[str, float]) -> Row:
    """One ``vllm bench serve`` run of ``dataset`` against ``url``: its row (a failed client run: a row with
    every request failed and the client's error as its note)."""
    label = WORKLOADS.get(w, w)
    (ds_args, n), raw = dataset, where / "raw" / f"{key}-{w}.json"
    crun = ClientRun(url, model, ds_args, n, raw, seed=args.seed, request_rate=args.request_rate,
                     goodput_ms=slo_ms, timeout_s=600)
    before = proxy_stats(url)
    try:
        result = run_client(crun, where / "raw" / f"{key}-{w}.log")
    except BenchClientError as e:
        print(f"  {name} / {label}: {e}", flush=True)
        return Row(name, label, n, failed=n, note=f"client: {str(e)[:300]}")
    row = row_from(name, label, n, result, raw, slo_ms)
    if before:
        after = proxy_stats(url)
        row.proxy = {k: after[k] - before[k] for k in ("direct_decode", "via_prefill")}
    print(f"  {row.setup:18s} {row.workload:18s} {row.completed}/{n} ok, {row.request_throughput:.2f} "
          f"req/s, {row.output_throughput:.1f} tok/s, TTFT p50 {row.ttft_ms['p50']:.0f} ms, "
          f"TPOT p50 {row.tpot_ms['p50']:.1f} ms", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "0.5b"], help="generated Llama (default small)")
    ap.add_argument("--setups", default="plain,connector,up,up-ds",
                    help=f"comma-separated, from {','.join(SETUPS)} (default plain,connector,up,up-ds)")
    ap.add_argument("--with-2-decode", action="store_true", help="add up-2d: up --prefill 1 --decode 2")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {','.join(WORKLOADS)}")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts of prefix_repetition and random (default 16)")
    ap.add_argument("--request-rate", type=float, default=2.0, help="requests/s, Poisson (default 2)")
    ap.add_argument("--prefixes", type=int, default=4, help="prefix_repetition: shared prefixes (default 4)")
    ap.add_argument("--prefix-len", type=int, default=1024, help="prefix_repetition: prefix tokens (default 1024)")
    ap.add_argument("--suffix-len", type=int, default=128, help="prefix_repetition: suffix tokens (default 128)")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens of every request (default 16)")
    ap.add_argument("--chat-conversations", type=int, default=4, help="multi-turn chat: conversations (default 4)")
    ap.add_argument("--chat-turns", type=int, default=4, help="multi-turn chat: turns each (default 4)")
    ap.add_argument("--chat-first-tokens", type=int, default=512, help="multi-turn chat: first message (default 512)")
    ap.add_argument("--chat-message-tokens", type=int, default=128,
                    help="multi-turn chat: each later user message (default 128)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO of goodput (default 1000 ms)")
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT SLO of goodput (default 100 ms)")
    ap.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the proxy of the up setups (repeat), as up's own --proxy-arg, "
                    "e.g. --proxy-arg=--direct-decode-max-uncached=512")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the setups this many times, in turn (a fresh server each time; rows named "
                    "'SETUP (run K)'): single 16-request cells are noisy, compare repeats (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=RESULTS / "serving.json", help="result (the plot: same name, .png)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temp folder)")
    ap.add_argument("--replot", type=Path, default=None, help="print the table and redraw the plot of a result")
    args = ap.parse_args(argv)
    if args.replot:
        run = load(args.replot)
        print_table(run)
        plot(run, args.replot.with_suffix(".png"))
        return 0
    setups = [s for s in args.setups.split(",") if s] + (["up-2d"] if args.with_2_decode else [])
    workloads = [w for w in args.workloads.split(",") if w]
    for what, names, known in (("--setups", setups, SETUPS), ("--workloads", workloads, WORKLOADS)):
        if unknown := sorted(set(names) - set(known)):
            ap.error(f"{what}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.num_prompts < args.prefixes and "prefix" in workloads:
        ap.error(f"--num-prompts {args.num_prompts} is below --prefixes {args.prefixes}: vLLM's prefix_repetition "
                 "needs at least one prompt per prefix")

    model = str(build_model(ModelSpec(arch="llama", size=args.size, seed=0)))
    work = args.work or Path(tempfile.mkdtemp(prefix="lmcm-bench-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    chat_file = work / "multi_turn_chat.jsonl"
    if "chat" in workloads:
        chat_jsonl(chat_file, model, args.chat_conversations, args.chat_turns, args.chat_first_tokens,
                   args.chat_message_tokens, args.output_len, args.seed)
    chat_restart = (([], 0), ([], 0))
    if "chat-restart" in workloads:
        # Other conversations than chat's (seed + 1): the tiers hold nothing of them before.
        lines = chat_jsonl(work / "chat_restart.jsonl", model, args.chat_conversations, args.chat_turns,
                           args.chat_first_tokens, args.chat_message_tokens, args.output_len, args.seed + 1)
        cut = args.chat_conversations * (args.chat_turns // 2)
        parts = (work / "chat_restart_before.jsonl", work / "chat_restart_after.jsonl")
        parts[0].write_text("\n".join(lines[:cut]) + "\n")
        parts[1].write_text("\n".join(lines[cut:]) + "\n")
        chat_restart = tuple((custom_args(f, args.output_len), n) for f, n in zip(parts, (cut, len(lines) - cut),
                                                                                 strict=True))
    slo_ms = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    run = Run(model=model, date=time.strftime("%Y-%m-%d %H:%M:%S"), slo_ms=slo_ms,
              settings={k: v for k, v in vars(args).items() if k not in ("json", "work", "replot")}
              | {"setups": setups, "workloads": workloads})
    print(f"model {model}\nwork folder {work}", flush=True)
    ok = True
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: at least 1")
    for rep, key in ((rep, key) for rep in range(args.repeat) for key in setups):
        name = SETUPS[key] + (f" (run {rep + 1})" if args.repeat > 1 else "")
        t0 = time.monotonic()
        where = work / f"run{rep + 1}" if args.repeat > 1 else work  # each repeat's own logs and tiers
        factory = setup_factory(key, model, where, tuple(args.proxy_arg))
        try:
            with contextlib.ExitStack() as server:
                url = server.enter_context(factory())
                print(f"{name} ready at {url} in {time.monotonic() - t0:.0f} s", flush=True)
                for w in workloads:
                    if w == "chat-restart":
                        if key in UP_SETUPS:
                            continue  # restarting up restarts its store: nothing would survive
                        # The first half of the turns, a restart (the same tiers), then the turns measured.
                        first = client_row(name, key, w + "-1", url, model, chat_restart[0], where, args, slo_ms)
                        if first.failed or first.note:
                            ok = False
                            run.rows.append(first)
                            continue
                        server.close()
                        url = server.enter_context(factory())
                        print(f"  {name} restarted for the rest of the turns", flush=True)
                    dataset = chat_restart[1] if w == "chat-restart" else workload_args(w, args, chat_file)
                    row = client_row(name, key, w, url, model, dataset, where, args, slo_ms)
                    ok &= row.failed == 0 and not row.note
                    run.rows.append(row)
        except RuntimeError as e:  # did not start: a finding, recorded; the other setups go on
            ok = False
            print(f"{name} failed: {str(e)[:1500]}", flush=True)
            run.rows += [Row(name, WORKLOADS[w], 0, note=f"did not start: {str(e)[:300]}") for w in workloads]
        print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(asdict(run), indent=2))
    print_table(run)
    plot(run, args.json.with_suffix(".png"))
    print(f"\nwrote {args.json} and {args.json.with_suffix('.png')}")
    return 0 if ok else 1


def load(path: Path) -> Run:
    data = json.loads(path.read_text())
    return Run(**{**data, "rows": [Row(**r) for r in data["rows"]]})


def print_table(run: Run) -> None:
    slo = run.slo_ms
    print(f"\nvllm bench serve, {run.settings.get('request_rate')} req/s; goodput in req/s at TTFT <= "
          f"{slo['ttft']:g} ms, TPOT <= {slo['tpot']:g} ms, both")
    print(f"{'setup':18s} {'workload':18s} {'ok':>5s} {'fail':>4s} {'req/s':>6s} {'tok/s':>7s} "
          f"{'TTFT p50/p90/p99 ms':>20s} {'TPOT p50/p90/p99 ms':>20s} {'goodput ttft/tpot/both':>23s}")
    for r in run.rows:
        if r.note and not r.completed:
            print(f"{r.setup:18s} {r.workload:18s} {r.note[:100]}")
            continue
        ttft = "/".join(f"{r.ttft_ms[p]:.0f}" for p in ("p50", "p90", "p99"))
        tpot = "/".join(f"{r.tpot_ms[p]:.1f}" for p in ("p50", "p90", "p99"))
        good = "/".join(f"{r.goodput[k]:.2f}" for k in ("ttft", "tpot", "both"))
        print(f"{r.setup:18s} {r.workload:18s} {r.completed:5d} {r.failed:4d} {r.request_throughput:6.2f} "
              f"{r.output_throughput:7.1f} {ttft:>20s} {tpot:>20s} {good:>23s}"
              + (f"  (prefill skipped {r.proxy['direct_decode']}, via prefill {r.proxy['via_prefill']})"
                 if r.proxy else ""))


def plot(run: Run, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    rows = [r for r in run.rows if r.completed]
    if not rows:
        print("no completed run: no plot")
        return
    setups = list(dict.fromkeys(r.setup for r in rows))
    workloads = list(dict.fromkeys(r.workload for r in rows))
    colors = plt.get_cmap("tab10").colors
    width = 0.8 / len(setups)
    panels = [("request throughput (req/s)", lambda r: (r.request_throughput, None)),
              ("output throughput (tokens/s)", lambda r: (r.output_throughput, None)),
              ("TTFT (ms): p50 bar, p90 and p99 marks", lambda r: (r.ttft_ms["p50"], (r.ttft_ms["p90"], r.ttft_ms["p99"]))),
              ("TPOT (ms): p50 bar, p90 and p99 marks", lambda r: (r.tpot_ms["p50"], (r.tpot_ms["p90"], r.tpot_ms["p99"]))),
              (f"goodput (req/s), TTFT <= {run.slo_ms['ttft']:g} ms and TPOT <= {run.slo_ms['tpot']:g} ms",
               lambda r: (r.goodput["both"], None))]
    fig, grid = plt.subplots(2, 3, figsize=(14, 8))
    axes = list(grid.flat)
    axes[-1].axis("off")
    for ax, (title, get) in zip(axes, panels, strict=False):
        for i, s in enumerate(setups):
            xs, ys, marks = [], [], []
            for j, w in enumerate(workloads):
                r = next((r for r in rows if r.setup == s and r.workload == w), None)
                if r is None:
                    continue
                y, m = get(r)
                xs.append(j + i * width)
                ys.append(y)
                marks.append(m)
            ax.bar(xs, ys, width, label=s, color=colors[i % len(colors)])
            for x, m in zip(xs, marks, strict=True):
                if m:
                    ax.plot([x, x], [m[0], m[1]], color="black", lw=1)
                    ax.plot([x], [m[0]], "k_", ms=8)
                    ax.plot([x], [m[1]], "kv", ms=4)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[-1].legend(*axes[0].get_legend_handles_labels(), loc="center", fontsize=10)
    fig.suptitle(f"vllm bench serve, {run.settings.get('request_rate')} req/s, generated Llama "
                 f"{run.settings.get('size')}, float32, 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
