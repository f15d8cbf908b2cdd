"""Touch every page of LMCache's CPU tier once, at start-up, not inside the first loads.

Why: a fresh process's memory is mapped but not backed until first written;
each first write of a 4 KiB page is a page fault (about 0.4 s per GiB on
these machines). Touched at start-up, the whole pool is resident from the
start (the worker's RSS then shows it, as it shows vLLM's own KV cache), and
no request pays for faults in the buffers its chunks land in.

LMCache 0.5.6 already zeroes the pool when it allocates it without an
accelerator (``lmcache.v1.platform.torch_ops.mem_alloc``, "first-touch
initialization"), so with that version the touch finds every page resident
and costs about 10 ms per GiB; it is kept so that another LMCache version or
allocator path (lazy, hugepages, shared memory) does not move the faults back
into requests. The log line says how much became resident.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

if TYPE_CHECKING:  # importing LMCache starts its process-wide state; the tests of touch_pages need none
    from lmcache.v1.cache_engine import LMCacheEngine

logger = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class Prefault:
    """What one prefault touched."""

    #: Bytes of the buffer whose pages were written.
    bytes: int
    #: Wall time of the touch.
    seconds: float
    #: Growth of the process's resident memory during the touch (pages that
    #: were not backed before); 0 when the allocator had touched them already.
    newly_resident: int


def cpu_pool(engine: LMCacheEngine) -> torch.Tensor | None:
    """The tensor LMCache's CPU tier allocates chunks from, or None without a CPU tier.

    That is ``LocalCPUBackend.memory_allocator.buffer`` (LMCache's
    ``MixedMemoryAllocator``, also the staging memory of the disk and store tiers).
    """
    backend = engine.storage_manager.storage_backends.get("LocalCPUBackend")
    if backend is None:
        return None
    buf = getattr(backend.memory_allocator, "buffer", None)
    return buf if isinstance(buf, torch.Tensor) and buf.numel() > 0 else None


def touch_pages(buf: torch.Tensor) -> Prefault:
    """Write a zero into the first byte of every page of ``buf`` (contiguous CPU memory).

    Overwrites data: call it on memory nothing is stored in yet. One write per
    page, not a read and a write (a read of an untouched page maps the shared
    zero page, and the write after it faults again: measured 2x slower), and
    not ``fill_`` of every byte (the faults cost the same, the writes are extra).
    """
    if not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError(f"touch_pages needs contiguous CPU memory, got a {buf.device} tensor of strides {buf.stride()}")
    flat = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
    flat = flat.reshape(-1)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    # The first page may start mid-page: step from the next page boundary, plus byte 0.
    first = (-flat.data_ptr()) % PAGE
    flat[first::PAGE].zero_()
    flat[:1].zero_()
    seconds = time.perf_counter() - t0
    return Prefault(flat.numel(), seconds, max(proc.memory_info().rss - rss0, 0))


def prefault_cpu_tier(engine: LMCacheEngine) -> Prefault | None:
    """Touch every page of ``engine``'s CPU tier (see :func:`touch_pages`) and log it.

    Call it right after the engine is built, before any chunk is stored.
    Returns None (and logs nothing) when the engine has no CPU pool.
    """
    pool = cpu_pool(engine)
    if pool is None:
        return None
    done = touch_pages(pool)
    logger.info(
        "prefaulted LMCache's CPU tier: %.2f GiB in %.0f ms, %.0f MiB of it newly resident "
        "(prefault_cpu_tier: false turns this off)",
        done.bytes / 2**30, done.seconds * 1e3, done.newly_resident / 2**20,
    )
    return done
