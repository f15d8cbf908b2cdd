"""Tracing for ``benchmarks/step_timeline.py``: loaded by every Python process that has this
folder on ``PYTHONPATH`` (the vLLM server, its engine core and its worker).

When a traced module is imported, the listed methods of its class are wrapped to append
``<CLOCK_MONOTONIC seconds> <pid> <Class.method> B|E [result]`` lines to
``$STEP_TRACE_DIR/<pid>`` (one file per process, line-buffered). CLOCK_MONOTONIC is one
clock for all processes of the host, so the lines of the scheduler (engine core) and the
worker interleave. Around ``execute_model`` it also writes the CPU and run-queue time each
thread of the worker, its engine core and its API server used during the step
(``/proc/<pid>/task/<tid>/schedstat``), as one ``threads I`` line.

A probe, not product code: it patches classes by name and does nothing unless
``STEP_TRACE_DIR`` is set.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import time

_DIR = os.environ.get("STEP_TRACE_DIR", "")
#: module -> (class, methods). The connector's two sides and vLLM's step.
TARGETS = {
    "lmcache_mooncake.connector.worker": ("WorkerSide", ("lookup", "_load", "start_load_kv", "get_finished")),
    "lmcache_mooncake.connector.scheduler": ("SchedulerSide", ("get_num_new_matched_tokens", "build_connector_meta")),
    "vllm.v1.core.sched.scheduler": ("Scheduler", ("schedule", "update_from_output")),
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", ("execute_model",)),
}
#: Methods whose result is written with their end line.
_RESULTS = {"get_num_new_matched_tokens", "get_finished"}
_out = None


def _write(name: str, phase: str, extra: str = "") -> None:
    global _out
    if _out is None:
        os.makedirs(_DIR, exist_ok=True)
        _out = open(os.path.join(_DIR, str(os.getpid())), "a", buffering=1)  # noqa: SIM115 - for the process's life
    _out.write(f"{time.monotonic():.6f} {os.getpid()} {name} {phase} {extra}\n")


def _threads() -> dict[str, tuple[int, int]]:
    """CPU and run-queue nanoseconds of every thread of this process, its parent and grandparent."""
    pids = [os.getpid(), os.getppid()]
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            pids.append(int(f.read().rsplit(")", 1)[1].split()[1]))
    except (OSError, ValueError, IndexError):
        pass
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait, _ = f.read().split()
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip().replace(" ", "_")
            except (OSError, ValueError):
                continue
            out[f"{pid}/{tid}/{comm}"] = (int(run), int(wait))
    return out


def _wrap(cls: type, meth: str) -> None:
    fn = getattr(cls, meth)
    name = f"{cls.__name__}.{meth}"

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        before = _threads() if meth == "execute_model" else None
        _write(name, "B")
        result = fn(*args, **kwargs)
        _write(name, "E", repr(result).replace(" ", "")[:200] if meth in _RESULTS else "")
        if before is not None:
            after = _threads()
            rows = sorted(((after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1], k)
                           for k in after), reverse=True)
            _write("threads", "I", ";".join(f"{k}:{run / 1e6:.1f}:{wait / 1e6:.1f}" for run, wait, k in rows
                                            if run > 1e6 or wait > 1e6))
        return result

    setattr(cls, meth, traced)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the targets' methods right after their module is executed."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module, exec_module=exec_module, name=name):
            exec_module(module)
            cls_name, methods = TARGETS[name]
            cls = getattr(module, cls_name, None)
            for meth in methods if cls is not None else ():
                if hasattr(cls, meth):
                    _wrap(cls, meth)

        spec.loader.exec_module = patched
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder())
