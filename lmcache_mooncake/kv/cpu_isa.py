"""Which kernel vLLM's ``CPU_ATTN`` backend picks (it decides how K and V are packed in a block),
and the load granularity its ``amx`` kernel needs.

Inside a vLLM worker the backend module is imported and asked; elsewhere (tests,
tools, the scheduler side) vLLM 0.32's ``_get_attn_isa`` is mirrored, since
importing vLLM takes seconds.
"""

from __future__ import annotations

import logging
import platform
import sys
from functools import lru_cache
from typing import Any

import torch

__all__ = ["SUPPORTED_ISAS", "check_isa", "load_granularity", "vllm_cpu_isa"]

logger = logging.getLogger(__name__)

SUPPORTED_ISAS: tuple[str, ...] = ("vec", "vec16", "amx")
"""The CPU attention kernels whose in-block packing :class:`~lmcache_mooncake.kv.layouts.CpuAttnLayout` reads."""


def check_isa(isa: str) -> None:
    """Raise ``ValueError`` unless ``isa`` is one of :data:`SUPPORTED_ISAS`."""
    if isa not in SUPPORTED_ISAS:
        raise ValueError(
            f"CPU_ATTN with the {isa!r} attention kernel is not supported: it packs K/V inside a block "
            f"differently from the {'/'.join(SUPPORTED_ISAS)} kernels, the only ones "
            "lmcache_mooncake can read and write"
        )


@lru_cache(maxsize=64)
def vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The CPU attention kernel vLLM uses for this geometry.

    Inside a vLLM worker running CPU_ATTN the backend module is already
    imported, so ask it. Otherwise (tests, tools) mirror vLLM 0.32's
    ``_get_attn_isa`` rather than importing vLLM, which takes seconds.
    """
    backend = sys.modules.get("vllm.v1.attention.backends.cpu_attn")
    if backend is not None and hasattr(backend, "_get_attn_isa"):
        return str(backend._get_attn_isa(dtype, block_size, head_size))
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if amx and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i686", "i386"):
        return f"{machine} (non-x86)"
    return "vec" if block_size % 32 == 0 else "vec16"


def load_granularity(vllm_config: Any) -> int:
    """Tokens a load must end on a multiple of, for the scheduler side (1: any token).

    vLLM 0.32's ``amx`` CPU attention kernel dies with an illegal instruction
    (SIGILL in ``cpu_attention_with_kv_cache``) when a request's computed tokens
    start inside a block, as they do after a load that ends mid-block; vLLM's
    own prefix cache only ever hits whole blocks. Seen on this project's AMX
    machine, 2026-12-02: a 1,000-token bfloat16 prompt with 999 tokens loaded
    crashed the worker, with 896 (7 blocks) it gave the recomputed tokens. So
    where vLLM will pick ``amx`` (CPU, bfloat16, AMX tiles, block size a
    multiple of 32), loads are whole blocks: the block size.

    A config this cannot read gives 1 (no restriction) with a warning, since on
    an AMX machine that would bring the crash back.
    """
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 1
        model = vllm_config.model_config
        dtype = model.dtype  # vLLM picks the kernel by the model's dtype: CPU_ATTN caches
        # "auto" (the model's dtype) or fp8, and fp8 under a bfloat16 model is still ``amx``.
        block_size = int(vllm_config.cache_config.block_size)
        isa = vllm_cpu_isa(dtype, block_size, int(model.get_head_size()))
    except Exception as exc:  # noqa: BLE001 - a config we cannot read: no restriction, said aloud
        logger.warning(
            "could not tell which CPU attention kernel vLLM will use (%s: %s), so loads may end inside "
            "a block; if vLLM picks its 'amx' kernel (bfloat16 on a CPU with AMX tiles), such a load "
            "crashes the worker with SIGILL. Check vLLM's config API (model_config.dtype, "
            "get_head_size(), cache_config.block_size) against lmcache_mooncake.kv.cpu_isa",
            type(exc).__name__, exc,
        )
        return 1
    return block_size if isa == "amx" else 1
