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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmcache_mooncake.platform import detect_platform, engine_kwargs, instance_env
from lmcache_mooncake.runtime import procs
from lmcache_mooncake.runtime.malloc_env import malloc_env


@dataclass
class PromptResult:
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    ttft_s: float
    #: What the connector returned for this request (a producer's promise).
    kv_transfer_params: dict[str, Any] | None = None


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
    #: Run vLLM's engine and worker inside this one process
    #: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) instead of three processes; None:
    #: as ``LMCACHE_MOONCAKE_VLLM_IN_PROCESS=1`` says (the tests set it: each
    #: process start imports vLLM again, about 14 s on two cores). The
    #: connector's code is the same; its scheduler and worker sides then share
    #: a process, so a run measuring speed keeps the default layout. Nothing
    #: steps vLLM between batches in one process: a producer's held requests
    #: are then seen durable only when a later batch steps vLLM (never, after
    #: the last one), so a test that counts them keeps the default layout.
    in_process: bool | None = None
    #: Send each batch to vLLM as one ``generate`` call (vLLM schedules its
    #: requests together) instead of one request at a time. Each result's
    #: ``ttft_s`` is then the batch's wall time divided among its requests.
    #: Not with ``measure_ttft``.
    batched: bool = False


def vllm_env(work_dir: Path, extra: dict[str, str] | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for a vLLM child: offline, quiet, per-run caches (no collisions), what its
    platform needs (:func:`lmcache_mooncake.platform.instance_env`: on CPU the KV cache size and
    no reserved core) and on CPU glibc malloc kept from re-faulting activations every step
    (:mod:`lmcache_mooncake.runtime.malloc_env`)."""
    plat = detect_platform()
    env = dict(os.environ)
    for d in ("cache", "inductor", "tmp"):
        (work_dir / d).mkdir(parents=True, exist_ok=True)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **instance_env(plat, env, kv_cache_gib),
            "VLLM_CACHE_ROOT": str(work_dir / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(work_dir / "inductor"),
            "TMPDIR": str(work_dir / "tmp"),
        }
    )
    env.update(extra or {})
    if not plat.is_cuda:
        env.update(malloc_env(env))
    return env


class Instance:
    """A vLLM process that runs batches of prompts on request, until stopped or killed.

    The child reads batch *i* from ``batch-<i>.json`` in ``work_dir`` and writes
    ``result-<i>.json``; a ``stop`` file ends it. It runs in its own session, so
    :meth:`kill` (SIGKILL to the whole process group) takes vLLM's EngineCore
    and worker processes with it, as a crash would.
    """

    def __init__(self, spec: RunSpec, work_dir: Path | None = None):
        self.spec = spec
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="lmcm-run-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.work_dir.glob("batch-*.json"), *self.work_dir.glob("result-*.json")]:
            old.unlink()
        (self.work_dir / "stop").unlink(missing_ok=True)
        (self.work_dir / "spec.json").write_text(json.dumps(asdict(spec)))
        self.log_path = self.work_dir / "vllm.log"
        env = vllm_env(self.work_dir, spec.env, spec.kv_cache_gib)
        in_process = spec.in_process
        if in_process is None:
            in_process = os.environ.get("LMCACHE_MOONCAKE_VLLM_IN_PROCESS") == "1"
        if in_process:
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # The engine's start would cut torch to one thread for the whole process, the
            # forward included; vLLM's own worker process computes with one per core.
            env.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
        self.proc = procs.spawn(
            [sys.executable, "-m", "lmcache_mooncake.testing.offline", str(self.work_dir)],
            self.log_path,
            env=env,
        )
        self._batches = 0

    def run(self, prompts: list[list[int]], cache_salts: list[str | None] | None = None,
            timeout_s: float | None = None,
            kv_transfer_params: list[dict[str, Any] | None] | None = None) -> list[PromptResult]:
        """Run one batch (each prompt alone, in order) and return its results.

        ``kv_transfer_params``: per prompt, passed to vLLM as the request's
        kv_transfer_params (what a proxy copies from a producer's response).
        """
        i = self._batches
        self._batches += 1
        batch = {"prompts": prompts, "cache_salts": cache_salts or [None] * len(prompts),
                 "kv_transfer_params": kv_transfer_params or [None] * len(prompts)}
        tmp = self.work_dir / f".batch-{i}.json"
        tmp.write_text(json.dumps(batch))
        tmp.rename(self.work_dir / f"batch-{i}.json")
        out = self.work_dir / f"result-{i}.json"
        deadline = time.monotonic() + (timeout_s or self.spec.timeout_s)
        while not out.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM process exited ({self.proc.returncode}); {self._tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"vLLM batch {i} timed out; {self._tail()}")
            time.sleep(0.05)
        return [PromptResult(**r) for r in json.loads(out.read_text())]

    def stop(self, timeout_s: float = 120.0) -> None:
        """Ask the child to shut vLLM down cleanly (the connector drains its writes)."""
        (self.work_dir / "stop").touch()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        # vLLM's own children are in the same session; make sure none outlives us.
        procs.stop_group(self.proc)
        if self.proc.returncode != 0:
            raise RuntimeError(f"vLLM process exited with {self.proc.returncode}; {self._tail()}")

    def kill(self) -> None:
        """SIGKILL the child and every process it started."""
        procs.stop_group(self.proc)

    def _tail(self) -> str:
        return f"log {self.log_path}:\n" + procs.tail_log(self.log_path, 40)

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()


def run_instance(spec: RunSpec, work_dir: Path | None = None) -> list[PromptResult]:
    """Start a vLLM process for ``spec``, run ``spec.prompts``, stop it, return the results.

    Raises RuntimeError with the child's last output lines if it fails.
    """
    with Instance(spec, work_dir) as inst:
        results = inst.run(spec.prompts, spec.cache_salts)
        inst.stop()
    return results


def _let_vllm_scan_llvmlite() -> None:
    """Work around vLLM 0.32 and llvmlite in one process (in-process runs only).

    At worker start vLLM's CPU platform rebinds its Triton kernels to C++ ones
    (``vllm.triton_utils.dispatcher``): it walks every loaded module and asks
    each object for ``__dict__``. llvmlite's library wrapper (imported through
    LMCache and numba when vLLM loads our connector class) answers any
    attribute with a function wrapper, and the walk fails with "'_lib_fn_wrapper'
    object has no attribute 'get'". In vLLM's default layout the worker is a
    fresh process that has not imported LMCache yet, so only in-process runs
    meet it. Here the wrapper says it has no dunder attributes.
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    cls = ffi._lib_wrapper
    if getattr(cls, "_lmcm_patched", False):
        return
    answer = cls.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return answer(self, name)

    cls.__getattr__ = __getattr__
    cls._lmcm_patched = True


def _child(work_dir: str) -> None:
    from vllm import LLM, SamplingParams

    from lmcache_mooncake.commands.serve import connector_config

    work = Path(work_dir)
    spec = RunSpec(**json.loads((work / "spec.json").read_text()))
    kwargs: dict[str, Any] = dict(
        model=spec.model,
        # CPU: eager (faster start; its KV cache size is in vllm_env); CUDA: CUDA graphs, kv_cache_memory_bytes.
        **engine_kwargs(detect_platform(), spec.kv_cache_gib),
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        seed=0,
        enable_prefix_caching=spec.prefix_caching,
    )
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        _let_vllm_scan_llvmlite()
    if spec.kv_role is not None:
        kwargs["kv_transfer_config"] = connector_config(spec.kv_role, spec.extra_config)
    llm = LLM(**kwargs)

    def request(tokens: list[int], salt: str | None) -> dict[str, Any]:
        req: dict[str, Any] = {"prompt_token_ids": tokens}
        if salt is not None:
            req["cache_salt"] = salt
        return req

    def params(max_tokens: int, ktp: dict[str, Any] | None) -> SamplingParams:
        extra = {"kv_transfer_params": ktp} if ktp else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
    i = 0
    while True:
        batch_path = work / f"batch-{i}.json"
        while not batch_path.exists():
            if (work / "stop").exists():
                # Shut down through vLLM so the connector drains its writes.
                llm.llm_engine.engine_core.shutdown()
                return
            time.sleep(0.05)
        batch = json.loads(batch_path.read_text())
        rows = list(zip(batch["prompts"], batch["cache_salts"], batch["kv_transfer_params"], strict=True))
        timed: list[tuple[Any, int, float]] = []  # (vLLM's output, cached tokens, seconds) per prompt
        if spec.batched and not spec.measure_ttft and rows:
            t0 = time.perf_counter()
            outs = llm.generate([request(t, s) for t, s, _ in rows], [params(spec.max_tokens, k) for *_, k in rows],
                                use_tqdm=False)
            share = (time.perf_counter() - t0) / len(rows)
            timed = [(o, o.num_cached_tokens or 0, share) for o in outs]
        else:
            for tokens, salt, ktp in rows:
                if spec.measure_ttft:
                    # Measured first, on the cold path: this is the request that may load.
                    t0 = time.perf_counter()
                    first = llm.generate([request(tokens, salt)], params(1, ktp), use_tqdm=False)[0]
                    ttft = time.perf_counter() - t0
                    out = llm.generate([request(tokens, salt)], params(spec.max_tokens, ktp), use_tqdm=False)[0]
                    timed.append((out, first.num_cached_tokens or 0, ttft))
                else:
                    t0 = time.perf_counter()
                    out = llm.generate([request(tokens, salt)], params(spec.max_tokens, ktp), use_tqdm=False)[0]
                    # whole request; a bound on TTFT
                    timed.append((out, out.num_cached_tokens or 0, time.perf_counter() - t0))
        results = [asdict(PromptResult(len(tokens), int(cached), list(out.outputs[0].token_ids), ttft,
                                       out.kv_transfer_params))
                   for (tokens, _, _), (out, cached, ttft) in zip(rows, timed, strict=True)]
        tmp = work / f".result-{i}.json"
        tmp.write_text(json.dumps(results))
        tmp.rename(work / f"result-{i}.json")
        i += 1


if __name__ == "__main__":
    _child(sys.argv[1])
