"""``lmcache-mooncake up``: the whole prefill/decode stack on this host, in one command.

Starts, in order: the embedded Mooncake Store (unless one is already running
in the state folder), a prefill vLLM (kv_producer), a decode vLLM
(kv_consumer) and the proxy, all on loopback; waits until each answers; prints
the proxy's URL. On Ctrl-C or SIGTERM it stops what it started in the reverse
order (proxy, decode, prefill, store), each process group with SIGTERM then
SIGKILL, so no process is left behind.

With ``--demo`` it builds a generated model if none is given, sends a few long
prompts through the proxy (some repeated, some sharing a prefix), prints a
table, and shuts down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lmcache_mooncake import procs
from lmcache_mooncake.metrics_client import MetricsSnapshot, fetch
from lmcache_mooncake.serve import default_config_file, vllm_command
from lmcache_mooncake.testing.prompts import demo_requests


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    url: str | None = None


class Stack:
    """What ``up`` started, stopped in reverse order by :meth:`stop`."""

    def __init__(self, work: Path):
        self.work = work
        self.children: list[Child] = []
        self.store_dir: Path | None = None
        self.started_store = False

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], url: str | None = None) -> Child:
        log = self.work / f"{name}.log"
        child = Child(name, procs.spawn(cmd, log, env=env), log, url)
        self.children.append(child)
        return child

    def wait_healthy(self, child: Child, timeout_s: float) -> None:
        if child.url is None:
            raise ValueError(f"{child.name} has no URL to check")
        procs.wait_healthy(child.proc, child.url, timeout_s, child.name, child.log)

    def stop(self, grace_s: float = 30.0) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                print(f"up: stopping {child.name} (pid {child.proc.pid})", file=sys.stderr)
            procs.stop_group(child.proc, grace_s)
        self.children.clear()
        if self.started_store and self.store_dir is not None:
            from lmcache_mooncake.store.launcher import stop_store

            print("up: stopping the Mooncake store", file=sys.stderr)
            stop_store(self.store_dir)
            self.started_store = False


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``up`` to the command line's subparsers."""
    p = subparsers.add_parser(
        "up",
        help=help,
        description="Start the Mooncake store, one prefill and one decode vLLM and the proxy on this "
        "host; print the proxy's URL; stop everything on Ctrl-C or SIGTERM.",
    )
    p.add_argument("--model", help="model folder (required unless --demo, which builds a generated one)")
    p.add_argument("--port", type=int, default=9000, help="proxy port (default 9000)")
    p.add_argument("--store-memory", default="2GiB", help="store memory if a store is started (default 2GiB)")
    p.add_argument("--state-dir", default=None, help="store state folder (default: the store command's default)")
    p.add_argument("--work-dir", default=None, help="folder for logs and counters (default: a new temp folder)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per vLLM (default 1)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for both vLLM servers (repeat), e.g. --vllm-arg=--dtype=bfloat16")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for each server")
    p.add_argument("--demo", action="store_true", help="send demo prompts through the proxy, print a table, stop")
    p.add_argument("--size", default="small", choices=["tiny", "small", "0.5b"], help="generated model size for --demo")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Start the stack, wait for every part, then serve (or run the demo) until stopped."""
    if args.model is None and not args.demo:
        args.parser.error("--model is required (or use --demo)")

    from lmcache_mooncake.config import parse_size
    from lmcache_mooncake.store.launcher import StoreSpec, default_state_dir, start_store, store_status

    model = args.model
    if model is None:
        from lmcache_mooncake.testing.models import ModelSpec, build_model

        print(f"up: building (or reusing) the generated '{args.size}' Llama model", file=sys.stderr)
        model = str(build_model(ModelSpec(arch="llama", size=args.size)))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lmcm-up-"))
    work.mkdir(parents=True, exist_ok=True)
    stack = Stack(work)
    stop_event = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop_event.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stack.store_dir = Path(args.state_dir or default_state_dir()).expanduser()
        if store_status(stack.store_dir).get("healthy"):
            print(f"up: using the store already running in {stack.store_dir}", file=sys.stderr)
        else:
            print(f"up: starting the Mooncake store ({args.store_memory})", file=sys.stderr)
            start_store(StoreSpec(memory_bytes=parse_size(args.store_memory), state_dir=stack.store_dir))
            stack.started_store = True

        prefill_port = procs.free_port()
        ports = {"prefill": prefill_port, "decode": procs.free_port(exclude={prefill_port})}
        # On small CPU machines two vLLMs must not bind OpenMP to the same core.
        cores = sorted(os.sched_getaffinity(0))
        for i, role in enumerate(("prefill", "decode")):
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), HF_HUB_OFFLINE="1",
                       VLLM_NO_USAGE_STATS="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
            if len(cores) >= 2 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                half = len(cores) // 2
                mine = cores[:half] if i == 0 else cores[half:]
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
            overrides = {"run_dir": str(work / f"{role}-run"),
                         "mooncake": {"store_dir": str(stack.store_dir)}}
            cmd = vllm_command(role, model, "127.0.0.1", ports[role], default_config_file(role),
                               ["--enable-prompt-tokens-details", "--enforce-eager", *args.vllm_arg], overrides)
            stack.spawn(role, cmd, env, url=f"http://127.0.0.1:{ports[role]}")
            print(f"up: starting {role} vLLM on port {ports[role]} (log {work / (role + '.log')})", file=sys.stderr)
        for child in list(stack.children):
            stack.wait_healthy(child, args.startup_timeout)
            print(f"up: {child.name} is ready", file=sys.stderr)
        proxy_cmd = [sys.executable, "-m", "lmcache_mooncake.cli", "proxy", "--port", str(args.port),
                     "--prefill", f"http://127.0.0.1:{ports['prefill']}",
                     "--decode", f"http://127.0.0.1:{ports['decode']}"]
        proxy = stack.spawn("proxy", proxy_cmd, dict(os.environ), url=f"http://127.0.0.1:{args.port}")
        stack.wait_healthy(proxy, 60)
        print(f"\nlmcache-mooncake stack is up: OpenAI API at http://127.0.0.1:{args.port}/v1 "
              f"(model {model}). Ctrl-C stops it.\n", flush=True)
        if args.demo:
            rc = run_demo(f"http://127.0.0.1:{args.port}", model, f"http://127.0.0.1:{ports['decode']}")
            return rc
        while not stop_event.wait(1.0):
            for child in stack.children:
                if child.proc.poll() is not None:
                    print(f"up: {child.name} exited ({child.proc.returncode}); stopping the stack. "
                          f"Log {child.log}:\n{procs.tail_log(child.log, 30)}", file=sys.stderr)
                    return 1
        return 0
    except Exception as e:  # report, then always stop what was started
        print(f"up: error: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)


def _tier(before: MetricsSnapshot, after: MetricsSnapshot, cached: int) -> str:
    def grew(name: str, **labels: str) -> bool:
        return after.count(name, **labels) > before.count(name, **labels)

    if grew("vllm:lmcm_chunk_hits", tier="store"):
        return "Mooncake store"
    if grew("vllm:lmcm_loaded_tokens"):
        return "CPU tier"
    if cached > 0:
        return "vLLM prefix cache"
    return "-"


def run_demo(base_url: str, model: str, decode_url: str) -> int:
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    rows = []
    with httpx.Client(timeout=600) as client:
        for label, prompt in demo_requests(vocab):
            before = fetch(decode_url)
            t0 = time.perf_counter()
            ttft = None
            usage = {}
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        raise RuntimeError(f"demo request failed: {data['error']}")
                    if ttft is None and data.get("choices") and data["choices"][0].get("text") is not None:
                        ttft = time.perf_counter() - t0
                    if data.get("usage"):
                        usage = data["usage"]
            time.sleep(0.5)  # the decode's last step's stats reach its /metrics just after its answer
            after = fetch(decode_url)
            cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
            rows.append((label, len(prompt), cached, (ttft or 0) * 1000, _tier(before, after, cached)))
    print(f"{'request':<20} {'prompt tokens':>13} {'cached (decode)':>15} {'TTFT ms':>9}  served by")
    for label, n, cached, ttft, tier in rows:
        print(f"{label:<20} {n:>13} {cached:>15} {ttft:>9.1f}  {tier}")
    return 0
