"""A bounded soak: 16 concurrent clients against one served instance with small tier caps.

The load mixes prompts that share a prefix with unique ones, for a fixed
time, and stops by itself. Warm-up lasts until the bytes written through the
tiers passed twice the largest tier cap (CPU 24 MiB, disk 32 MiB, store
32 MiB; chunks are 1 MiB), so every tier is full and evicting, and at least a
quarter of the load. Then:

- resident memory of every process (vLLM's three, the master, the storage
  process), sampled with psutil each second, grows less than 5% from the end
  of warm-up to the end of the load, the lowest of 5 samples at each end so
  that blocks of requests in flight at one instant are not growth (the worker
  runs with a fixed glibc mmap threshold, ``heap_mmap_threshold``: vLLM's own
  forward passes fragment the heap otherwise, with or without us; and vLLM
  runs with a small oneDNN kernel cache, whose default of 1,024 kernels, one
  per batch size and layer, takes minutes of this load to fill);
- LMCache's CPU tier holds no pinned chunk once requests ended;
- a sample of prompts, sent again one at a time after the load (so they load
  what the tiers kept), gives the tokens a recompute gives.

``--soak-minutes N`` runs the load for N minutes (default: 1).
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from servers import Server

from lmcache_mooncake.commands.serve import vllm_command
from lmcache_mooncake.obs.stats import read_dumps
from lmcache_mooncake.runtime.procs import free_port
from lmcache_mooncake.store.launcher import StoreSpec, read_state, start_store, stop_store
from lmcache_mooncake.testing.models import ModelSpec, build_model
from lmcache_mooncake.testing.offline import RunSpec, run_instance, vllm_env

pytestmark = pytest.mark.e2e
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096"]
CLIENTS = 16
MiB = 1 << 20
CPU_CAP, DISK_CAP, STORE_CAP = 24 * MiB, 32 * MiB, 32 * MiB
ONEDNN_CACHE = 32  # oneDNN's primitive cache, in kernels (its default: 1,024)


class Load:
    """16 client threads: half the prompts share one of four 512-token prefixes, half are unique."""

    def __init__(self, url: str, model: str, seconds: float):
        self.url, self.model, self.deadline = url, model, time.monotonic() + seconds
        rng = random.Random(3)
        self.prefixes = [[rng.randrange(16, 2000) for _ in range(512)] for _ in range(4)]
        self.sent: list[list[int]] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def prompt(self, rng: random.Random) -> list[int]:
        if rng.random() < 0.5:
            return rng.choice(self.prefixes) + [rng.randrange(16, 2000) for _ in range(64)]
        return [rng.randrange(16, 2000) for _ in range(600)]

    def client(self, i: int) -> None:
        rng = random.Random(100 + i)
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while time.monotonic() < self.deadline:
                p = self.prompt(rng)
                r = http.post("/v1/completions", json={"model": self.model, "prompt": p, "max_tokens": 4,
                                                        "temperature": 0.0})
                with self.lock:
                    if r.status_code != 200:
                        self.errors.append(r.text[:200])
                    self.sent.append(p)

    def run(self) -> None:
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def processes(server: Server, store_dir: Path) -> dict[str, psutil.Process]:
    root = psutil.Process(server.proc.pid)
    out = {f"vllm-{i}-{p.name()}": p for i, p in enumerate([root, *root.children(recursive=True)])}
    st = read_state(store_dir)
    out["master"], out["storage"] = psutil.Process(st.master_pid), psutil.Process(st.client_pid)
    return out


def mapping_rss(pid: int) -> dict[str, int]:
    """Resident bytes of one process per mapping (file path; large anonymous regions by address)."""
    out: dict[str, int] = {}
    try:
        maps = psutil.Process(pid).memory_maps(grouped=False)
    except psutil.Error:
        return out
    for m in maps:
        name = m.path
        if name in ("", "[anon]"):
            lo, hi = (int(x, 16) for x in m.addr.split("-"))
            name = f"[anon {lo:#x}, {(hi - lo) >> 20} MiB]" if hi - lo >= 32 * MiB else "[anon small]"
        out[name] = out.get(name, 0) + m.rss
    return out


def grown_mappings(before: dict[str, int], after: dict[str, int], top: int = 5) -> str:
    diff = sorted(((after.get(k, 0) - before.get(k, 0), k) for k in after.keys() | before.keys()), reverse=True)
    return ", ".join(f"{k} {d / MiB:+.1f} MiB" for d, k in diff[:top] if d)


def sample_rss(procs: dict[str, psutil.Process], samples: list[tuple[float, dict[str, int]]],
               stop: threading.Event) -> None:
    while not stop.is_set():
        row = {}
        for name, p in procs.items():
            try:
                row[name] = p.memory_info().rss
            except psutil.Error:
                row[name] = 0
        samples.append((time.monotonic(), row))
        stop.wait(1.0)


@pytest.fixture(scope="module")
def soak(request, tmp_path_factory) -> dict:
    """Run the load once for the module; what the tests below check."""
    minutes = float(request.config.getoption("--soak-minutes"))
    tmp_path = tmp_path_factory.mktemp("soak")
    model = build_model(ModelSpec(arch="llama", size="tiny", seed=0))
    sd, run_dir = tmp_path / "store", tmp_path / "run"
    start_store(StoreSpec(memory_bytes=STORE_CAP, state_dir=sd))
    port = free_port()
    overrides = {"run_dir": str(run_dir), "max_local_cpu_size": CPU_CAP / 2**30,
                 "local_disk": str(tmp_path / "disk"), "max_local_disk_size": DISK_CAP / 2**30,
                 "mooncake": {"store_dir": str(sd), "timeout": 2.0},
                 # vLLM's own forward passes fragment glibc's heap under this load (plain vLLM, no
                 # connector: +11.5% in 2 min): a fixed mmap threshold takes that out, so what
                 # grows is ours (docs/reliability.md, "Soak").
                 "heap_mmap_threshold": 256 * 1024}
    # oneDNN keeps a JIT-compiled kernel per batch size of every linear layer, up to 1,024 by default
    # (~0.5 MiB each): the worker grew ~1 MiB/s for minutes as new batch sizes came, with or without
    # us (docs/reliability.md, "Soak"). A small cache bounds that, so what grows is ours.
    env = vllm_env(tmp_path / "vllm", extra={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE)})
    server = Server("soak", vllm_command("both", str(model), "127.0.0.1", port, None, VLLM_ARGS, overrides),
                    env, port, tmp_path / "soak.log")
    samples: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()
    try:
        server.start().wait_ready()
        sampler = threading.Thread(target=sample_rss, args=(processes(server, sd), samples, stop), daemon=True)
        sampler.start()
        load = Load(server.url, str(model), minutes * 60)
        loader = threading.Thread(target=load.run, daemon=True)
        t0 = time.monotonic()
        loader.start()
        warm_at = None
        vllm_pids = {n: p.pid for n, p in processes(server, sd).items() if n.startswith("vllm")}
        maps_at_warm: dict[str, dict[str, int]] = {}
        while loader.is_alive():
            c = read_dumps(run_dir)
            if warm_at is None and c.get("store_bytes_written", 0) > 2 * max(CPU_CAP, DISK_CAP, STORE_CAP):
                warm_at = time.monotonic()
            if not maps_at_warm and time.monotonic() >= max(warm_at or 1e18, t0 + 0.25 * minutes * 60):
                maps_at_warm = {n: mapping_rss(pid) for n, pid in vllm_pids.items()}
            time.sleep(1.0)
        grown = {n: grown_mappings(maps_at_warm.get(n, {}), mapping_rss(pid)) or "none"
                 for n, pid in vllm_pids.items()}  # where any growth after warm-up lies
        for n, where in grown.items():
            print(f"soak: {n} mappings grown after warm-up: {where}")
        stop.set()
        sampler.join()
        assert not load.errors, load.errors[:3]
        assert warm_at is not None, f"the tiers did not fill within the load: {read_dumps(run_dir)}"
        assert warm_at - t0 < 0.25 * minutes * 60, "the tiers took more than a quarter of the load to fill"
        # Warm-up also covers a quarter of the load: first-time allocations (vLLM's KV
        # blocks touched for the first time, code paths run once) are not growth.
        warm_at = max(warm_at, t0 + 0.25 * minutes * 60)
        (tmp_path / "rss.json").write_text(json.dumps({"t0": t0, "warm_at": warm_at, "samples": samples}))

        # Memory after warm-up: the lowest of the first 5 samples past it against the lowest of
        # the last 5. Under the load a sample also holds whatever the requests in flight hold
        # (with the fixed mmap threshold each large block is its own mapping, "[anon small]");
        # a leak lifts the lowest sample too.
        after = [row for t, row in samples if t >= warm_at]
        assert len(after) >= 10, len(after)
        growth, grew = {}, {}
        for name in after[0]:
            first = min(r[name] for r in after[:5])
            last = min(r[name] for r in after[-5:])
            growth[name] = (last - first) / first if first else 0.0
            grew[name] = (f"{first / MiB:.0f} -> {last / MiB:.0f} MiB ({growth[name]:+.1%}), "
                          f"{len(after)} samples after {warm_at - t0:.0f} s of warm-up; "
                          f"mappings grown: {grown.get(name, 'not sampled')}")
        mid = after[len(after) // 2]
        print(f"soak: {len(load.sent)} requests in {minutes:g} min, warm-up {warm_at - t0:.0f} s; RSS at warm-up / "
              "half-way / end (growth): " + ", ".join(
                  f"{n} {after[0][n] / MiB:.0f}/{mid[n] / MiB:.0f}/{after[-1][n] / MiB:.0f} MiB ({g:+.1%})"
                  for n, g in growth.items()))

        time.sleep(1.0)
        sample = random.Random(9).sample(load.sent, 16)
        served = []
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for p in sample:  # one at a time, after the load: they load what the tiers kept
                r = http.post("/v1/completions", json={"model": str(model), "prompt": p, "max_tokens": 4,
                                                        "temperature": 0.0, "return_token_ids": True})
                assert r.status_code == 200, r.text[:300]
                served.append(r.json()["choices"][0]["token_ids"])
            time.sleep(1.0)
            http.post("/v1/completions", json={"model": str(model), "prompt": [5] * 8, "max_tokens": 1})
        time.sleep(1.0)
        c = read_dumps(run_dir)
        print(f"soak: CPU tier {c.get('cpu_tier_chunks', 0)} chunks, {c.get('cpu_tier_pinned_chunks', 0)} pinned;"
              f" store hits {c.get('store_hits', 0)}, disk hits {c.get('disk_hits', 0)},"
              f" disk evictions {c.get('disk_evictions', 0)}")
    finally:
        stop.set()
        server.kill()
        stop_store(sd)

    ref = run_instance(RunSpec(model=str(model), prompts=sample, kv_role=None, prefix_caching=False,
                               max_tokens=4), tmp_path / "ref")
    return {"growth": growth, "grew": grew, "counters": c, "served": served, "recomputed": [r.output_ids for r in ref]}


def test_sample_after_soak_matches_recompute(soak):
    assert soak["served"] == soak["recomputed"]


def test_nothing_pinned_in_cpu_tier_after_requests_end(soak):
    c = soak["counters"]
    assert c.get("cpu_tier_chunks", 0) > 0  # the count is real: the tier holds chunks
    assert c.get("cpu_tier_pinned_chunks", 0) == 0


def test_resident_memory_flat_after_warm_up(soak):
    grown = {n: soak["grew"][n] for n, g in soak["growth"].items() if g >= 0.05}
    assert not grown, "; ".join(f"{n}: {what}" for n, what in grown.items())
