"""``lmcache-mooncake up``: the whole prefill/decode stack on this host, in one command.

Starts, in order: the embedded Mooncake Store (unless one is already running
in the state folder), ``--prefill N`` prefill vLLMs (kv_producer) and
``--decode M`` decode vLLMs (kv_consumer; kv_both with ``--decode-saves``, so
that what a decode instance computes itself, the new turn of a conversation
sent straight to it, is in the store for the next turn), each on its own port and core set
(:func:`core_sets`), and the proxy in front of them all (prefix routing and
direct decode, with the model's tokenizer), all on loopback; waits until each
answers; prints the proxy's URL. On CUDA (:mod:`lmcache_mooncake.platform`)
each instance gets its own GPU instead of its own cores (``--gpus``, default
one visible GPU per instance in order), and ``--print-commands`` shows what it
would start without starting anything. While it runs, an instance that exits is
reported and the proxy routes around it; the stack stops when a role has no
instance left or the proxy exits. On Ctrl-C or SIGTERM it stops what it
started in the reverse order (proxy, decode, prefill, store), each process
group with SIGTERM then SIGKILL, so no process is left behind.

With ``--demo`` it builds a generated model if none is given, sends a few long
prompts through the proxy (some repeated, some sharing a prefix), prints a
table with the decode instance that served each one and its hits, and shuts down.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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

from lmcache_mooncake import platform
from lmcache_mooncake.commands.serve import default_config_file, vllm_command
from lmcache_mooncake.obs.metrics_client import MetricsSnapshot, fetch
from lmcache_mooncake.runtime import procs
from lmcache_mooncake.runtime.malloc_env import malloc_env
from lmcache_mooncake.testing.prompts import demo_requests
from lmcache_mooncake.testing.streaming import stream_completion


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    url: str | None = None
    #: "prefill", "decode", or None for the proxy.
    role: str | None = None
    #: The connector's run folder (its counters), for vLLM instances.
    run_dir: Path | None = None


@dataclass(frozen=True)
class Launch:
    """One vLLM instance ``up`` will start: its command and the variables it adds to the environment."""

    name: str
    role: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    #: Where it runs, for messages: "cores 0,1" or "GPU 1".
    placement: str
    #: The connector's run folder (its counters).
    run_dir: Path


#: Memory one vLLM instance of a small model needs beside its KV cache (seen: 1-2 GiB).
INSTANCE_OVERHEAD_BYTES = 2 << 30


def core_sets(n: int, cores: list[int]) -> list[list[int]]:
    """The cores of each of ``n`` instances: disjoint, contiguous, as even as possible when
    there are at least ``n`` cores; else one core each, in turn (instances then share cores)."""
    if n <= 0:
        raise ValueError(f"{n} instances: need at least one")
    if not cores:
        raise ValueError("no cores to place instances on")
    if n > len(cores):
        return [[cores[i % len(cores)]] for i in range(n)]
    size, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(cores[start:end])
        start = end
    return out


def instance_counters(child: Child) -> MetricsSnapshot:
    """The connector counters of one vLLM instance, from its /metrics: the one place ``up`` reads them."""
    return fetch(child.url) if child.url is not None else MetricsSnapshot()


class Stack:
    """What ``up`` started, stopped in reverse order by :meth:`stop`."""

    def __init__(self, work: Path):
        self.work = work
        self.children: list[Child] = []
        self.store_dir: Path | None = None
        self.started_store = False

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], url: str | None = None,
              role: str | None = None, run_dir: Path | None = None) -> Child:
        log = self.work / f"{name}.log"
        child = Child(name, procs.spawn(cmd, log, env=env), log, url, role, run_dir)
        self.children.append(child)
        return child

    def instances(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

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
        description="Start the Mooncake store, prefill and decode vLLMs (one each unless --prefill / "
        "--decode) and the proxy on this host; print the proxy's URL; stop everything on Ctrl-C or SIGTERM.",
    )
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode instances (default 1)")
    p.add_argument("--decode-saves", action=argparse.BooleanOptionalAction, default=False,
                   help="decode instances also save the prompt tokens they compute themselves (kv_both) to the "
                   "store, so the next turn of a conversation the proxy sent straight to decode finds them "
                   "(default off: decode only loads, kv_consumer)")
    p.add_argument("--routing", choices=["prefix", "round-robin"], default="prefix",
                   help="the proxy's routing (default prefix)")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the proxy (repeat), e.g. --proxy-arg=--no-direct-decode")
    p.add_argument("--model", help="model folder (required unless --demo, which builds a generated one)")
    p.add_argument("--port", type=int, default=9000, help="proxy port (default 9000)")
    p.add_argument("--store-memory", default="2GiB", help="store memory if a store is started (default 2GiB)")
    p.add_argument("--state-dir", default=None, help="store state folder (default: the store command's default)")
    p.add_argument("--work-dir", default=None, help="folder for logs and counters (default: a new temp folder)")
    p.add_argument("--kv-cache-gib", type=int, default=None, metavar="GIB",
                   help="KV cache of each vLLM, GiB: on CPU VLLM_CPU_KVCACHE_SPACE (default "
                   f"{platform.DEFAULT_CPU_KV_CACHE_GIB}); on CUDA --kv-cache-memory-bytes (default: not set, vLLM "
                   "sizes it from --gpu-memory-utilization, 0.9 of the GPU)")
    p.add_argument("--gpus", default=None, metavar="IDS",
                   help="CUDA only: GPUs for the instances, one each in order (prefill first), as "
                   "CUDA_VISIBLE_DEVICES names them, e.g. 0,1 (default: the visible GPUs in order)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for both vLLM servers (repeat), e.g. --vllm-arg=--dtype=bfloat16")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for each server")
    p.add_argument("--demo", action="store_true", help="send demo prompts through the proxy, print a table, stop")
    p.add_argument("--size", default="small", choices=["tiny", "small", "0.5b"], help="generated model size for --demo")
    p.add_argument("--print-commands", action="store_true",
                   help="print each vLLM's command (with the variables up adds) and the proxy's, start nothing")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Start the stack, wait for every part, then serve (or run the demo) until stopped."""
    if args.model is None and not args.demo:
        args.parser.error("--model is required (or use --demo)")
    try:
        plat = platform.detect_platform()
    except platform.PlatformError as e:
        args.parser.error(str(e))
    gpus = _check_args(args, plat)
    if args.print_commands:
        return _print_commands(args, plat, gpus)

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

    try:
        # Held until the proxy starts: the store and the vLLMs pick free ports of their own
        # meanwhile, and one of them once took the proxy's.
        port_hold = procs.hold_port(args.port)
    except OSError as e:
        print(f"up: the proxy's --port {args.port} is not free: {e.strerror}; pass another --port",
              file=sys.stderr)
        return 2
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stack.store_dir = Path(args.state_dir or default_state_dir()).expanduser()
        if store_status(stack.store_dir).get("healthy"):
            print(f"up: using the store already running in {stack.store_dir}", file=sys.stderr)
        else:
            print(f"up: starting the Mooncake store ({args.store_memory})", file=sys.stderr)
            start_store(StoreSpec(memory_bytes=parse_size(args.store_memory), state_dir=stack.store_dir))
            stack.started_store = True

        for launch in plan_instances(args, plat, model, stack.store_dir, work, gpus):
            stack.spawn(launch.name, launch.cmd, dict(os.environ, **launch.env), url=f"http://127.0.0.1:{launch.port}",
                        role=launch.role, run_dir=launch.run_dir)
            print(f"up: starting {launch.name} vLLM on port {launch.port}, {launch.placement} "
                  f"(log {work / (launch.name + '.log')})", file=sys.stderr)
        for child in list(stack.children):
            stack.wait_healthy(child, args.startup_timeout)
            print(f"up: {child.name} is ready", file=sys.stderr)
        proxy_cmd = proxy_command(args, model, stack.store_dir, [c.url for c in stack.instances("prefill")],
                                  [c.url for c in stack.instances("decode")])
        if port_hold is not None:
            port_hold.close()
        proxy = stack.spawn("proxy", proxy_cmd, dict(os.environ), url=f"http://127.0.0.1:{args.port}")
        stack.wait_healthy(proxy, 120)
        print(f"\nlmcache-mooncake stack is up: OpenAI API at http://127.0.0.1:{args.port}/v1 "
              f"(model {model}; {args.prefill} prefill, {args.decode} decode). Ctrl-C stops it.\n", flush=True)
        if args.demo:
            return run_demo(f"http://127.0.0.1:{args.port}", model, stack.instances("decode"))
        return _watch(stack, stop_event)
    except Exception as e:  # report, then always stop what was started
        print(f"up: error: {e}", file=sys.stderr)
        return 1
    finally:
        if port_hold is not None:
            port_hold.close()
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)


def plan_instances(args: argparse.Namespace, plat: platform.Platform, model: str, store_dir: Path, work: Path,
                   gpus: list[str]) -> list[Launch]:
    """The ``--prefill`` then ``--decode`` vLLM instances, each on a free loopback port: on CPU
    on its own cores (:func:`core_sets`), on CUDA on its own GPU (``gpus``, one each, from
    :func:`lmcache_mooncake.platform.assign_gpus`)."""
    roles = [("prefill", i) for i in range(args.prefill)] + [("decode", i) for i in range(args.decode)]
    ports: list[int] = []
    for _ in roles:
        ports.append(procs.free_port(exclude=set(ports) | {args.port}))
    affinity = sorted(os.sched_getaffinity(0))
    # On small CPU machines vLLMs must not bind OpenMP to the same cores (where it can be avoided).
    cores = core_sets(len(roles), affinity) if not plat.is_cuda else [[] for _ in roles]
    placed = gpus if plat.is_cuda else [None] * len(roles)
    launches = []
    for (role, i), port, mine, gpu in zip(roles, ports, cores, placed, strict=True):
        name = f"{role}-{i}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        env.update(platform.instance_env(plat, os.environ, args.kv_cache_gib,
                                         cores=mine if len(affinity) >= 2 else (), gpus=[gpu] if gpu else ()))
        if not plat.is_cuda:  # the activations it keeps from re-faulting are the CPU platform's
            env.update(malloc_env(env))
        added = {k: v for k, v in env.items() if os.environ.get(k) != v}
        run_dir = work / f"{name}-run"
        overrides = {"run_dir": str(run_dir), "mooncake": {"store_dir": str(store_dir)}}
        flags = ["--enable-prompt-tokens-details", *platform.instance_vllm_args(plat, args.kv_cache_gib, args.vllm_arg),
                 *args.vllm_arg]
        # A saving decode runs as kv_both with the decode configuration (the store, no disk).
        kv_role = "both" if role == "decode" and args.decode_saves else role
        cmd = vllm_command(kv_role, model, "127.0.0.1", port, default_config_file(role), flags, overrides)
        where = f"GPU {gpu}" if gpu is not None else f"cores {','.join(map(str, mine))}"
        launches.append(Launch(name, role, port, cmd, added, where, run_dir))
    return launches


def proxy_command(args: argparse.Namespace, model: str, store_dir: Path, prefill_urls: list[str],
                  decode_urls: list[str]) -> list[str]:
    """The proxy in front of the instances, on ``--port``."""
    cmd = [sys.executable, "-m", "lmcache_mooncake.cli", "proxy", "--port", str(args.port),
           "--prefill", *prefill_urls, "--decode", *decode_urls,
           "--routing", args.routing, "--model", model, "--dtype", _vllm_dtype(args.vllm_arg),
           "--store-dir", str(store_dir), *args.proxy_arg]
    if default_config_file("decode"):
        cmd += ["--config", str(default_config_file("decode"))]
    return cmd


def _print_commands(args: argparse.Namespace, plat: platform.Platform, gpus: list[str]) -> int:
    """``--print-commands``: what ``up`` would start, as shell lines; nothing is started."""
    from lmcache_mooncake.store.launcher import default_state_dir

    if args.model is None:
        args.parser.error("--print-commands needs --model")
    store_dir = Path(args.state_dir or default_state_dir()).expanduser()
    work = Path(args.work_dir or "<work-dir>")
    launches = plan_instances(args, plat, args.model, store_dir, work, gpus)
    print(f"# platform: {plat.describe()}")
    for launch in launches:
        print(f"# {launch.name}: {launch.placement}")
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(launch.env.items())), shlex.join(launch.cmd))
    urls = {role: [f"http://127.0.0.1:{x.port}" for x in launches if x.role == role] for role in ("prefill", "decode")}
    print("# proxy")
    print(shlex.join(proxy_command(args, args.model, store_dir, urls["prefill"], urls["decode"])))
    return 0


def _check_args(args: argparse.Namespace, plat: platform.Platform) -> list[str]:
    """Refuse impossible instance counts; on CPU more instances than this host's memory holds,
    on CUDA more than there are GPUs. Returns the GPU of each instance (``[]`` on CPU)."""
    import psutil

    if args.prefill < 1 or args.decode < 1:
        args.parser.error(f"--prefill {args.prefill} --decode {args.decode}: each role needs at least one instance")
    n = args.prefill + args.decode
    if plat.is_cuda or args.gpus:
        try:
            return platform.assign_gpus(plat, n, args.gpus)
        except platform.PlatformError as e:
            args.parser.error(f"--prefill {args.prefill} --decode {args.decode}: {e}")
    gib = platform.DEFAULT_CPU_KV_CACHE_GIB if args.kv_cache_gib is None else args.kv_cache_gib
    need = n * ((gib << 30) + INSTANCE_OVERHEAD_BYTES)
    have = psutil.virtual_memory().available
    if need > have:
        args.parser.error(f"{n} vLLM instances need about {procs.format_bytes(need)} "
                          f"({gib} GiB KV cache + {procs.format_bytes(INSTANCE_OVERHEAD_BYTES)} each), "
                          f"this host has {procs.format_bytes(have)} available: start fewer (--prefill, --decode) "
                          "or lower --kv-cache-gib")
    return []


def _vllm_dtype(vllm_args: list[str]) -> str:
    """The ``--dtype`` among the extra vLLM arguments (the proxy names chunks with it), else "auto"."""
    for i, arg in enumerate(vllm_args):
        if arg.startswith("--dtype="):
            return arg.split("=", 1)[1]
        if arg == "--dtype" and i + 1 < len(vllm_args):
            return vllm_args[i + 1]
    return "auto"


def _watch(stack: Stack, stop_event: threading.Event) -> int:
    """Serve until stopped; report instances that exit; give up when a role has none left
    or the proxy exits."""
    reported: set[str] = set()
    while not stop_event.wait(1.0):
        for child in stack.children:
            if child.proc.poll() is None or child.name in reported:
                continue
            reported.add(child.name)
            print(f"up: {child.name} exited ({child.proc.returncode}). Log {child.log}:\n"
                  f"{procs.tail_log(child.log, 30)}", file=sys.stderr)
            if child.role is None:
                print("up: the proxy exited; stopping the stack", file=sys.stderr)
                return 1
            if all(c.proc.poll() is not None for c in stack.instances(child.role)):
                print(f"up: no {child.role} instance is left; stopping the stack", file=sys.stderr)
                return 1
            print(f"up: the proxy routes around {child.name}", file=sys.stderr)
    return 0


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


def run_demo(base_url: str, model: str, decodes: list[Child]) -> int:
    """Send the demo prompts through the proxy; print, per request, the decode instance that
    served it, whether prefill was skipped, and where its cached tokens came from; then each
    decode instance's totals."""
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    by_url = {c.url: c for c in decodes}
    rows = []
    with httpx.Client(timeout=600, trust_env=False) as client:
        for label, prompt in demo_requests(vocab):
            before = {c.name: instance_counters(c) for c in decodes}
            res = stream_completion(client, base_url, {"model": model, "prompt": prompt, "max_tokens": 16,
                                                       "temperature": 0.0})
            served = by_url.get(res.headers.get("x-decode-instance", ""))
            prefill = res.headers.get("x-prefill-instance", "?")
            time.sleep(0.6)  # a step's counters reach the instance's /metrics just after its answer
            cached = res.cached_tokens
            tier = _tier(before[served.name], instance_counters(served), cached) if served is not None else "-"
            rows.append((label, len(prompt), cached, (res.ttft_s or 0) * 1000, served.name if served else "?",
                         "skipped" if prefill == "skipped" else "yes", tier))
    print(f"{'request':<20} {'prompt tokens':>13} {'cached (decode)':>15} {'TTFT ms':>9}  {'decode':<9} "
          f"{'prefill':<8} served by")
    for label, n, cached, ttft, decode, prefill, tier in rows:
        print(f"{label:<20} {n:>13} {cached:>15} {ttft:>9.1f}  {decode:<9} {prefill:<8} {tier}")
    print(f"\n{'decode instance':<16} {'requests':>8} {'loaded tokens':>13} {'store chunks':>12}")
    for c in decodes:
        counters = instance_counters(c)
        print(f"{c.name:<16} {sum(1 for r in rows if r[4] == c.name):>8} "
              f"{counters.count('vllm:lmcm_loaded_tokens'):>13} "
              f"{counters.count('vllm:lmcm_chunk_hits', tier='store'):>12}")
    return 0
