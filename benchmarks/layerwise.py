"""Layer-wise against whole-step saves and loads (config ``layerwise``) on this platform, in one run.

What decides ``layerwise``'s default: the cached time to first token of a prompt one past
a block (8,193 tokens; 2,049 as a second length) and the cost of saving, with the same
model, tiers and servers as ``benchmarks/ttft.py`` (real vLLM OpenAI servers of the CPU
build, ``--dtype float32``, both cores each, ``/v1/completions`` with ``max_tokens=1``).

- writers (prefix caching off), one per mode, each its own disk folder: the first request
  per prompt computes and saves it (``compute + save``); then the prompt three times more,
  served by the writer's CPU tier (``CPU tier, same process``);
- fresh readers (prefix caching off) on the writers' disk folders: the first request per
  prompt loads it from the disk tier (``disk tier, fresh process``). Whole-step mode is
  read twice, with asynchronous loads (the default) and with synchronous ones
  (``async_loading: false``), since layer-wise loads are synchronous: the difference
  between those two is the cost of loading in the step, the rest is layer-wise's own.

The baseline is whole-step mode of the same run; ratios are layer-wise over whole-step.

    .venv/bin/python benchmarks/layerwise.py [--bases 2048,8192] [--repeats 3] [--json PATH]

Not in ``make bench`` (it decides a default once per platform; about 6 minutes here).
Writes ``benchmarks/results/layerwise.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ttft import RESULTS, Server, ours, ready_in_groups, write_config  # noqa: E402

MODES = {
    # label: (writer overrides, reader overrides)
    "whole-step": ({}, {}),
    "whole-step, synchronous loads": (None, {"async_loading": False}),
    "layer-wise": ({"layerwise": True}, {"layerwise": True}),
}
#: Short server names (a Unix socket path under each server's folder has at most 107 bytes).
SHORT = {"whole-step": "whole", "whole-step, synchronous loads": "sync", "layer-wise": "lw"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bases", default="2048,8192", help="block-aligned lengths; one token past each is measured")
    ap.add_argument("--repeats", type=int, default=3, help="CPU-tier repeats per prompt in each writer")
    ap.add_argument("--quick", action="store_true", help="small model, 512-token prompts: a smoke run")
    ap.add_argument("--json", type=Path, default=RESULTS / "layerwise.json")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--readers-only", action="store_true",
                    help="skip the writers: the readers read the disk folders an earlier run left in --work")
    args = ap.parse_args(argv)

    from lmcache_mooncake.testing.models import ModelSpec, build_model

    if args.quick:
        model = str(build_model(ModelSpec(arch="qwen2", size="small", seed=0)))
        bases = [512]
    else:
        model = str(build_model(ModelSpec(arch="qwen2", size="0.5b", seed=0, max_position_embeddings=16384)))
        bases = [int(b) for b in args.bases.split(",") if b]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = {b + 1: [rng.randrange(10, vocab - 10) for _ in range(b + 1)] for b in bases}
    work = args.work or Path(tempfile.mkdtemp(prefix="lmcm-bench-layerwise-"))
    max_len = max(bases) + 64
    rows: list[dict] = []
    print(f"model {model}\nwork folder {work}", flush=True)

    def measure(server: Server, label: str, what: str, tokens: list[int]) -> None:
        t, cached = server.ttft(tokens)
        rows.append({"mode": label, "what": what, "tokens": len(tokens), "ttft_ms": t * 1000, "cached": cached})
        print(f"  {label:32s} {what:28s} {len(tokens):6d} tokens  TTFT {t * 1000:9.1f} ms  cached {cached}",
              flush=True)

    disks = {"whole-step": work / "disk-whole", "layer-wise": work / "disk-layerwise"}
    writer_of = {"whole-step": "whole-step", "whole-step, synchronous loads": "whole-step", "layer-wise": "layer-wise"}

    def server(name: str, label: str, overrides: dict, disk: Path, writer: bool) -> Server:
        cfg = write_config(work / f"{name}.yaml", disk=disk, store=None)
        return Server(name, model, work, ours(cfg, **overrides), prefix_caching=False, max_len=max_len,
                      wait=False, drains=writer)

    servers: list[Server] = []
    try:
        writers = [(label, w) for label, (w, _) in MODES.items() if w is not None and not args.readers_only]
        launch = [lambda label=label, w=w: server(f"w-{SHORT[label]}", label, w, disks[label], True)
                  for label, w in writers] if not args.readers_only else []
        for (label, _), s in zip(writers, ready_in_groups(launch, servers), strict=True):
            for tokens in prompts.values():
                measure(s, label, "compute + save", tokens)
            for tokens in prompts.values():
                for _ in range(args.repeats):
                    measure(s, label, "CPU tier, same process", tokens)
            s.stop()
        readers = list(MODES.items())
        launch = [lambda label=label, r=r: server(f"r-{SHORT[label]}", label, r, disks[writer_of[label]], False)
                  for label, (_, r) in readers]
        for (label, _), s in zip(readers, ready_in_groups(launch, servers, size=3), strict=True):
            for tokens in prompts.values():
                measure(s, label, "disk tier, fresh process", tokens)
            s.stop()
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop(grace_s=10)

    table = summarize(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": model, "rows": rows, "summary": table}, indent=2))
    print_table(table)
    print(f"\nwrote {args.json}")
    return 0


def summarize(rows: list[dict]) -> list[dict]:
    """Median TTFT per (what, tokens, mode), and layer-wise over whole-step."""
    out = []
    keys = sorted({(r["what"], r["tokens"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for what, n in keys:
        med = {r["mode"]: statistics.median(x["ttft_ms"] for x in rows
                                           if x["what"] == what and x["tokens"] == n and x["mode"] == r["mode"])
               for r in rows if r["what"] == what and r["tokens"] == n}
        base = med.get("whole-step")
        out.append({"what": what, "tokens": n, "median_ms": med,
                    "layerwise_over_whole": (med["layer-wise"] / base) if base and "layer-wise" in med else None})
    return out


def print_table(table: list[dict]) -> None:
    print(f"\n{'median TTFT, ms':36s} {'tokens':>6s}  " + "  ".join(f"{m:>30s}" for m in MODES) + "  layer-wise / whole")
    for row in table:
        cells = "  ".join(f"{row['median_ms'].get(m, float('nan')):30.1f}" for m in MODES)
        ratio = row["layerwise_over_whole"]
        print(f"{row['what']:36s} {row['tokens']:6d}  {cells}  {ratio:.2f}x" if ratio else f"{row['what']:36s}")


if __name__ == "__main__":
    sys.exit(main())
