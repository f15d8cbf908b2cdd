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
  requests; ``--cold`` measures the first load of a process instead).

Load time is the lookup plus the retrieve (what a cached request waits for);
save time is ``store()`` plus waiting until every tier has written. The
baseline is ``torch`` copying the same number of bytes in the same run.
``--profile`` prints cProfile's top functions for each load. ``--auth`` seals
every chunk with a keyed MAC (``chunk_auth_key_file``, keyed BLAKE3) instead of
the XXH3-128 checksum, to measure what authenticated chunks cost.
Each engine runs in its own process (LMCache's engine keeps process-wide
state), so the figures come from fresh processes.

    .venv/bin/python benchmarks/tier_load.py [--tokens 8192] [--json PATH] [--profile]
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

    from lmcache_mooncake import engine, layouts
    from lmcache_mooncake.config import CacheConfig, MooncakeConfig
    from lmcache_mooncake.keys import KeyNamespace

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
    disk = args.disk if args.tier in ("disk", "cpu") else None
    cfg = CacheConfig(max_local_cpu_size=1.0, local_disk=disk, mooncake=mc)
    cfg = dataclasses.replace(cfg, chunk_auth_key_file=args.auth_file)
    layout = layouts.layout_for_backend("CPU_ATTN")
    # The chunk layout a served worker picks for these tensors ("blocks" for float32 here).
    ns = KeyNamespace("bench", "float32", L, H, D, 256, chunk_layout=layout.chunk_layout(kv[0], 256))
    name = f"bench-{args.role}-{args.tier}"
    eng = engine.build_engine(cfg, ns, layout, torch.float32, name)
    rc = engine.request_configs(None, None)
    out: dict[str, float] = {}
    try:
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
            if not args.cold:
                # Touch the buffers once, as a serving process's first requests do.
                other = torch.arange(args.tokens) % 1999 + 3
                eng.lookup(tokens=other, request_configs=rc)
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
    hit = eng.lookup(tokens=tokens, request_configs=rc)
    t1 = time.perf_counter()
    ret = eng.retrieve(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
    t2 = time.perf_counter()
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18)
        print(s.getvalue(), file=sys.stderr)
    if hit != args.tokens or not bool(ret.all()):
        raise SystemExit(f"{args.tier}: lookup hit {hit}, retrieved {int(ret.sum())} of {args.tokens}")
    out.update(lookup_s=t1 - t0, retrieve_s=t2 - t1, load_s=t2 - t0)


def run_child(role: str, tier: str, args: argparse.Namespace, disk: str, store_dir: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", role, "--tier", tier, "--tokens", str(args.tokens),
           "--disk", disk, "--store-dir", store_dir] + (["--profile"] if args.profile else []) \
        + (["--cold"] if args.cold else []) + (["--auth-file", args.auth_file] if args.auth_file else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("@@")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{role} {tier} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    if args.profile:
        prof = [x for x in p.stderr.splitlines() if "function calls" in x or x.strip()[:1].isdigit()]
        print(f"--- profile, {role} {tier}\n" + "\n".join(prof[:22]))
    return json.loads(lines[-1][2:])


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
    ap.add_argument("--tiers", default="cpu,disk,store-shm,store-tcp")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "tier_load.json")
    ap.add_argument("--profile", action="store_true", help="cProfile each load")
    ap.add_argument("--cold", action="store_true", help="the first load of a process (buffers untouched)")
    ap.add_argument("--auth", action="store_true", help="seal chunks with a keyed MAC (chunk_auth_key_file)")
    ap.add_argument("--auth-file", help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=("writer", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--tier", help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    ap.add_argument("--store-dir", help=argparse.SUPPRESS)
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
        saved = run_child("writer", "cpu", args, disk, store_dir)  # CPU + disk tiers
        rows.append({"tier": "cpu", "load_s": saved["load_s"], "lookup_s": saved["lookup_s"],
                     "save_s": saved["store_s"], "durable_s": saved["durable_s"]})
        if any(t.startswith("store") for t in tiers):
            w = run_child("writer", "store-shm", args, disk, store_dir)
            store_save = w
        for tier in tiers:
            if tier == "cpu":
                continue
            r = run_child("reader", tier, args, disk, store_dir)
            row = {"tier": tier, "load_s": r["load_s"], "lookup_s": r["lookup_s"]}
            if tier == "disk":
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
    print(f"{'tier':10s} {'load ms':>9s} {'(lookup)':>9s} {'load/memcpy':>12s} {'save ms':>9s} {'durable ms':>11s} "
          f"{'save/memcpy':>12s}")
    for r in rows:
        save = r.get("save_s")
        print(f"{r['tier']:10s} {r['load_s'] * 1e3:9.1f} {r['lookup_s'] * 1e3:9.1f} {base / r['load_s']:12.2f} "
              + (f"{save * 1e3:9.1f} {r['durable_s'] * 1e3:11.1f} {base / save:12.2f}" if save else ""))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"tokens": args.tokens, "bytes": nbytes, "memcpy_s": base, "rows": rows,
                                     "cold": args.cold, "auth": args.auth}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
