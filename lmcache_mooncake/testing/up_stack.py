"""``lmcache-mooncake up`` as a child process, for tests and benchmarks that need the whole stack.

Who calls it: ``tests/test_e2e_serving_client.py`` and ``benchmarks/serving.py``.
:func:`up_stack` starts ``up`` (store, prefill and decode vLLMs, proxy), waits
for its "stack is up" line and the proxy's ``/health``, yields an
:class:`UpStack` (the proxy's URL, the work folder with every log), and on exit
stops it with SIGTERM (``up`` stops its children in reverse order) and SIGKILLs
whatever of its process tree is left after ``stop_grace_s``, and the store if ``up``
did not stop it (its state is in ``work/store``, so it is up's own). Raises
``RuntimeError`` with the end of ``up``'s output when it exits or is not up in
time.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lmcache_mooncake.runtime import procs

__all__ = ["UpSpec", "UpStack", "up_stack"]

READY_LINE = "stack is up"


@dataclass(frozen=True)
class UpSpec:
    """What ``up`` is started with."""

    model: str
    #: Folder for the store state, up's work folder (every instance's log) and up's own log.
    work: Path
    prefill: int = 1
    decode: int = 1
    port: int | None = None  # None: a free port
    store_memory: str = "512MiB"
    #: Extra vLLM arguments of every instance, e.g. ``["--dtype=float32", "--max-model-len=4096"]``.
    vllm_args: list[str] = field(default_factory=list)
    proxy_args: list[str] = field(default_factory=list)
    #: ``up --decode-saves``: decode instances save what they compute (kv_both).
    decode_saves: bool = False
    env: Mapping[str, str] | None = None
    start_timeout_s: float = 600.0
    stop_grace_s: float = 60.0


@dataclass(frozen=True)
class UpStack:
    url: str  # the proxy, http://127.0.0.1:PORT (the OpenAI API under /v1)
    work: Path  # up's --work-dir: prefill-0.log, decode-0.log, proxy.log, ...
    log: Path  # up's own output
    proc: subprocess.Popen


def up_command(spec: UpSpec, port: int) -> list[str]:
    return [sys.executable, "-m", "lmcache_mooncake.cli", "up", "--model", spec.model, "--port", str(port),
            "--prefill", str(spec.prefill), "--decode", str(spec.decode),
            "--state-dir", str(spec.work / "store"), "--store-memory", spec.store_memory,
            "--work-dir", str(spec.work / "up"), *(["--decode-saves"] if spec.decode_saves else []),
            *(f"--vllm-arg={a}" for a in spec.vllm_args), *(f"--proxy-arg={a}" for a in spec.proxy_args)]


@contextlib.contextmanager
def up_stack(spec: UpSpec) -> Iterator[UpStack]:
    spec.work.mkdir(parents=True, exist_ok=True)
    port = spec.port or procs.free_port()
    log = spec.work / "up.log"
    proc = procs.spawn(up_command(spec, port), log, env=spec.env)
    stack = UpStack(f"http://127.0.0.1:{port}", spec.work / "up", log, proc)
    try:
        procs.wait_until(
            lambda: READY_LINE in log.read_text(errors="replace"),
            alive=lambda: proc.poll() is None,
            deadline=time.monotonic() + spec.start_timeout_s,
            on_exit=lambda: RuntimeError(f"up exited ({proc.returncode}) before the stack was up; "
                                         f"log {log}:\n{procs.tail_log(log, 40)}"),
            on_timeout=lambda: RuntimeError(f"up was not up within {spec.start_timeout_s:.0f} s; "
                                            f"log {log}:\n{procs.tail_log(log, 40)}"),
            interval_s=1.0)
        procs.wait_healthy(proc, stack.url, 60, "up's proxy", log)
        yield stack
    finally:
        _stop(proc, spec.stop_grace_s)
        from lmcache_mooncake.store.launcher import stop_store

        stop_store(spec.work / "store")  # a no-op when up stopped it (it removes the state file)


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to ``up`` (it stops what it started), then SIGKILL to what is left of its tree."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    procs.stop_group(proc)  # up's own group, at once
    for p in tree:  # each child of up runs in its own session: not in up's group
        with contextlib.suppress(psutil.Error):
            for q in [*p.children(recursive=True), p]:
                q.kill()
