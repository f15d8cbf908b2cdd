"""Warm-up throughput (prompt tokens/s) against plain vLLM prefill of the same inputs, in one run.

    .venv/bin/python benchmarks/warmup_throughput.py [--model DIR | --size small] [--inputs 64]
        [--tokens 1024] [--batch-size 16] [--dtype float32] [--json PATH]

Starts its own embedded Mooncake Store (``--store-gib``, in a temporary state
folder; stopped at exit, also on an error, Ctrl-C or SIGTERM), writes
``--inputs`` random token-id prompts of ``--tokens`` tokens each to a JSONL
file, and times two fresh vLLM processes on them, one after the other:

- ``plain prefill``: vLLM without a connector (``offline.Instance``,
  ``kv_role=None``), the same batches, ``max_tokens=1``.
- ``warm-up``: :func:`lmcache_mooncake.warmup.warmup` with
  ``configs/prefill.yaml``: reading and tokenizing the file, the store
  existence check, the vLLM producer (``kv_producer``, each request held until
  its chunks are in the store) and the final durability check.

Both are timed the same way: from sending the first batch to the last result
(the warm-up: to every chunk verified in the store), less the vLLM start-up,
which is estimated from the first batch (its wall time minus its requests'
own time). Both hand vLLM each batch as one ``generate`` call, which vLLM
schedules together (``RunSpec.batched``), as warm-up does.
The prompts share no prefix, so every token is computed in both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
from lmcache_mooncake.testing.models import ModelSpec, build_model
from lmcache_mooncake.testing.offline import Instance, RunSpec
from lmcache_mooncake.warmup import get_renderer, warmup

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "benchmarks" / "results" / "warmup_throughput.json"


def _on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def plain_prefill(model: str, prompts: list[list[int]], batch_size: int, dtype: str, max_model_len: int,
                  work: Path) -> dict[str, float]:
    spec = RunSpec(model=model, prompts=[], kv_role=None, max_tokens=1, dtype=dtype, max_model_len=max_model_len,
                   kv_cache_gib=2, prefix_caching=True, batched=True)
    t_all = time.monotonic()
    startup = busy = 0.0
    t_first = None
    with Instance(spec, work) as inst:
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            t0 = time.monotonic()
            res = inst.run(batch)
            t1 = time.monotonic()
            if t_first is None:
                t_first = t0
                startup = max((t1 - t0) - sum(r.ttft_s for r in res), 0.0)
            busy += sum(r.ttft_s for r in res)
        t_end = time.monotonic()
        inst.stop()
    assert t_first is not None
    warm = max(t_end - t_first - startup, busy)
    tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": tokens, "time_s": warm, "tokens_per_s": tokens / warm, "startup_s": startup,
            "elapsed_s": time.monotonic() - t_all}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the generated Llama of --size)")
    p.add_argument("--size", default="small", choices=["tiny", "small", "0.5b"])
    p.add_argument("--inputs", type=int, default=64,
                   help="number of prompts (default 64: four batches of 16, so the first batch after "
                   "vLLM's start-up, slower in both runs, is a quarter of the time, as in a real warm-up job)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per prompt (default 1024)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--store-gib", type=float, default=1.0, help="store memory in GiB (default 1)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _on_signal)

    model = args.model or str(build_model(ModelSpec(arch="llama", size=args.size)))
    info = get_renderer(model, args.dtype).info
    rng = random.Random(0)
    prompts = [[rng.randrange(16, min(info.vocab_size, 30000)) for _ in range(args.tokens)]
               for _ in range(args.inputs)]
    work = Path(tempfile.mkdtemp(prefix="lmcm-bench-warmup-"))
    inputs = work / "inputs.jsonl"
    inputs.write_text("".join(json.dumps({"prompt_token_ids": x}) + "\n" for x in prompts))
    store_dir = work / "store"
    print(f"# store: {store_dir} (if this script is SIGKILLed: lmcache-mooncake store down --state-dir {store_dir})",
          file=sys.stderr)
    start_store(StoreSpec(memory_bytes=int(args.store_gib * 2**30), state_dir=store_dir))
    try:
        print("plain vLLM prefill ...", file=sys.stderr)
        plain = plain_prefill(model, prompts, args.batch_size, info.dtype, info.max_model_len, work / "plain")
        print("warm-up ...", file=sys.stderr)
        s = warmup(model, REPO / "configs" / "prefill.yaml", [inputs], dtype=args.dtype,
                   overrides={"mooncake": {"store_dir": str(store_dir)}}, batch_size=args.batch_size,
                   work_dir=work / "warmup", progress=False)
        if not s.ok or s.inputs_done != args.inputs:
            print(s.format(), file=sys.stderr)
            print(f"logs kept in {work}", file=sys.stderr)
            return 1
    finally:
        stop_store(store_dir)
    shutil.rmtree(work, ignore_errors=True)
    warm = {"prompt_tokens": s.prompt_tokens, "time_s": s.warm_s, "tokens_per_s": s.prompt_tokens_per_s,
            "startup_s": s.startup_s, "durable_s": s.durable_s, "elapsed_s": s.elapsed_s,
            "chunks_written": s.chunks_written, "bytes_written": s.bytes_written}
    ratio = warm["tokens_per_s"] / plain["tokens_per_s"]

    print(f"model {model} ({info.num_layers} layers, {info.num_kv_heads} KV heads of {info.head_size}, "
          f"{info.dtype}); {args.inputs} prompts x {args.tokens} tokens, batches of {args.batch_size}")
    print(f"{'run':<16} {'prompt tokens':>13} {'time s':>8} {'tokens/s':>9} {'start-up s':>11}")
    for name, r in (("plain prefill", plain), ("warm-up", warm)):
        print(f"{name:<16} {r['prompt_tokens']:>13} {r['time_s']:>8.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['startup_s']:>11.1f}")
    print(f"warm-up wrote {s.chunks_written} chunks ({s.bytes_written / 2**20:.1f} MiB) to the store "
          f"(its time includes {s.durable_s:.2f} s from the last result to every chunk seen there); "
          f"warm-up / plain prefill throughput: {ratio:.2f}x")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {"model": model},
        "model": dataclass_dict(info),
        "plain_prefill": plain,
        "warmup": warm,
        "warmup_over_plain": ratio,
        "env": {"machine": platform.machine(), "processor": platform.processor(),
                "python": platform.python_version(), "cpus": os.cpu_count(),
                "loadavg_1m_at_end": os.getloadavg()[0]},
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


def dataclass_dict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


if __name__ == "__main__":  # vLLM and LMCache start worker processes with "spawn"
    sys.exit(main())
