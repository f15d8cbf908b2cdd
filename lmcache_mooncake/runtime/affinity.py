"""Let the threads we start run on every core this process was given.

vLLM's CPU worker binds each OpenMP thread to one core
(``VLLM_CPU_OMP_THREADS_BIND``), its main thread included, and a Linux thread
starts with the affinity of the thread that starts it. So every thread we start
from vLLM's worker (the store client's call thread, and through it every thread
Mooncake's transfer engine starts in ``setup``; the loader; the lookup server)
would share core 0 with the forward pass while the other core idles between
steps. In a tcp-mode prefill worker 81 of 83 threads were bound to core 0
(``/proc/<pid>/task/*/status``, seen during a ``tests/test_e2e_hosts.py`` run).

vLLM's own NIXL connector meets the same problem by moving its transfer thread
to reserved cores (``nixl/base_worker.py``). With no core reserved
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, as on 2 cores) we let the kernel place
our threads on any core the process's threads are bound to. Who calls: each of
our long-lived threads, first thing. ``LMCACHE_MOONCAKE_KEEP_THREAD_AFFINITY=1`` keeps the
inherited binding (to compare).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

KEEP_ENV = "LMCACHE_MOONCAKE_KEEP_THREAD_AFFINITY"


def process_cpus() -> set[int]:
    """The cores any thread of this process may run on (the union of their affinities)."""
    cpus: set[int] = set()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return set(os.sched_getaffinity(0))
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:  # the thread has ended
            continue
    return cpus or set(os.sched_getaffinity(0))


def widen_current_thread(name: str = "") -> None:
    """Let the calling thread (and the threads it starts from now on) run on every core
    of :func:`process_cpus`. No-op where affinity cannot be set or ``LMCACHE_MOONCAKE_KEEP_THREAD_AFFINITY``
    is set; never raises."""
    if os.environ.get(KEEP_ENV, "") not in ("", "0") or not hasattr(os, "sched_setaffinity"):
        return
    try:
        mine, wide = os.sched_getaffinity(0), process_cpus()
        if wide != mine:
            os.sched_setaffinity(0, wide)
            log.debug("thread %s: cores %s -> %s", name, sorted(mine), sorted(wide))
    except OSError as e:
        log.debug("thread %s keeps its cores: %s", name, e)
