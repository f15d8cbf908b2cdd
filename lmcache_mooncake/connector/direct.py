"""Loads from the disk tier straight into paged KV: one copy of each byte.

Through LMCache's ``retrieve`` a disk chunk is read into a buffer of LMCache's
CPU tier and then copied into paged KV by our copier: two passes over every
byte. Where chunks keep the backend's own blocks (chunk layout ``"blocks"``),
:class:`DirectDiskLoader` reads each chunk file with one ``preadv`` whose
buffers are the paged blocks themselves (:func:`block_chunks.read_targets`),
checks the bytes where they landed, and copies what is left (blocks the load
covers in part, the partial last block) from a small per-thread buffer.

Who calls: :meth:`WorkerSide._load`, on the worker, for a load's chunks that
the CPU tier does not hold and the disk tier does (:meth:`segments`); the
others still go through LMCache's ``retrieve`` (CPU tier, store). Chunks read
here are not kept in the CPU tier: vLLM's own prefix cache holds them next.

A chunk that fails its check (or whose file went away) stops the load there:
the disk tier counts, logs and removes it, and the worker reports every block
from that chunk on as failed, so vLLM recomputes them (they may hold part of
the bad bytes; nothing is served from them). The chunks of one segment are
read on the disk tier's reader threads, one per core.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from lmcache.utils import CacheEngineKey

from lmcache_mooncake import block_chunks
from lmcache_mooncake.engine import context
from lmcache_mooncake.layouts import PagedKV
from lmcache_mooncake.tiers import disk

#: One chunk of a load: ``(start, end, key)`` as the key database yields it.
Chunk = tuple[int, int, CacheEngineKey]


class DirectDiskLoader:
    """Reads disk chunks straight into paged KV for one engine; see the module docstring."""

    def __init__(self, engine: Any, tier: disk.DiskTierConnector):
        self.engine = engine
        self.tier = tier
        self.copier = engine.gpu_connector
        self._scratch = threading.local()

    @classmethod
    def for_engine(cls, engine: Any) -> DirectDiskLoader | None:
        """A loader for ``engine`` (built by ``engine.build_engine``), or None where it cannot
        help: no disk tier, or chunks kept token-major (their bytes need a transposing copy)."""
        tier = context(engine).tiers.get(disk.PLUGIN_NAME)
        if tier is None or not getattr(engine.gpu_connector, "blocks", False):
            return None
        return cls(engine, tier)

    def segments(self, chunks: list[Chunk], kv_caches: list[torch.Tensor]) -> Iterator[tuple[bool, list[Chunk]]]:
        """Split a load's chunks, in order, into runs read here (``True``: not in the CPU tier,
        a file on disk) and runs left to LMCache's retrieve (``False``)."""
        direct_ok = self.copier.paged_kv(kv_caches).layer_bytes() is not None
        cpu = self.engine.storage_manager.local_cpu_backend
        run: list[Chunk] = []
        kind = False
        for chunk in chunks:
            key = chunk[2]
            here = direct_ok and not (cpu is not None and cpu.contains(key)) and self.tier.has(key)
            if run and here != kind:
                yield kind, run
                run = []
            kind = here
            run.append(chunk)
        if run:
            yield kind, run

    def load(self, chunks: list[Chunk], kv_caches: list[torch.Tensor], slots: list[int],
             start: int, end: int) -> int:
        """Read ``chunks`` (consecutive) into paged KV, writing only tokens in ``[start, end)``
        (``slots``: the slot of every token of ``[0, end)``). Returns where the loaded prefix
        ends: the last chunk's end, or the start of the first chunk that was not loaded."""
        paged = self.copier.paged_kv(kv_caches)
        shape = paged.shape
        hidden = shape.num_kv_heads * shape.head_size

        def one(chunk: Chunk) -> bool:
            first, last, key = chunk
            lo, hi = max(start, first) - first, min(end, last) - first
            if hi <= lo:
                return True
            tokens = last - first
            scratch, scratch_bytes = self._scratch_for(paged, tokens)
            chunk_slots = slots[first : first + hi]
            planned = block_chunks.read_targets(paged, chunk_slots, tokens, scratch_bytes, lo, hi)
            dims = (2, shape.num_layers, tokens, hidden)
            if planned is None or not self.tier.read_into(key, dims, shape.dtype, planned[0]):
                return False
            if planned[1]:
                buf = scratch[: 2 * shape.num_layers * tokens * hidden].view(dims)
                block_chunks.scatter(paged, torch.tensor(chunk_slots), buf, lo, hi, runs=False)
            return True

        loaded = chunks[0][0]
        for chunk, ok in zip(chunks, self.tier.map_reads(one, chunks), strict=True):
            if not ok:
                break
            loaded = chunk[1]
        return loaded

    def _scratch_for(self, paged: PagedKV, tokens: int) -> tuple[torch.Tensor, memoryview]:
        """This thread's flat buffer (and its bytes) for the bytes of a ``tokens``-token chunk
        that do not go straight into paged KV (only those pages are ever touched)."""
        shape = paged.shape
        numel = 2 * shape.num_layers * tokens * shape.num_kv_heads * shape.head_size
        held = getattr(self._scratch, "held", None)
        if held is None or held[0].numel() < numel or held[0].dtype != shape.dtype:
            buf = torch.empty(numel, dtype=shape.dtype)
            held = self._scratch.held = (buf, memoryview(buf.view(torch.uint8).numpy()).cast("B"))
        return held
