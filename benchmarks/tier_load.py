"""Load and save bandwidth of each tier, as a fraction of a plain memory copy of the same bytes.

No vLLM: the connector's own engine (:func:`lmcache_mooncake.engine.build_engine`,
LMCache with our copier, keys and tiers) against paged KV tensors in vLLM's
CPU layout (one allocation viewed per layer, as vLLM's model runner makes
them), in the Qwen2-0.5B geometry (24 layers, 2 KV heads of 64, float32,
blocks of 128). One prompt of ``--tokens`` tokens is stored, then loaded
back into other blocks:

- ``cpu``: the same engine (its CPU tier), so one copy per chunk;
- ``disk``, ``store-shm``, ``store-tcp``: a fresh engine with only that tier
  (and an empty CPU tier), as a fresh vLLM process would be, with its
  buffers already touched once (a real server's are warm after its first
  requests; ``--cold`` measures the first load of a process instead);
- ``disk-one-pass``: the disk tier with ``verify_on_lookup: false`` (the
  lookup only checks that files exist; the load reads and checks each once).

Each reader tier is loaded by fresh processes (``--repeat`` of them) the way a
served worker loads (``worker``: :class:`~lmcache_mooncake.connector.direct.DirectLoader`
for chunks the CPU tier does not hold, LMCache's ``retrieve`` for the rest,
as ``WorkerSide._load`` runs them); ``--paths worker,lmcache`` also loads each
through LMCache's ``retrieve`` alone (``lmcache``), so the table shows what
skipping LMCache's buffers gives.
Load time is the lookup plus the load (what a cached request waits for);
save time is ``store()`` plus waiting until every tier has written. The
baseline is ``torch`` copying the same number of bytes in the same run.
``--profile`` prints cProfile's top functions for each load. ``--auth`` seals
every chunk with a keyed MAC (``chunk_auth_key_file``, keyed BLAKE3) instead of
the XXH3-128 checksum, to measure what authenticated chunks cost.
Each engine runs in its own process (LMCache's engine keeps process-wide
state), so the figures come from fresh processes. They start two at a time
(imports and set-up, about 10 s of one core each, overlap) and are timed one
at a time: a process sets up, says it is ready, and waits for its turn.

    .venv/bin/python benchmarks/tier_load.py [--tokens 8192] [--paths worker,lmcache] [--auth] [--json PATH] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
L, H, D, N = 24, 2, 64, 128


def child(args: argparse.Namespace) -> None:
    """One engine in this process: save (role writer) or load (role reader) and print JSON timings."""
    import torch
    from layout_copy import vllm_kv_caches

    from lmcache_mooncake import engine
    from lmcache_mooncake.chunks.keys import KeyNamespace
    from lmcache_mooncake.config import CacheConfig, MooncakeConfig
    from lmcache_mooncake.connector import direct  # noqa: F401  (imported, as in a worker, before any timing)
    from lmcache_mooncake.kv import layouts

    torch.set_num_threads(1)
    tokens = torch.arange(args.tokens) % 2000 + 7
    blocks = -(-args.tokens // N)
    # One allocation viewed per layer, as vLLM's model runner allocates it (and zeroed,
    # as vLLM's is), so the copies see vLLM's strides.
    kv = vllm_kv_caches("LBHNC", L, blocks * 2 + 4, H, N, D, torch.float32, torch.device("cpu"))
    for layer in kv:
        layer.zero_()
    mc = None
    if args.tier.startswith("store"):
        mc = MooncakeConfig(store_dir=args.store_dir, mode="tcp" if args.tier == "store-tcp" else "auto",
                            local_buffer_size=512 << 20, timeout=10.0, put_timeout=30.0)
    disk = args.disk if args.tier in ("disk", "disk-one-pass", "cpu") else None
    cfg = CacheConfig(max_local_cpu_size=1.0, local_disk=disk, mooncake=mc)
    cfg = dataclasses.replace(cfg, chunk_auth_key_file=args.auth_file,
                              verify_on_lookup=args.tier != "disk-one-pass")
    layout = layouts.layout_for_backend("CPU_ATTN")
    # The chunk layout a served worker picks for these tensors ("blocks" for float32 here).
    ns = KeyNamespace("bench", "float32", L, H, D, 256, chunk_layout=layout.chunk_layout(kv[0], 256))
    name = f"bench-{args.role}-{args.tier}"
    eng = engine.build_engine(cfg, ns, layout, torch.float32, name)
    rc = engine.request_configs(None, None)
    out: dict[str, float] = {}
    try:
        if args.role == "reader" and not args.cold:
            # Touch the buffers once, as a serving process's first requests do.
            other = torch.arange(args.tokens) % 1999 + 3
            eng.lookup(tokens=other, request_configs=rc)
        # Set up: wait for the parent's go (one line on stdin), so only one process is timed at once.
        print("@@ready", flush=True)
        sys.stdin.readline()
        if args.role == "writer":
            for layer in kv:
                layer.normal_()
            slots = torch.arange(args.tokens)
            t0 = time.perf_counter()
            eng.store(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
            t1 = time.perf_counter()
            if not engine.drain(eng, 120):
                raise SystemExit("writes did not finish")
            out.update(store_s=t1 - t0, durable_s=time.perf_counter() - t0)
            if args.tier == "cpu":
                _load(eng, kv, tokens, rc, out, args)
        else:
            _load(eng, kv, tokens, rc, out, args)
    finally:
        engine.close_engine(eng, name)
    print("@@" + json.dumps(out), flush=True)


def _load(eng, kv, tokens, rc, out: dict[str, float], args: argparse.Namespace) -> None:
    import cProfile
    import io
    import pstats

    import torch

    blocks = -(-args.tokens // N)
    # Other blocks than the writer's, in another order: a real load's destination.
    dst_blocks = torch.randperm(blocks * 2 + 4)[:blocks]
    slots = (dst_blocks[:, None] * N + torch.arange(N)).reshape(-1)[: args.tokens]
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    if args.path == "worker":
        hit, lookup_s, got, out["runs"] = _load_as_worker(eng, kv, tokens, slots, rc)
        t1 = t0 + lookup_s
    else:
        hit = eng.lookup(tokens=tokens, request_configs=rc)
        t1 = time.perf_counter()
        got = int(eng.retrieve(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc).sum())
    t2 = time.perf_counter()
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18)
        print(s.getvalue(), file=sys.stderr)
    if hit != args.tokens or got != args.tokens:
        raise SystemExit(f"{args.tier} ({args.path}): lookup hit {hit}, loaded {got} of {args.tokens}")
    out.update(lookup_s=t1 - t0, retrieve_s=t2 - t1, load_s=t2 - t0)


def _load_as_worker(eng, kv, tokens, slots, rc) -> tuple[int, float, int, list[str]]:
    """Look up and load ``tokens`` as a served worker does (``lookup_tiers``, then
    ``WorkerSide._load``'s runs: DirectLoader for chunks the CPU tier does not hold, LMCache's
    retrieve for the rest). Returns the hit, the lookup's seconds, where the loaded prefix
    ends, and each run as ``kind:chunks``."""
    import torch

    from lmcache_mooncake.connector.direct import ENGINE, DirectLoader
    from lmcache_mooncake.engine import lookup_tiers

    t0 = time.perf_counter()
    hit, _ = lookup_tiers(eng, tokens.tolist(), rc)
    lookup_s = time.perf_counter() - t0
    direct = DirectLoader.for_engine(eng)
    chunks = list(eng.token_database.process_tokens(tokens, request_configs=rc))
    runs = direct.segments(chunks, kv) if direct is not None else [(ENGINE, chunks)]
    slot_list = slots.tolist()
    loaded, kinds = 0, []
    for kind, run in runs:
        first, last = run[0][0], run[-1][1]
        kinds.append(f"{kind}:{len(run)}")
        if kind == ENGINE:
            mask = torch.zeros(last, dtype=torch.bool)
            mask[first:] = True
            ret = eng.retrieve(tokens[:last], mask=mask, kvcaches=kv, slot_mapping=slots[:last], request_configs=rc)
            loaded = first + int(ret[first:].long().cumprod(0).sum().item())
        else:
            loaded = direct.load(kind, run, kv, slot_list, 0, len(tokens))
        if loaded < last:
            break
    return hit, lookup_s, loaded, kinds


class Child:
    """One engine process (see :func:`child`), launched now; :meth:`measure` times it."""

    def __init__(self, role: str, tier: str, args: argparse.Namespace, disk: str, store_dir: str,
                 path: str = "lmcache"):
        self.what, self.path, self.args = f"{role} {tier}", path, args
        cmd = [sys.executable, __file__, "--child", role, "--tier", tier, "--tokens", str(args.tokens),
               "--disk", disk, "--store-dir", store_dir, "--path", path] + (["--profile"] if args.profile else []) \
            + (["--cold"] if args.cold else []) + (["--auth-file", args.auth_file] if args.auth_file else [])
        # Output to files, not pipes: a child that logs much cannot block while its pair-mate is timed.
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.out, stderr=self.err, text=True)

    def _lines(self) -> list[str]:
        self.out.seek(0)
        return [x for x in self.out.read().splitlines() if x.startswith("@@")]

    def _fail(self, why: str) -> SystemExit:
        self.err.seek(0)
        self.out.seek(0)
        return SystemExit(f"{self.what} {why}:\n{self.out.read()[-2000:]}\n{self.err.read()[-4000:]}")

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while "@@ready" not in self._lines():
            if self.proc.poll() is not None:
                raise self._fail("failed before it was ready")
            if time.monotonic() > deadline:
                self.stop()
                raise self._fail("was not ready in time")
            time.sleep(0.05)

    def measure(self, timeout_s: float = 600) -> dict[str, float]:
        """Let the child load (or save) and return its timings."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise self._fail("timed out") from None
        lines = [x for x in self._lines() if x != "@@ready"]
        if self.proc.returncode != 0 or not lines:
            raise self._fail("failed")
        if self.args.profile:
            self.err.seek(0)
            prof = [x for x in self.err.read().splitlines() if "function calls" in x or x.strip()[:1].isdigit()]
            print(f"--- profile, {self.what} ({self.path})\n" + "\n".join(prof[:22]))
        return json.loads(lines[-1][2:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_children(jobs: list[tuple[str, str, str]], args: argparse.Namespace, disk: str,
                 store_dir: str) -> list[dict[str, float]]:
    """Run ``(role, tier, path)`` jobs two at a time: both processes start together (their imports
    and set-up overlap on two cores), then each is timed alone, in order. Returns their timings."""
    results: list[dict[str, float]] = []
    for k in range(0, len(jobs), 2):
        pair = [Child(role, tier, args, disk, store_dir, path) for role, tier, path in jobs[k : k + 2]]
        try:
            for c in pair:
                c.wait_ready()
            results.extend(c.measure() for c in pair)
        finally:
            for c in pair:
                c.stop()
    return results


def memcpy_s(nbytes: int) -> float:
    import torch

    torch.set_num_threads(1)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tiers", default="cpu,disk,disk-one-pass,store-shm,store-tcp")
    ap.add_argument("--paths", default="worker",
                    help="how readers load: worker (as a served worker: DirectLoader, then LMCache's retrieve), "
                         "lmcache (LMCache's retrieve alone); comma-separated (default worker: the product's "
                         "path; worker,lmcache adds the comparison, about 1.5 minutes more)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="fresh reader processes per tier and path; the table shows the median load (of two, "
                    "the slower; default 2, which keeps make bench under 30 minutes)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "tier_load.json")
    ap.add_argument("--profile", action="store_true", help="cProfile each load")
    ap.add_argument("--cold", action="store_true", help="the first load of a process (buffers untouched)")
    ap.add_argument("--auth", action="store_true", help="seal chunks with a keyed MAC (chunk_auth_key_file)")
    ap.add_argument("--auth-file", help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=("writer", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--tier", help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    ap.add_argument("--store-dir", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="lmcache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.role = args.child
        child(args)
        return 0

    from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store

    work = Path(tempfile.mkdtemp(prefix="lmcm-tier-load-"))
    disk, store_dir = str(work / "disk"), str(work / "store")
    if args.auth:
        args.auth_file = str(work / "chunk-secret")
        Path(args.auth_file).write_text("benchmark-secret-" * 4)
    nbytes = 2 * L * args.tokens * H * D * 4
    base = memcpy_s(nbytes)
    tiers = [t for t in args.tiers.split(",") if t]
    rows = []
    start_store(StoreSpec(state_dir=store_dir, memory_bytes=max(4 * nbytes, 1 << 30)))
    try:
        # The writers: CPU + disk tiers, then the store.
        writers = [("writer", "cpu", "lmcache")] + (
            [("writer", "store-shm", "lmcache")] if any(t.startswith("store") for t in tiers) else [])
        saved, *store_save = run_children(writers, args, disk, store_dir)
        store_save = store_save[0] if store_save else None
        rows.append({"tier": "cpu", "path": "same", "load_s": saved["load_s"], "lookup_s": saved["lookup_s"],
                     "save_s": saved["store_s"], "durable_s": saved["durable_s"]})
        paths = [p for p in args.paths.split(",") if p]
        samples: dict[tuple[str, str], list[dict]] = {}
        # Fresh-process loads vary by tens of percent on this machine: each (tier, path) is
        # loaded --repeat times, in rounds that alternate the paths, and the median is shown.
        jobs = [("reader", tier, path) for _ in range(args.repeat) for tier in tiers if tier != "cpu"
                for path in paths]
        for (_, tier, path), r in zip(jobs, run_children(jobs, args, disk, store_dir), strict=True):
            samples.setdefault((tier, path), []).append(r)
        for (tier, path), rs in samples.items():
            r = sorted(rs, key=lambda x: x["load_s"])[len(rs) // 2]
            row = {"tier": tier, "path": path, "load_s": r["load_s"], "lookup_s": r["lookup_s"],
                   "runs": r.get("runs"), "load_samples_s": [x["load_s"] for x in rs]}
            if tier.startswith("disk"):
                row.update(save_s=saved["store_s"], durable_s=saved["durable_s"])
            elif tier.startswith("store"):
                row.update(save_s=store_save["store_s"], durable_s=store_save["durable_s"])
            rows.append(row)
    finally:
        stop_store(store_dir)
    mib = nbytes / 2**20
    seal = "keyed BLAKE3 MAC" if args.auth else "XXH3-128 checksum"
    print(f"\n{args.tokens} tokens, {mib:.0f} MiB of KV (Qwen2-0.5B geometry, float32, chunks sealed with {seal}); "
          "plain memory copy "
          f"{base * 1e3:.1f} ms ({nbytes / base / 1e9:.2f} GB/s)")
    print(f"{'tier':14s} {'path':8s} {'load ms':>9s} {'(lookup)':>9s} {'load/memcpy':>12s} {'save ms':>9s} "
          f"{'durable ms':>11s} {'save/memcpy':>12s}  {'load ms, each process':22s} runs")
    for r in rows:
        save = r.get("save_s")
        print(f"{r['tier']:14s} {r.get('path', 'same'):8s} {r['load_s'] * 1e3:9.1f} {r['lookup_s'] * 1e3:9.1f} "
              f"{base / r['load_s']:12.2f} "
              + (f"{save * 1e3:9.1f} {r['durable_s'] * 1e3:11.1f} {base / save:12.2f}" if save else " " * 35)
              + f"  {' '.join(f'{x * 1e3:.0f}' for x in r.get('load_samples_s', [])):22s}"
              + (f" {' '.join(r['runs'])}" if r.get("runs") else ""))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"tokens": args.tokens, "bytes": nbytes, "memcpy_s": base, "rows": rows,
                                     "cold": args.cold, "auth": args.auth}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
