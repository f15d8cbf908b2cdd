"""Loads that skip LMCache's buffers: each byte copied once on its way into paged KV.

Through LMCache's ``retrieve`` a disk chunk is read into a buffer of LMCache's
CPU tier and then copied into paged KV by our copier: two passes over every
byte (three for a store get over shared memory, which lands in the store
client's staging region first). Where chunks keep the backend's own blocks
(chunk layout ``"blocks"``), :class:`DirectLoader` instead

- reads each disk chunk with one ``preadv`` whose buffers are the paged
  blocks themselves (:func:`block_chunks.read_targets`), checks the bytes
  where they landed, and copies what is left (blocks the load covers in
  part, the partial last block) from a small per-thread buffer;
- copies each store chunk from the client's staging region, where it is
  checked, straight into paged KV (``shm`` mode, and whenever the store tier
  cannot get into LMCache's buffers directly; in ``tcp`` mode the tier's own
  direct get already makes two copies, and LMCache's ``retrieve`` keeps it).

Who calls: :meth:`WorkerSide._load`, on the worker, for a load's chunks that
the CPU tier does not hold (:meth:`DirectLoader.segments`); the others still
go through LMCache's ``retrieve``. Chunks loaded here are not kept in the CPU
tier: vLLM's own prefix cache holds them next.

A chunk that fails its check (or is gone) stops the load there: the tier
counts, logs and removes it, and the worker reports every block from that
chunk on as failed, so vLLM recomputes them (they may hold part of the bad
bytes; nothing is served from them). The chunks of one disk run are read on
the disk tier's reader threads, one per core; a store run is one batched get.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from lmcache.utils import CacheEngineKey

from lmcache_mooncake.engine import context
from lmcache_mooncake.kv import block_chunks
from lmcache_mooncake.kv.paged_copy import PagedKV
from lmcache_mooncake.tiers import disk, mooncake

#: One chunk of a load: ``(start, end, key)`` as the key database yields it.
Chunk = tuple[int, int, CacheEngineKey]
#: Where :meth:`DirectLoader.segments` sends a run of chunks.
ENGINE, DISK, STORE = "engine", "disk", "store"


class DirectLoader:
    """Loads chunks the CPU tier does not hold straight into paged KV for one engine; see the
    module docstring."""

    def __init__(self, engine: Any, disk_tier: disk.DiskTierConnector | None,
                 store_tier: mooncake.MooncakeTierConnector | None):
        self.engine = engine
        self.tier = disk_tier
        self.store = store_tier
        self.copier = engine.gpu_connector
        self._scratch = threading.local()

    @classmethod
    def for_engine(cls, engine: Any) -> DirectLoader | None:
        """A loader for ``engine`` (built by ``engine.build_engine``), or None where it cannot
        help: no disk or store tier, or chunks kept token-major (their bytes need a
        transposing copy)."""
        tiers = context(engine).tiers
        disk_tier, store_tier = tiers.get(disk.PLUGIN_NAME), tiers.get(mooncake.PLUGIN_NAME)
        if (disk_tier is None and store_tier is None) or not getattr(engine.gpu_connector, "blocks", False):
            return None
        return cls(engine, disk_tier, store_tier)

    def segments(self, chunks: list[Chunk], kv_caches: list[torch.Tensor]) -> Iterator[tuple[str, list[Chunk]]]:
        """Split a load's chunks, in order, into runs of one kind: :data:`DISK` (not in the CPU
        tier, a file on disk), :data:`STORE` (neither, and the store tier gets through its
        staging region), :data:`ENGINE` (the rest: LMCache's retrieve)."""
        direct_ok = self.copier.paged_kv(kv_caches).layer_bytes() is not None
        cpu = self.engine.storage_manager.local_cpu_backend
        store_ok = direct_ok and self.store is not None and self.store.gets_through_staging()
        run: list[Chunk] = []
        kind = ENGINE
        for chunk in chunks:
            key = chunk[2]
            here = ENGINE
            if direct_ok and not (cpu is not None and cpu.contains(key)):
                if self.tier is not None and self.tier.has(key):
                    here = DISK
                elif store_ok:
                    here = STORE
            if run and here != kind:
                yield kind, run
                run = []
            kind = here
            run.append(chunk)
        if run:
            yield kind, run

    def load(self, kind: str, chunks: list[Chunk], kv_caches: list[torch.Tensor], slots: list[int],
             start: int, end: int) -> int:
        """Load a run of ``kind`` (:data:`DISK` or :data:`STORE`) as :meth:`load_disk` and
        :meth:`load_store` do."""
        if kind == DISK:
            return self.load_disk(chunks, kv_caches, slots, start, end)
        if kind == STORE:
            return self.load_store(chunks, kv_caches, slots, start, end)
        raise ValueError(f"not a direct run: {kind!r}")

    def load_store(self, chunks: list[Chunk], kv_caches: list[torch.Tensor], slots: list[int],
                   start: int, end: int) -> int:
        """Get ``chunks`` (consecutive) from the store in one batched call and copy each from the
        client's staging region, where it is checked, into paged KV (tokens in ``[start, end)``
        only). Returns where the loaded prefix ends."""
        paged = self.copier.paged_kv(kv_caches)
        shape = paged.shape
        hidden = shape.num_kv_heads * shape.head_size
        names = [mooncake.object_name(key) for _, _, key in chunks]
        done = [False] * len(chunks)

        def take(j: int, data: memoryview, bad: list[str]) -> None:
            first, last, key = chunks[j]
            lo, hi = max(start, first) - first, min(end, last) - first
            dims = (2, shape.num_layers, last - first, hidden)
            header = self.store.check_staged(key, data, dims, shape.dtype, bad)
            if header is None:
                return
            if hi > lo:
                payload = data[header.payload_offset : header.total_nbytes]
                src = torch.frombuffer(payload, dtype=shape.dtype).view(dims)
                block_chunks.scatter(paged, torch.tensor(slots[first : first + hi]), src, lo, hi)
            done[j] = True

        self.store.get_visit(names, take)
        loaded = chunks[0][0]
        for chunk, ok in zip(chunks, done, strict=True):
            if not ok:
                break
            loaded = chunk[1]
        return loaded

    def load_disk(self, chunks: list[Chunk], kv_caches: list[torch.Tensor], slots: list[int],
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
