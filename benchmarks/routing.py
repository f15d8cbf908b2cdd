"""Prefix-aware routing and direct decode against round-robin, in one run on one stack.

One store, one prefill and two decode vLLM servers (real vLLM, ``--dtype
float32``, the generated Llama of ``--size``), and three proxies in front of
the same instances:

- ``round-robin``: ``--routing round-robin --no-direct-decode`` (every request
  pays the prefill round trip, decode instances taken in turn);
- ``prefix``: ``--routing prefix --no-direct-decode``;
- ``prefix + direct``: ``--routing prefix`` with direct decode (a request whose
  prompt the store holds but for at most 256 tokens skips prefill).
- ``single instance``: the same kind of requests sent straight to the prefill
  vLLM, no proxy and no decode instance (what one instance with vLLM's own
  prefix cache gives on the same core): the baseline of PD's end-to-end TTFT.

Each proxy gets its own ``--systems`` random system prompts of
``--system-tokens`` tokens (so no configuration finds what another one cached)
and ``--requests`` requests, one at a time: a system prompt (each once, then
at random) plus a new ``--user-tokens``-token question ("mostly cached"); then each system
prompt with one question is sent ``--repeats`` more times ("repeated").
Requests are streamed ``/v1/completions`` with token ids and ``max_tokens=4``;
TTFT is the time to the first streamed token at the client.

Per configuration it prints the shares of all prompt tokens the decode
instances served from vLLM's own prefix cache (``cached_tokens`` less what the
connector loaded), from our CPU tier (``loaded_tokens`` less what came from the
store) and from the store (the decode connectors' ``store_bytes_read`` over
the KV bytes per token),
chunks read from the store, prefill requests skipped, and TTFT (median and
90th percentile) of the mostly-cached and repeated requests.

    flock /tmp/lmcm-heavy.lock .venv/bin/python benchmarks/routing.py [--size small] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from lmcache_mooncake.commands.serve import vllm_command
from lmcache_mooncake.obs.metrics_client import fetch
from lmcache_mooncake.runtime import procs
from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
from lmcache_mooncake.testing.models import ModelSpec, build_model
from lmcache_mooncake.testing.offline import vllm_env
from lmcache_mooncake.testing.streaming import stream_completion

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096", "--enable-prompt-tokens-details"]
#: (name, proxy arguments)
CONFIGS = [
    ("round-robin", ["--routing", "round-robin", "--no-direct-decode"]),
    ("prefix", ["--routing", "prefix", "--no-direct-decode"]),
    ("prefix + direct", ["--routing", "prefix"]),
]


@dataclass
class Result:
    config: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    store_tokens: int = 0
    #: Tokens the decode connectors loaded (CPU tier or store); the rest of cached_tokens was
    #: vLLM's own prefix cache on the decode instance.
    loaded_tokens: int = 0
    store_chunks: int = 0
    prefill_skipped: int = 0
    requests: int = 0
    ttft_mostly_cached_ms: list[float] = field(default_factory=list)
    ttft_repeated_ms: list[float] = field(default_factory=list)
    per_decode: dict[str, int] = field(default_factory=dict)


class Proc:
    """A server process with its log, stopped with its group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, work: Path):
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", work / f"{name}.log"
        self.proc = procs.spawn(cmd, self.log, env=env)

    def wait(self, timeout_s: float = 600) -> None:
        procs.wait_healthy(self.proc, self.url, timeout_s, self.name, self.log)

    def stop(self) -> None:
        procs.stop_group(self.proc, 10)


def stream_ttft(client: httpx.Client, url: str, model: str, prompt: list[int]) -> tuple[float, dict, str, str]:
    """(TTFT in ms, usage, decode instance URL, prefill instance or "skipped") of one request."""
    res = stream_completion(client, url, {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0})
    return ((res.ttft_s or 0.0) * 1000, res.usage, res.headers.get("x-decode-instance", "?"),
            res.headers.get("x-prefill-instance", "?"))


def kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 4  # float32


def run_config(name: str, proxy: Proc, model: Path, decodes: list[Proc], run_dirs: dict[str, Path],
               args: argparse.Namespace, seed: int, bpt: int) -> Result:
    """One configuration's requests through ``proxy`` (a proxy, or one vLLM for the baseline);
    ``decodes``: the instances whose connector counters say what was loaded."""
    rng = random.Random(seed)
    systems = [[rng.randrange(16, 2000) for _ in range(args.system_tokens)] for _ in range(args.systems)]
    before = {d.url: fetch(d.url) for d in decodes}
    res = Result(name)
    repeat_prompts = []
    with httpx.Client(timeout=600, trust_env=False) as client:
        for i in range(args.requests):
            question = [rng.randrange(16, 2000) for _ in range(args.user_tokens)]
            # Each system prompt once, then at random: a fixed cycle would keep step with a
            # round-robin turn and hand round-robin the prefix affinity by accident.
            system = systems[i] if i < len(systems) else rng.choice(systems)
            prompt = system + question
            if i < len(systems):
                repeat_prompts.append(prompt)
            ttft, usage, decode, prefill = stream_ttft(client, proxy.url, str(model), prompt)
            # The first request of each system prompt computes it: not a cached one.
            if i >= len(systems):
                res.ttft_mostly_cached_ms.append(ttft)
            _count(res, usage, decode, prefill, len(prompt))
        for _ in range(args.repeats):
            for prompt in repeat_prompts:
                ttft, usage, decode, prefill = stream_ttft(client, proxy.url, str(model), prompt)
                res.ttft_repeated_ms.append(ttft)
                _count(res, usage, decode, prefill, len(prompt))
    time.sleep(1.0)  # a step's counters reach /metrics just after its answer
    for d in decodes:
        after, b = fetch(d.url), before[d.url]

        def grew(name: str, after=after, b=b, **labels: str) -> int:
            return after.count(name, **labels) - b.count(name, **labels)

        res.store_chunks += grew("vllm:lmcm_chunk_hits", tier="store")
        res.loaded_tokens += grew("vllm:lmcm_loaded_tokens")
        res.store_tokens += grew("vllm:lmcm_read_bytes", tier="store") // bpt
    return res


def _count(res: Result, usage: dict, decode: str, prefill: str, n: int) -> None:
    res.requests += 1
    res.prompt_tokens += n
    res.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    res.prefill_skipped += prefill == "skipped"
    res.per_decode[decode] = res.per_decode.get(decode, 0) + 1


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]


def print_table(results: list[Result]) -> None:
    """Shares of all prompt tokens: served by the decode's vLLM prefix cache, by our CPU tier, by the store."""
    print(f"\n{'config':<16} {'vLLM prefix cache':>17} {'CPU tier':>8} {'store':>6} {'store chunks':>12} "
          f"{'prefill skipped':>15} {'TTFT mostly-cached ms p50/p90':>30} {'TTFT repeated ms p50/p90':>25}"
          "  requests per decode")
    for r in results:
        total = max(r.prompt_tokens, 1)
        vllm_cache = max(r.cached_tokens - r.loaded_tokens, 0) / total
        cpu = max(r.loaded_tokens - r.store_tokens, 0) / total
        store = r.store_tokens / total
        mc = f"{statistics.median(r.ttft_mostly_cached_ms):.0f} / {pct(r.ttft_mostly_cached_ms, 0.9):.0f}"
        rp = f"{statistics.median(r.ttft_repeated_ms):.0f} / {pct(r.ttft_repeated_ms, 0.9):.0f}"
        skipped = f"{r.prefill_skipped} of {r.requests}"
        print(f"{r.config:<16} {vllm_cache:>17.1%} {cpu:>8.1%} {store:>6.1%} {r.store_chunks:>12} {skipped:>15} "
              f"{mc:>30} {rp:>25}  {sorted(r.per_decode.values(), reverse=True)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small", "0.5b"])
    ap.add_argument("--systems", type=int, default=4, help="system prompts per configuration")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=32, help="mostly-cached requests per configuration")
    ap.add_argument("--repeats", type=int, default=2, help="repeats of one prompt per system prompt")
    ap.add_argument("--json", type=Path, default=RESULTS / "routing.json")
    args = ap.parse_args(argv)

    model = build_model(ModelSpec(arch="llama", size=args.size, seed=0))
    work = Path(tempfile.mkdtemp(prefix="lmcm-routing-"))
    sd = work / "store"
    start_store(StoreSpec(memory_bytes=2 << 30, state_dir=sd))
    started: list[Proc] = []
    try:
        run_dirs: dict[str, Path] = {}
        instances: dict[str, Proc] = {}
        ports: set[int] = set()
        for i, (name, role) in enumerate((("prefill", "prefill"), ("decode0", "decode"), ("decode1", "decode"))):
            port = procs.free_port(exclude=ports)
            ports.add(port)
            overrides = {"run_dir": str(work / f"{name}-run"), "mooncake": {"store_dir": str(sd)}}
            # 3 instances on 2 cores: the prefill alone on core 0, the decodes share core 1.
            env = vllm_env(work / name, {"VLLM_CPU_OMP_THREADS_BIND": "0" if i == 0 else "1"})
            p = Proc(name, vllm_command(role, str(model), "127.0.0.1", port, None, VLLM_ARGS, overrides),
                     env, port, work)
            started.append(p)
            instances[name] = p
            run_dirs[p.url] = work / f"{name}-run"
        for p in instances.values():
            p.wait()
        decodes = [instances["decode0"], instances["decode1"]]
        proxies = []
        for k, (name, extra) in enumerate(CONFIGS):
            port = procs.free_port(exclude=ports)
            ports.add(port)
            cmd = [sys.executable, "-m", "lmcache_mooncake.cli", "proxy", "--port", str(port),
                   "--prefill", instances["prefill"].url, "--decode", *(d.url for d in decodes),
                   "--model", str(model), "--dtype", "float32", "--store-dir", str(sd), *extra]
            p = Proc(f"proxy-{k}", cmd, dict(os.environ), port, work)
            started.append(p)
            proxies.append((name, p))
        for _, p in proxies:
            p.wait(180)
        bpt = kv_bytes_per_token(model)
        results = []
        for k, (name, p) in enumerate(proxies):
            t0 = time.monotonic()
            results.append(run_config(name, p, model, decodes, run_dirs, args, seed=100 + k, bpt=bpt))
            print(f"{name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        # The baseline: one instance, no proxy (its own prefix cache serves the system prompts).
        t0 = time.monotonic()
        single = instances["prefill"]
        results.append(run_config("single instance", single, model, [single], run_dirs, args,
                                  seed=100 + len(proxies), bpt=bpt))
        print(f"single instance: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        print_table(results)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": [asdict(r) for r in results]}, indent=1))
        print(f"\nJSON: {args.json}; logs: {work}")
        return 0
    finally:
        for p in reversed(started):
            p.stop()
        stop_store(sd)


if __name__ == "__main__":
    sys.exit(main())
