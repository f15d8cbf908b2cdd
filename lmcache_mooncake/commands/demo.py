"""``lmcache-mooncake demo``: one vLLM instance, run twice, second run served from cache.

Run 1 starts with empty tiers, computes each prompt and saves its chunks to
the CPU tier and the disk tier. Run 2 is a new process (empty CPU tier): it
finds the chunks on disk, loads them, and computes only the rest. The table
shows, per prompt and run, the prompt tokens, the cached tokens vLLM reports,
the time to first token, and whether the greedy output matched run 1.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmcache_mooncake.testing.models import ModelSpec, build_model
from lmcache_mooncake.testing.offline import RunSpec, run_instance
from lmcache_mooncake.testing.prompts import demo_prompts


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``demo`` to the command line's subparsers."""
    p = subparsers.add_parser(
        "demo",
        help=help,
        description="Run one vLLM instance (kv_both, configs/both.yaml keys) twice on the same prompts "
        "and print prompt tokens, cached tokens and time to first token for each run.",
    )
    p.add_argument("--model", help="model folder; default: a generated Llama model (make-model)")
    p.add_argument("--size", default="small", choices=["tiny", "small", "0.5b"],
                   help="size of the generated model when --model is not given (default: small)")
    p.add_argument("--config", default=None, help="cache configuration YAML (default: embedded defaults)")
    p.add_argument("--lengths", default="600,1500,2600", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--work-dir", default=None, help="folder for the disk tier and logs (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (disk tier, vLLM logs)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Two runs of one vLLM instance, then the table."""

    model = args.model
    if model is None:
        print(f"demo: building (or reusing) the generated '{args.size}' Llama model ...", file=sys.stderr)
        model = str(build_model(ModelSpec(arch="llama", size=args.size)))
    vocab = _vocab_size(Path(model))
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = demo_prompts(vocab, lengths)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lmcm-demo-"))
    extra = {"local_disk": str(work / "disk"), "run_dir": str(work / "run")}
    if args.config:
        extra["config_file"] = args.config

    rows = []
    baseline = None
    try:
        for run in (1, 2):
            print(f"demo: run {run} of 2 (a fresh vLLM process) ...", file=sys.stderr)
            t0 = time.perf_counter()
            res = run_instance(
                RunSpec(model=model, prompts=prompts, extra_config=extra, measure_ttft=True,
                        max_model_len=max(4096, max(len(x) for x in prompts) + 64)),
                work / f"run{run}",
            )
            print(f"demo: run {run} took {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            if baseline is None:
                baseline = res
            for i, r in enumerate(res):
                rows.append((run, i, r.prompt_tokens, r.cached_tokens, r.ttft_s * 1000,
                             "yes" if r.output_ids == baseline[i].output_ids else "NO"))
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"model: {model}")
    print(f"{'run':>3} {'prompt':>6} {'prompt tokens':>13} {'cached tokens':>13} {'TTFT ms':>9} {'same output':>11}")
    for run, i, n, c, ttft, same in rows:
        print(f"{run:>3} {i:>6} {n:>13} {c:>13} {ttft:>9.1f} {same:>11}")
    first = [r for r in rows if r[0] == 1]
    second = [r for r in rows if r[0] == 2]
    speedup = sum(r[4] for r in first) / max(sum(r[4] for r in second), 1e-9)
    print(f"\nrun 2 served {sum(r[3] for r in second)} of {sum(r[2] for r in second)} prompt tokens from cache; "
          f"total TTFT {speedup:.2f}x faster than run 1")
    if any(r[5] != "yes" for r in rows):
        print("error: outputs differ between runs", file=sys.stderr)
        return 1
    return 0


def _vocab_size(model: Path) -> int:
    import json

    return int(json.loads((model / "config.json").read_text())["vocab_size"])
