"""Run prompts through vLLM offline in a fresh child process, with or without our connector.

Tests, the demo and the benchmarks all need "a vLLM instance that runs these
prompts and exits"; each run is a new process, so nothing in memory survives
between runs, as between two real instances.

``run_instance(RunSpec(...))`` returns, per prompt: the number of prompt tokens,
``num_cached_tokens`` as vLLM reports it, the greedy output tokens, and the
time to first token (measured as the wall time of a ``max_tokens=1`` request
sent alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PromptResult:
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    ttft_s: float


@dataclass
class RunSpec:
    model: str
    prompts: list[list[int]]
    #: None: plain vLLM, no connector.
    kv_role: str | None = "kv_both"
    #: kv_connector_extra_config: {"config_file": ..., key: override, ...}
    extra_config: dict[str, Any] = field(default_factory=dict)
    cache_salts: list[str | None] | None = None
    max_tokens: int = 8
    dtype: str = "float32"
    max_model_len: int = 4096
    measure_ttft: bool = False
    kv_cache_gib: int = 1
    #: vLLM's own in-memory prefix cache; off isolates hits to our tiers.
    prefix_caching: bool = True
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0


def vllm_env(work_dir: Path, extra: dict[str, str] | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for a vLLM child: offline, quiet, per-run caches (no collisions)."""
    env = dict(os.environ)
    for d in ("cache", "inductor", "tmp"):
        (work_dir / d).mkdir(parents=True, exist_ok=True)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            # A connector makes vLLM's CPU build reserve a core; on small
            # machines that skews comparisons, so reserve none in every run.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
            "VLLM_CACHE_ROOT": str(work_dir / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(work_dir / "inductor"),
            "TMPDIR": str(work_dir / "tmp"),
        }
    )
    env.update(extra or {})
    return env


def run_instance(spec: RunSpec, work_dir: Path | None = None) -> list[PromptResult]:
    """Start a vLLM process for ``spec``, wait for it, return its results.

    Raises RuntimeError with the child's last output lines if it fails.
    """
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="lmcm-run-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work_dir / "spec.json", work_dir / "result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    out_path.unlink(missing_ok=True)
    log_path = work_dir / "vllm.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "lmcache_mooncake.offline", str(spec_path), str(out_path)],
            env=vllm_env(work_dir, spec.env, spec.kv_cache_gib),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=spec.timeout_s,
        )
    if proc.returncode != 0 or not out_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    return [PromptResult(**r) for r in json.loads(out_path.read_text())]


def _child(spec_path: str, out_path: str) -> None:
    import time

    from vllm import LLM, SamplingParams

    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    kwargs: dict[str, Any] = dict(
        model=spec.model,
        enforce_eager=True,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        seed=0,
        enable_prefix_caching=spec.prefix_caching,
    )
    if spec.kv_role is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMCacheMooncakeConnector",
            "kv_connector_module_path": "lmcache_mooncake.connector",
            "kv_role": spec.kv_role,
            "kv_connector_extra_config": spec.extra_config,
        }
    llm = LLM(**kwargs)
    salts = spec.cache_salts or [None] * len(spec.prompts)

    def request(tokens: list[int], salt: str | None) -> dict[str, Any]:
        req: dict[str, Any] = {"prompt_token_ids": tokens}
        if salt is not None:
            req["cache_salt"] = salt
        return req

    results = []
    greedy = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens)
    for tokens, salt in zip(spec.prompts, salts, strict=True):
        ttft = 0.0
        if spec.measure_ttft:
            # Measured first, on the cold path: this is the request that may load.
            t0 = time.perf_counter()
            first = llm.generate([request(tokens, salt)], SamplingParams(temperature=0.0, max_tokens=1),
                                 use_tqdm=False)[0]
            ttft = time.perf_counter() - t0
            cached = first.num_cached_tokens or 0
            out = llm.generate([request(tokens, salt)], greedy, use_tqdm=False)[0]
        else:
            out = llm.generate([request(tokens, salt)], greedy, use_tqdm=False)[0]
            cached = out.num_cached_tokens or 0
        results.append(asdict(PromptResult(len(tokens), int(cached), list(out.outputs[0].token_ids), ttft)))
    Path(out_path).write_text(json.dumps(results))
    # Let the connector drain its writes before the process ends.
    del llm


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
