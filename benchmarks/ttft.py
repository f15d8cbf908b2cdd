"""Cached time to first token, ours through each tier against recompute, vLLM's own
prefix-cache hit (the floor) and the peers, all in one run on one store.

Every configuration is a real vLLM OpenAI server (``python -m
vllm.entrypoints.openai.api_server``) on loopback, with ``--dtype float32``
and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` for all (so every run gets both cores).
A request is ``/v1/completions`` with the prompt's token ids and
``max_tokens=1``: its wall time is the TTFT, and ``cached_tokens`` is what
vLLM reports as served from a cache.

Prompts: three random families of 2,049, 4,097 and 8,193 tokens (one past a
multiple of vLLM's 128-token CPU block); each family's first 2,048 / 4,096 /
8,192 tokens are the block-aligned prompt. A writer computes each family once
(its TTFT is the recompute figure, and against the plain server's the cost of
saving); fresh readers then measure the one-past prompts in one process and
the aligned ones in another, so no measured prompt finds what an earlier one
in its process loaded.

Rows (``--peers`` chooses the peers; all by default):

- ``plain``: vLLM, no connector, prefix caching on. First request per family:
  recompute; repeats: vLLM's own prefix-cache hit, nothing copied (the floor).
- ``ours, CPU tier, same process``: the writer (prefix caching off) asked again.
- ``ours, disk tier`` / ``ours, store (shm)`` / ``ours, store (tcp)``: fresh readers.
- ``vLLM MooncakeStoreConnector``: vLLM's own, standalone-store mode against
  the same store (TCP), prefix caching on (with it off it never loads).
- ``vLLM ExampleConnector``: vLLM's file-based example connector (it needs
  ``--max-num-batched-tokens`` above the prompt, else it crashes on chunked prefill),
  at the shortest length and one past a block only, one fresh reader: on this
  build its fresh readers never hit (every run up to 2026-12-05, at every
  length), and each miss is a full recompute.
- ``LMCache multi-process``: an ``lmcache server`` (2 GiB L1) and vLLM's
  ``LMCacheMPConnector``; fresh vLLM processes read what the writer stored.
- ``vLLM OffloadingConnector``: vLLM's in-process CPU tier (prefix caching off,
  so a repeat is served by it), measured in the writing process.
- ``vLLM SimpleCPUOffloadConnector``: vLLM's other in-process CPU tier; it
  needs prefix caching on, so vLLM's own cache is emptied
  (``/reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``) before each repeat.
- ``short request ...`` (not with ``--no-concurrent``): a 64-token request sent
  20 ms after the longest prompt, whose chunks load from disk in a fresh server
  (``--concurrent-trials`` servers per loading mode, sync and async), against
  three short requests alone in the same server; the control is the same in
  the plain server, where vLLM's own prefix cache serves the long prompt and
  nothing is loaded, so the delay left is the long prompt's own work.

    .venv/bin/python benchmarks/ttft.py [--quick] [--peers mooncake,example,lmcache,offloading,simple-cpu] [--json PATH]
    .venv/bin/python benchmarks/ttft.py --bases 8192 --readers disk,store-shm --peers mooncake --no-concurrent

Servers start two at a time (:func:`ready_in_groups`): the plain server with our
writer, the peers' writers, each configuration's two readers, the concurrent
trials (sync and async alternating); the peers' three readers start at once.
All of a group are ready before any is measured, and each gets a throwaway
request right before its measurements.

``--quick`` uses a small model and shorter prompts (a smoke run in minutes).
Prints a table, writes JSON and a PNG under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lmcache_mooncake.runtime.malloc_env import malloc_env

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PY = sys.executable


@dataclass
class Measure:
    config: str
    prompt_tokens: int
    ttft_s: float
    cached_tokens: int
    note: str = ""


@dataclass
class Run:
    model: str
    lengths: list[int]
    rows: list[Measure] = field(default_factory=list)
    memcpy_gbps: float = 0.0
    load_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    profile: dict[str, float] = field(default_factory=dict)
    #: Disk readers: share of the disk tier's bytes in the page cache as the reader's first request
    #: is sent (the rest is read from the disk itself), see :func:`page_cache_share`.
    page_cache: dict[str, float] = field(default_factory=dict)


#: Row labels of the short-request-during-a-long-load measurement: their own table, not the plot.
CONCURRENT_ROWS = ("short request", "long prompt with")
#: The control of that measurement: the long prompt from vLLM's own prefix cache, nothing loaded.
CONTROL_MODE = "control: vLLM prefix cache, nothing loaded"

#: ``--readers`` names -> the row label of our fresh-process readers.
READERS = {
    "disk": "ours, disk tier, fresh process",
    "store-shm": "ours, store (shm), fresh process",
    "store-tcp": "ours, store (tcp), fresh process",
    "disk-one-pass": "ours, disk tier, one pass, fresh process",
}
#: Readers ``--readers`` runs by default (``disk-one-pass``, ``verify_on_lookup: false``, on request:
#: it keeps ``make bench`` within its time).
DEFAULT_READERS = ("disk", "store-shm", "store-tcp")
DEFAULT_PEERS = "mooncake,example,offloading,simple-cpu"
PEER_LABELS = {"offloading": "vLLM OffloadingConnector", "simple-cpu": "vLLM SimpleCPUOffloadConnector"}
#: Peers that fail while vLLM starts on a CPU build of this vLLM version, with the error they
#: gave (make bench of 2026-12-06, and every run before it). A default run records them
#: instead of spending a vLLM start-up (about a minute here) on each.
KNOWN_START_FAILURES = {
    ("0.32.0", "offloading"): "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
    ("0.32.0", "simple-cpu"): "type object '_StreamPlaceholder' has no attribute 'priority_range'",
}


def known_start_failures() -> dict[str, str]:
    """``{peer: error}`` for the peers :data:`KNOWN_START_FAILURES` lists for the installed vLLM,
    on a machine without CUDA (where they were seen to fail)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    if torch.cuda.is_available():
        return {}
    for dist in ("vllm-cpu", "vllm"):  # the CPU build's distribution, then the usual one
        try:
            v = version(dist).split("+")[0]
            break
        except PackageNotFoundError:
            continue
    else:
        return {}
    return {peer: err for (ver, peer), err in KNOWN_START_FAILURES.items() if ver == v}


# -- servers ---------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Seconds a writer gets to exit before SIGKILL: the readers after it need every chunk it wrote.
WRITER_STOP_S = 60.0
#: Seconds a server that wrote nothing later readers need gets to exit before SIGKILL. vLLM
#: 0.32.0's shutdown here sometimes hangs: the engine's worker exits, then the API server waits
#: out its 60 s timeout (2 of 114 servers in the runs of 2026-12-06, a minute lost each).
QUIET_STOP_S = 15.0


class Server:
    """One vLLM OpenAI server on loopback, in its own process group.

    ``wait=False`` only launches it: :meth:`wait_ready` then waits for it (see :func:`ready_in_groups`)."""

    def __init__(self, name: str, model: str, work: Path, kv: dict[str, Any] | None, prefix_caching: bool,
                 max_len: int, env: dict[str, str] | None = None, extra: list[str] | None = None,
                 wait: bool = True, drains: bool = False):
        self.name, self.model = name, model
        self.drains = drains  # a writer: :meth:`stop` gives it time to finish its writes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        for d in ("cache", "inductor", "tmp"):
            (self.dir / d).mkdir(exist_ok=True)
        cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(self.port),
               "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_len),
               "--enable-prompt-tokens-details", "--seed", "0",
               # Stopping a writer must not lose its last chunks (vLLM's default 0 aborts at once).
               "--shutdown-timeout", "60"]
        cmd.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        cmd += extra or []
        penv = dict(os.environ)
        penv.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1",
                    VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CACHE_ROOT=str(self.dir / "cache"),
                    TORCHINDUCTOR_CACHE_DIR=str(self.dir / "inductor"), TMPDIR=str(self.dir / "tmp"))
        penv.update(env or {})
        penv.update(malloc_env(penv))  # the same allocator for every connector and the baselines
        self.log = self.dir / "server.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=penv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.deadline = time.monotonic() + 600
        if wait:
            self.wait_ready()

    def wait_ready(self, warm: bool = True) -> Server:
        """Wait until it answers, then (``warm``) send it :meth:`warm_up`'s request; raises
        RuntimeError if it exits or is not ready within 600 s of its launch."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > self.deadline:
                self.stop()
                raise RuntimeError(f"{self.name} not ready in 600 s; see {self.log}")
            time.sleep(0.5)
        self.client = httpx.Client(base_url=self.url, timeout=900)
        if warm:
            self.warm_up()
        return self

    def warm_up(self) -> None:
        """One throwaway request: the first forward pass of a fresh vLLM pays one-off set-up
        costs that are no part of a load or a recompute. Sent right before the measurements: a
        server that answered it at start-up and then sat idle while its pair-mate started was
        slow on its next request, whatever the connector (--quick: MooncakeStoreConnector 420 ms
        against 42 at 513 tokens; ours, a first short request 1,041 ms against 47)."""
        self.ttft([11, 12, 13, 14, 15, 16, 17, 18] * 4)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache, not the connector's (needs ``VLLM_SERVER_DEV_MODE=1``)."""
        for _ in range(50):  # refused while blocks are held (a finishing request, an async offload)
            r = self.client.post("/reset_prefix_cache")
            r.raise_for_status()
            if r.json().get("success"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: vLLM refused to reset its prefix cache")

    def ttft(self, tokens: list[int]) -> tuple[float, int]:
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
        t0 = time.perf_counter()
        r = self.client.post("/v1/completions", json=body)
        elapsed = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: {r.status_code} {r.text[:500]}")
        details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
        return elapsed, int(details.get("cached_tokens") or 0)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM to the group (the connector drains its writes), up to ``grace_s`` for all of
        it to exit, then SIGKILL what is left (``procs.stop_group``). By default
        :data:`WRITER_STOP_S` for a writer (``drains``) and :data:`QUIET_STOP_S` for the others."""
        from lmcache_mooncake.runtime import procs

        if grace_s is None:
            grace_s = WRITER_STOP_S if self.drains else QUIET_STOP_S
        procs.stop_group(self.proc, grace_s)
        self.proc.wait()


def ready_in_groups(launch: list[Callable[[], Server]], servers: list[Server],
                    failed: Callable[[Server, RuntimeError], None] | None = None, size: int = 2) -> Iterator[Server]:
    """Launch the servers ``size`` at a time and yield each once all of its group are ready; the
    caller measures it and stops it. Every server launched is added to ``servers`` first, so
    the caller's clean-up stops it whatever happens. A server that does not start raises
    RuntimeError (and its group-mates are stopped), or with ``failed`` is handed to it and skipped.

    Why: a vLLM start-up here is mostly one core importing in one process after another (API
    server, engine, worker), 43 s for one and 51 s for two at once on 2 cores (76 s for three),
    and an idle server then takes about 1% of a core (14 ticks in 10 s). All of a group are
    ready before any is measured, so nothing starts while a request is timed. Three at once
    beat a pair then a lone server (51 + 43 s) but not pairs."""
    for i in range(0, len(launch), size):
        group: list[Server] = []
        try:
            for make in launch[i : i + size]:
                group.append(make())
                servers.append(group[-1])
            ready = []
            for s in group:
                try:
                    ready.append(s.wait_ready(warm=False))
                except RuntimeError as e:
                    if failed is None:
                        raise
                    failed(s, e)
            for s in ready:
                s.warm_up()
                yield s
        finally:  # after a failed start or a caller's error, its group-mates do not idle on
            for s in group:
                if s.proc.poll() is None:
                    s.stop(grace_s=10)


def reader_pair(name: str, make: Callable[..., Server], whiches: tuple[str, ...] = ("past", "aligned"),
                ) -> tuple[tuple[str, ...], list[Callable[[], Server]]]:
    """The fresh readers of one configuration, ``{name}-past`` (one past each block-aligned
    length) and ``{name}-aligned``, or those of ``whiches``: ``(whiches, launchers)``;
    ``make(server_name)`` builds one with ``wait=False``."""
    return whiches, [functools.partial(make, f"{name}-{w}") for w in whiches]


# Where the worker's time goes during a load: the first category a sampled stack matches.
PROFILE_CATEGORIES = [
    ("scatter into paged KV (layouts)", ("scatter", "_scatter_side", "batched_to_gpu")),
    ("read + verify chunks (tiers, chunk_format)", ("_read_verified", "readinto", "verify", "decode_into",
                                                   "xxh3", "batch_get_visit", "_get_sync")),
    ("lookup (keys, tiers' contains)", ("lookup", "_contains", "batched_contains", "chunk_keys")),
    ("LMCache retrieve (other)", ("retrieve", "cache_engine")),
    ("vLLM model forward", ("forward", "execute_model", "attention", "cpu_attn")),
]


# Stacks of a thread that waits (vLLM's worker waiting for the next step, the lookup
# server polling): not time spent on the request.
IDLE = ("acquire_read", "SpinCondition", "wait (threading", "select (selectors", "_poll", "Poller.poll",
        "recv_multipart", "sleep")


class Profile:
    """py-spy on a server's vLLM worker process for the duration of a ``with`` block."""

    def __init__(self, server: Server, out: Path):
        import psutil

        self.out = out
        procs = psutil.Process(server.proc.pid).children(recursive=True)
        worker = next((p for p in procs if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name()), None)
        if worker is None:
            raise RuntimeError(f"no vLLM worker process under {server.proc.pid}")
        self.pid = worker.pid

    def __enter__(self) -> Profile:
        spy = Path(sys.executable).with_name("py-spy")
        self.proc = subprocess.Popen([str(spy), "record", "--pid", str(self.pid), "--rate", "200", "--format", "raw",
                                      "--output", str(self.out), "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)

    def summary(self) -> dict[str, float]:
        """Seconds of samples per category (200 Hz), active (non-idle) stacks only."""
        totals: dict[str, float] = {}
        if not self.out.exists():
            return totals
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit() or not stack.strip() or any(w in stack for w in IDLE):
                continue
            cat = next((name for name, words in PROFILE_CATEGORIES if any(w in stack for w in words)), "other")
            totals[cat] = totals.get(cat, 0.0) + int(count) / 200
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


# -- configurations -------------------------------------------------------------------------


def ours(config_file: Path, role: str = "kv_both", **overrides: Any) -> dict[str, Any]:
    from lmcache_mooncake.commands.serve import connector_config

    return connector_config(role, {"config_file": str(config_file), **overrides})


def write_config(path: Path, *, disk: Path | None, store: dict[str, str] | None, cpu_gib: float = 1.0,
                 verify_on_lookup: bool = True) -> Path:
    lines = ["chunk_size: 256", "local_cpu: true", f"max_local_cpu_size: {cpu_gib}",
             f"local_disk: {json.dumps(str(disk)) if disk else 'null'}", "max_local_disk_size: 8",
             "save_unfull_chunk: true", f"verify_on_lookup: {'true' if verify_on_lookup else 'false'}"]
    if store is not None:
        lines.append("mooncake:")
        lines += [f"  {k}: {json.dumps(v)}" for k, v in store.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def page_cache_share(folder: Path) -> float | None:
    """The share of the bytes of the files under ``folder`` that are in the page cache, from
    util-linux's ``fincore``; None without it or without files. A kernel that pages out cold
    memory (this VM's DAMON ``pageout`` scheme, ``docs/performance.md``) leaves a disk tier's
    files partly on the disk itself a minute or two after they were written."""
    import shutil

    exe = shutil.which("fincore")
    files = sorted(str(f) for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else []
    if exe is None or not files:
        return None
    out = subprocess.run([exe, "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *files],
                         capture_output=True, text=True, check=False).stdout
    sizes = [tuple(int(x) for x in line.split()) for line in out.splitlines() if len(line.split()) == 2]
    total = sum(size for _, size in sizes)
    return sum(res for res, _ in sizes) / total if total else None


def memcpy_gbps(nbytes: int) -> float:
    from tier_load import memcpy_s  # the same baseline as the per-tier benchmark

    return nbytes / memcpy_s(nbytes) / 1e9


def read_connector_metrics(server: Server) -> dict[str, float]:
    """Our counters on ``server``'s /metrics (summed over labels but ``tier``), read before it stops."""
    from lmcache_mooncake.obs.metrics_client import fetch

    time.sleep(0.5)  # the last step's stats reach the API process just after its answer
    m = fetch(server.url)
    out: dict[str, float] = {}
    for (name, labels), v in m.samples.items():
        if name.startswith("vllm:lmcm_") and not name.endswith(("_bucket", "_created")):
            tier = dict(labels).get("tier")
            key = name.removeprefix("vllm:lmcm_") + (f"{{tier={tier}}}" if tier else "")
            out[key] = out.get(key, 0.0) + v
    return out


# -- the run ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, short prompts: a smoke run")
    ap.add_argument("--peers", default=None,
                    help="comma-separated peers to run: mooncake (vLLM's MooncakeStoreConnector), example "
                    "(ExampleConnector), offloading (vLLM's OffloadingConnector, in-process CPU tier), simple-cpu "
                    "(vLLM's SimpleCPUOffloadConnector, in-process CPU tier, vLLM's prefix cache emptied before "
                    "each repeat), lmcache (LMCache's multi-process mode: with LMCache 0.5.6 and vLLM 0.32, vLLM "
                    "does not finish starting, so it is not in the default); '' for none. Default: mooncake, "
                    "example, offloading, simple-cpu, less those known not to start on this vLLM build "
                    "(KNOWN_START_FAILURES: the table says so; name them here to try them anyway)")
    ap.add_argument("--json", type=Path, default=RESULTS / "ttft.json")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temp folder)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the vLLM worker with py-spy during the longest cached load from the disk tier")
    ap.add_argument("--peers-only", action="store_true",
                    help="run plain vLLM (recompute and the floor) and the peers, not our configurations")
    ap.add_argument("--replot", type=Path, default=None, help="print the table and redraw the plot of a JSON result")
    ap.add_argument("--bases", default=None,
                    help="comma-separated block-aligned lengths; each also runs one token past it "
                    "(default 2048,4096,8192; --quick: 512,1024). E.g. --bases 8192 for the 8,192/8,193 rows only")
    ap.add_argument("--readers", default=",".join(DEFAULT_READERS),
                    help=f"our fresh-process readers to run, comma-separated from {','.join(READERS)} (default "
                    f"{','.join(DEFAULT_READERS)}; disk-one-pass: the disk tier with verify_on_lookup: false, "
                    "each chunk read and checked once, straight into paged KV, at load time); '' for none")
    ap.add_argument("--no-concurrent", action="store_true",
                    help="skip the short-request-during-a-long-load measurement")
    ap.add_argument("--concurrent-trials", type=int, default=3,
                    help="fresh servers per loading mode for the short-request-during-a-long-load measurement "
                    "(default 3, which keeps make bench under 30 minutes; medians are reported)")
    args = ap.parse_args(argv)
    if args.replot:
        replot(args.replot)
        return 0
    skipped = {} if args.peers is not None else known_start_failures()
    peers = {p for p in (args.peers if args.peers is not None else DEFAULT_PEERS).split(",") if p} - set(skipped)

    from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
    from lmcache_mooncake.testing.models import ModelSpec, build_model

    if args.quick:
        model = str(build_model(ModelSpec(arch="qwen2", size="small", seed=0)))
        bases = [512, 1024]
    else:
        model = str(build_model(ModelSpec(arch="qwen2", size="0.5b", seed=0, max_position_embeddings=16384)))
        bases = [2048, 4096, 8192]
    if args.bases:
        bases = [int(b) for b in args.bases.split(",") if b]
    readers_wanted = [r for r in args.readers.split(",") if r]
    unknown = sorted(set(readers_wanted) - set(READERS))
    if unknown:
        ap.error(f"--readers: unknown {', '.join(unknown)}; choose from {', '.join(READERS)}")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    families = {b: [rng.randrange(10, vocab - 10) for _ in range(b + 1)] for b in bases}
    max_len = max(bases) + 64
    work = args.work or Path(tempfile.mkdtemp(prefix="lmcm-bench-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    run = Run(model=model, lengths=[n for b in bases for n in (b, b + 1)])
    kv_bytes_per_token = 0
    print(f"model {model}\nwork folder {work}", flush=True)

    def record(config: str, tokens: list[int], server: Server, note: str = "") -> None:
        t, cached = server.ttft(tokens)
        run.rows.append(Measure(config, len(tokens), t, cached, note))
        print(f"  {config:40s} {len(tokens):6d} tokens  TTFT {t * 1000:9.1f} ms  cached {cached}", flush=True)

    def same_process(first: str, repeat: str, s: Server, reset: bool = False, settle_s: float = 3) -> None:
        """Each family computed once (``first``), then asked again whole and block-aligned (``repeat``).
        ``reset``: empty vLLM's own prefix cache before each repeat (``/reset_prefix_cache``, dev mode),
        so a connector's in-process tier, not vLLM's cache, serves it. ``settle_s``: the wait after
        the first request (0 for a server with no connector: nothing is written after it)."""
        for b, fam in families.items():
            record(first, fam, s)
            # The first request's writes to the slower tiers (about 200 MB each at 8k tokens) go on
            # in the background after its answer: let them end, so the repeat measures its tier,
            # not the two cores shared with those writes (8,193 tokens: 951 ms right after the write,
            # the block-aligned repeat after it 378 ms, in one run of 2026-12-03).
            time.sleep(settle_s)
            for tokens in (fam, fam[:b]):
                if reset:
                    s.reset_prefix_cache()
                record(repeat, tokens, s)

    longest = families[max(bases)]

    def concurrent_trial(s: Server, mode: str, trial: int) -> tuple[list[float], float, float]:
        """Three new short requests alone, then one 20 ms after the longest prompt:
        ``(alone, during, long)`` latencies in seconds."""
        # Short prompts are new each time (computed: nothing cached).
        alone = [s.ttft([rng.randrange(10, vocab - 10) for _ in range(64)])[0] for _ in range(3)]
        during, long_s = _short_during_load(s, longest, [rng.randrange(10, vocab - 10) for _ in range(64)])
        print(f"  short request ({mode}, trial {trial + 1}): alone {_ms(alone)} ms, during the "
              f"{len(longest)}-token prompt {during * 1000:.0f} ms (which took {long_s * 1000:.0f} ms)", flush=True)
        return alone, during, long_s

    def record_concurrent(mode: str, trials: list[tuple[list[float], float, float]]) -> None:
        med = statistics.median
        alone = [a for t in trials for a in t[0]]
        during, long_s = [t[1] for t in trials], [t[2] for t in trials]
        # Servers differ by up to ~200 ms on the same short request: compare within one.
        delay = [t[1] - med(t[0]) for t in trials]
        run.rows.append(Measure(f"short request alone ({mode})", 64, med(alone), 0,
                                note=f"median of {len(alone)}: {_ms(alone)} ms"))
        run.rows.append(Measure(f"short request while {len(longest)} tokens load ({mode})", 64,
                                med(during), 0, note=f"median of {len(during)}: {_ms(during)} ms; the long "
                                f"prompt took {_ms(long_s)} ms"))
        run.rows.append(Measure(f"long prompt with a short one ({mode})", len(longest), med(long_s), 0,
                                note=f"median of {len(long_s)}"))
        run.rows.append(Measure(f"short request delayed by the load ({mode})", 64, med(delay), 0,
                                note=f"median over servers of (during - alone): {_ms(delay)} ms"))

    @dataclass
    class Peer:
        """A peer connector: a writer computes the families of ``bases``, then fresh readers
        (prefix caching on, as vLLM's own connectors want it) measure the one-past and the
        aligned prompts."""

        label: str
        name: str
        kv: dict[str, Any]
        bases: list[int] = field(default_factory=list)
        server_kw: dict[str, Any] = field(default_factory=dict)
        whiches: tuple[str, ...] = ("past", "aligned")  # its fresh readers (see reader_pair)

        def server(self, server_name: str, drains: bool = False) -> Server:
            return Server(server_name, model, work, self.kv, True, max_len, wait=False, drains=drains,
                          **self.server_kw)

        def fail(self, e: RuntimeError) -> None:  # a peer that does not run here is a finding
            print(f"  {self.label} failed on this machine: {str(e)[:400]}", flush=True)
            run.rows.append(Measure(f"{self.label}, fresh process", 0, 0.0, 0, note=f"failed: {str(e)[:200]}"))

    def peers_measured(group: list[Peer]) -> None:
        """The writers of ``group`` start two at a time and write one after the other; then the
        peers' readers start two at a time (three at once when there are three: the
        ``MooncakeStoreConnector``'s two and ``ExampleConnector``'s one) and are measured."""
        by_writer = {f"{p.name}-writer": p for p in group}
        launch = [functools.partial(p.server, f"{p.name}-writer", drains=True) for p in group]
        written = []
        for s in ready_in_groups(launch, servers, failed=lambda s, e: by_writer[s.name].fail(e)):
            p = by_writer[s.name]
            try:
                for b in p.bases or list(families):
                    record(f"{p.label}, writing", families[b], s)
                time.sleep(2)  # let its background writes finish
                written.append(p)
            except RuntimeError as e:
                p.fail(e)
            finally:
                s.stop()
        readers: dict[str, tuple[Peer, str]] = {}  # server name -> (peer, which)
        launch = []
        for p in written:
            whiches, launchers = reader_pair(p.name, p.server, p.whiches)
            readers.update({f"{p.name}-{w}": (p, w) for w in whiches})
            launch += launchers
        for s in ready_in_groups(launch, servers, failed=lambda s, e: readers[s.name][0].fail(e),
                                 size=3 if len(launch) == 3 else 2):
            p, which = readers[s.name]
            try:
                for b in p.bases or list(families):
                    fam = families[b]
                    record(f"{p.label}, fresh process", fam if which == "past" else fam[:b], s)
            except RuntimeError as e:
                p.fail(e)
            finally:
                s.stop()

    store_dir = work / "store"
    st = start_store(StoreSpec(state_dir=store_dir, memory_bytes=2 << 30))
    servers: list[Server] = []
    disk = work / "disk"
    shm_store = {"master_address": "auto", "metadata_server": "auto", "store_dir": str(store_dir)}
    tcp_store = {"master_address": st.master_addr, "metadata_server": st.metadata_url, "mode": "tcp"}
    cfg_all = write_config(work / "all.yaml", disk=disk, store=shm_store)
    try:
        # Steps 1 and 2 (plain vLLM, then our writer) start together.
        first = [functools.partial(Server, "plain", model, work, None, True, max_len, wait=False)]
        if not args.peers_only:
            # Our writer: every tier at once; prefix caching off so repeats come from our CPU tier.
            first.append(functools.partial(Server, "ours-writer", model, work,
                                           ours(cfg_all, run_dir=str(work / "ours-writer" / "run")), False,
                                           max_len, wait=False, drains=True))
        first_servers = ready_in_groups(first, servers)
        # 1. plain vLLM: recompute, then its own prefix-cache hit.
        s = next(first_servers)
        same_process("recompute (plain vLLM)", "vLLM prefix cache, same process", s, settle_s=0)
        if not args.no_concurrent:
            # The control of step 4: the long prompt served by vLLM's own prefix cache (nothing
            # loaded), so the short request's delay is only the long prompt's own work (its HTTP
            # handling, its last token's forward). One server: the prompt stays cached.
            record_concurrent(CONTROL_MODE, [concurrent_trial(s, CONTROL_MODE, t)
                                             for t in range(args.concurrent_trials)])
        s.stop()

        def run_peers() -> None:
            group = []
            if "mooncake" in peers:
                mc_json = work / "mooncake-peer.json"
                mc_json.write_text(json.dumps({
                    "metadata_server": st.metadata_url, "master_server_address": st.master_addr,
                    "protocol": "tcp", "mode": "standalone-store", "global_segment_size": 0,
                    "local_buffer_size": "1GB"}))
                env = {"MOONCAKE_CONFIG_PATH": str(mc_json), "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
                kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
                group.append(Peer("vLLM MooncakeStoreConnector", "mooncake", kv, server_kw={"env": env}))
            if "example" in peers:
                kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")}}
                # Only the shortest length, one past a block: it has loaded nothing at any
                # length here (its fresh readers recompute), and each miss costs a full
                # recompute and a reader's start (~25 s).
                group.append(Peer("vLLM ExampleConnector", "example", kv, bases=[min(families)],
                                  server_kw={"extra": ["--max-num-batched-tokens", str(max_len)]},
                                  whiches=("past",)))
            peers_measured(group)
            if "lmcache" in peers:
                try:
                    with lmcache_server(work) as port:
                        kv = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                            "lmcache.mp.port": port}}
                        peers_measured([Peer("LMCache multi-process", "lmcache-mp", kv)])
                except RuntimeError as e:
                    print(f"  LMCache multi-process failed on this machine: {e}", flush=True)
            # vLLM's in-process CPU offloading, started together.
            labels = PEER_LABELS
            for key, err in skipped.items():
                why = f"not started: fails at start-up on this vLLM build ({err}); --peers {key} tries it"
                print(f"  {labels[key]}: {why}", flush=True)
                run.rows.append(Measure(f"{labels[key]}, same process", 0, 0.0, 0, note=why))
            launch = []
            if "offloading" in peers:
                kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
                launch.append(functools.partial(Server, "offloading", model, work, kv, False, max_len, wait=False))
            if "simple-cpu" in peers:
                # It needs vLLM's prefix cache on, which is emptied before each repeat so the
                # repeat is served by the connector's CPU tier.
                kv = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
                launch.append(functools.partial(Server, "simple-cpu", model, work, kv, True, max_len,
                                                env={"VLLM_SERVER_DEV_MODE": "1"}, wait=False))

            def did_not_start(s: Server, e: RuntimeError) -> None:
                print(f"  {labels[s.name]} does not start on this build: {str(e)[:300]}", flush=True)
                run.rows.append(Measure(f"{labels[s.name]}, same process", 0, 0.0, 0, note="did not start"))

            for s in ready_in_groups(launch, servers, failed=did_not_start):
                label = labels[s.name]
                same_process(f"{label}, writing", f"{label}, same process", s, reset=(s.name == "simple-cpu"))
                s.stop()

        if args.peers_only:
            run_peers()
            return _finish(run, args, kv_bytes_per_token)
        # 2. our writer.
        s = next(first_servers)
        same_process("ours, writing (recompute + save)", "ours, CPU tier, same process", s)
        kv_bytes_per_token = _bytes_per_token(read_connector_metrics(s))
        s.stop()

        # 3. fresh readers, one tier each; one process for the one-past prompts, one for the aligned.
        configs = {
            "disk": write_config(work / "disk.yaml", disk=disk, store=None),
            "store-shm": write_config(work / "shm.yaml", disk=None, store=shm_store),
            "store-tcp": write_config(work / "tcp.yaml", disk=None, store=tcp_store),
            "disk-one-pass": write_config(work / "disk-one-pass.yaml", disk=disk, store=None,
                                          verify_on_lookup=False),
        }

        def our_reader(cfg: Path, server_name: str) -> Server:
            return Server(server_name, model, work, ours(cfg, run_dir=str(work / server_name / "run")), False,
                          max_len, wait=False)

        for reader in readers_wanted:
            label, cfg = READERS[reader], configs[reader]
            whiches, launch = reader_pair(reader, functools.partial(our_reader, cfg))
            for which, s in zip(whiches, ready_in_groups(launch, servers), strict=True):
                name = f"{reader}-{which}"
                share = page_cache_share(disk) if reader.startswith("disk") else None
                if share is not None:
                    run.page_cache[name] = share
                    print(f"  {name}: {share:.0%} of the disk tier's bytes in the page cache", flush=True)
                for b, fam in families.items():
                    prompt = fam if which == "past" else fam[:b]
                    if args.profile and b == max(bases) and which == "past" and reader == "disk":
                        with Profile(s, work / "profile-disk-load.txt") as prof:
                            record(label, prompt, s)
                        run.profile = prof.summary()
                    else:
                        record(label, prompt, s)
                run.load_stats[name] = read_connector_metrics(s)
                s.stop()

        # 4. a short request sent while a long prompt loads, with loads synchronous and asynchronous.
        # One 64-token request takes 100-600 ms here and varies by up to ~200 ms from one server to
        # the next, so each mode runs --concurrent-trials fresh servers (the long prompt must load
        # from disk each time): per server, three short requests alone, then one 20 ms after the
        # long prompt; the delay is that one against the same server's alone median. The control
        # (step 1's plain server) is the same with nothing loaded.
        def trial_server(mode: str, trial: int) -> Server:
            name = f"concurrent-{mode}-{trial}"
            cfg = write_config(work / f"{name}.yaml", disk=disk, store=None)
            return Server(name, model, work, ours(cfg, run_dir=str(work / name / "run"),
                                                  async_loading=(mode == "async")), False, max_len, wait=False)

        # The two modes' servers alternate (sync, async, sync, ...), so each pair started together
        # holds one of each and a drift of the machine over the run reaches both modes alike.
        modes = () if args.no_concurrent else ("sync", "async")
        plan = [(mode, t) for t in range(args.concurrent_trials) for mode in modes]
        trials: dict[str, list[tuple[list[float], float, float]]] = {mode: [] for mode in modes}
        launch = [functools.partial(trial_server, mode, t) for mode, t in plan]
        for (mode, trial), s in zip(plan, ready_in_groups(launch, servers), strict=True):
            trials[mode].append(concurrent_trial(s, f"{mode} loads", trial))
            s.stop()
        for mode in modes:
            record_concurrent(f"{mode} loads", trials[mode])

        # 5. peers.
        run_peers()
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop(grace_s=10)
        stop_store(store_dir)

    return _finish(run, args, kv_bytes_per_token)


def _finish(run: Run, args: argparse.Namespace, kv_bytes_per_token: int) -> int:
    nbytes = kv_bytes_per_token * max(run.lengths) if kv_bytes_per_token else 200 << 20
    run.memcpy_gbps = memcpy_gbps(nbytes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(asdict(run) | {"kv_bytes_per_token": kv_bytes_per_token}, indent=2))
    print_table(run, kv_bytes_per_token)
    plot(run, args.json.with_suffix(".png"))
    print(f"\nwrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


@contextlib.contextmanager
def lmcache_server(work: Path) -> Any:
    """LMCache's multi-process server (2 GiB L1) on a free loopback port; yields the port."""
    import socket

    port = free_port()
    log = work / "lmcache-server.log"
    with open(log, "w") as f:
        lm = subprocess.Popen([str(Path(PY).with_name("lmcache")), "server", "--host", "127.0.0.1", "--port",
                               str(port), "--l1-size-gb", "2", "--eviction-policy", "LRU", "--chunk-size", "256",
                               "--http-port", str(free_port()), "--disable-observability"],
                              stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if lm.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server did not start; see {log}")
            time.sleep(0.5)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lm.pid, signal.SIGTERM)
        try:
            lm.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(lm.pid, signal.SIGKILL)
            lm.wait()


def _ms(values: list[float]) -> str:
    return "/".join(f"{v * 1000:.0f}" for v in values)


def _short_during_load(server: Server, long_prompt: list[int], short: list[int]) -> tuple[float, float]:
    """Send ``long_prompt`` (cached: it loads), then ``short`` 20 ms later; their latencies."""
    import threading

    out: dict[str, float] = {}

    def long_req() -> None:
        out["long"] = server.ttft(long_prompt)[0]

    t = threading.Thread(target=long_req)
    t.start()
    time.sleep(0.02)
    with httpx.Client(base_url=server.url, timeout=900) as c:
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json={"model": server.model, "prompt": short, "max_tokens": 1,
                                            "temperature": 0.0})
        short_s = time.perf_counter() - t0
    r.raise_for_status()
    t.join()
    return short_s, out["long"]


def _bytes_per_token(stats: dict[str, float]) -> int:
    tokens = stats.get("saved_tokens_total", 0)
    written = stats.get("written_bytes_total{tier=store}", 0) or stats.get("written_bytes_total{tier=disk}", 0)
    return int(written / tokens) if tokens else 0


def print_table(run: Run, kv_bytes_per_token: int) -> None:
    # (the delay row is during - alone within each server, so it can be below 0)
    concurrent = [m for m in run.rows if m.config.startswith(CONCURRENT_ROWS)]
    configs = [c for c in dict.fromkeys(m.config for m in run.rows) if not c.startswith(CONCURRENT_ROWS)]
    lengths = sorted(set(run.lengths))
    floor = {m.prompt_tokens: m.ttft_s for m in run.rows if m.config.startswith("vLLM prefix cache")}
    peer = {m.prompt_tokens: m.ttft_s for m in run.rows if m.config == "vLLM MooncakeStoreConnector, fresh process"}
    print("\nTTFT in ms (cached tokens); x floor = / vLLM's own prefix-cache hit; x MSC = / vLLM "
          "MooncakeStoreConnector, fresh process")
    print(f"{'configuration':42s}" + "".join(f"{n:>22d}" for n in lengths))
    for c in configs:
        cells = []
        for n in lengths:
            m = next((m for m in run.rows if m.config == c and m.prompt_tokens == n), None)
            if m is None:
                cells.append(f"{'-':>22s}")
                continue
            extra = ""
            if n in floor and not c.startswith(("vLLM prefix", "recompute")) and "writing" not in c:
                extra = f" {m.ttft_s / floor[n]:.1f}xF"
            cells.append(f"{m.ttft_s * 1000:9.0f} ({m.cached_tokens:5d}){extra:>7s}")
        print(f"{c:42s}" + "".join(cells))
    for c in configs:
        if c.startswith("ours") and "fresh" in c:
            for n in lengths:
                m = next((m for m in run.rows if m.config == c and m.prompt_tokens == n), None)
                if m and n in peer:
                    print(f"  {c} at {n}: {m.ttft_s / peer[n]:.2f} x MooncakeStoreConnector")
    if concurrent:
        print("\na short (64-token) request and a long prompt loading from disk (medians over fresh servers):")
        for m in concurrent:
            print(f"  {m.config:52s} {m.ttft_s * 1000:7.0f} ms  ({m.note})")
    print(f"\nplain memory copy in this run: {run.memcpy_gbps:.2f} GB/s; KV {kv_bytes_per_token} bytes/token")
    for name, share in run.page_cache.items():
        print(f"{name}: {share:.0%} of the disk tier's bytes were in the page cache at its first request")
    if run.profile:
        print("profile of the worker during the longest cached load from the disk tier (py-spy, 200 Hz, s):")
        for cat, secs in run.profile.items():
            print(f"  {cat:45s} {secs:6.3f}")
    print("  load and save bandwidth per tier against memcpy: benchmarks/tier_load.py")


def plot(run: Run, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    skip = ("writing", "recompute", *CONCURRENT_ROWS)
    configs = [c for c in dict.fromkeys(m.config for m in run.rows) if not any(w in c for w in skip)]
    lengths = sorted(set(run.lengths))
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(12, 5.5))
    width = 0.8 / max(len(configs), 1)
    for i, c in enumerate(configs):
        ys = [next((m.ttft_s for m in run.rows if m.config == c and m.prompt_tokens == n), 0) for n in lengths]
        ax.bar([x + i * width for x in range(len(lengths))], ys, width, label=c, color=colors[i % len(colors)])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(lengths))], [str(n) for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, cached prompt (s, log scale)")
    ax.set_xlabel("prompt tokens (block-aligned, and one past)")
    ax.set_title("Cached TTFT, one run on one store (2 CPU cores, Qwen2-0.5B shape, float32)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(json_path: Path) -> None:
    data = json.loads(json_path.read_text())
    run = Run(model=data["model"], lengths=data["lengths"], rows=[Measure(**m) for m in data["rows"]],
              memcpy_gbps=data.get("memcpy_gbps", 0.0), profile=data.get("profile", {}),
              page_cache=data.get("page_cache", {}))
    print_table(run, data.get("kv_bytes_per_token", 0))
    plot(run, json_path.with_suffix(".png"))

if __name__ == "__main__":
    sys.exit(main())
