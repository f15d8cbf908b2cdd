"""LMCache's cache engine, set up to run on the CPU with our keys and our copies.

Three things of ours are handed to LMCache's in-process engine:

- :class:`PagedKVCopier`, LMCache's "GPU connector" role: it copies between
  vLLM's paged KV and LMCache's chunk buffers with :mod:`paged_copy`, or
  :mod:`block_chunks` where chunks keep the paged blocks' own bytes
  (LMCache's own copy path is CUDA-only and finds nothing on a CPU).
- :class:`ChunkKeyDatabase`, LMCache's token-database role: it names chunks
  with :mod:`keys` (chained SHA-256 in a namespace, with salt and LoRA),
  instead of LMCache's default of Python's ``hash()``.
- the disk tier of :mod:`tiers.disk`, as a remote plug-in.

LMCache keeps doing what it does well: the CPU tier with its allocator and
eviction, the write-through to the next tier on its event loop, and prefix
lookups across tiers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.token_database import TokenDatabase

from lmcache_mooncake.chunks.keys import BLOCKS, TOKENS, KeyNamespace, chunk_keys
from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.kv import block_chunks, device_copy, layouts, paged_copy
from lmcache_mooncake.runtime import prefault
from lmcache_mooncake.store.endpoint import StoreEndpoint, store_endpoint  # noqa: F401 - re-exported
from lmcache_mooncake.tiers import disk, mooncake
from lmcache_mooncake.tiers.base import EngineContext, engine_context, release_context

logger = logging.getLogger(__name__)

#: request_configs entries that carry the request's salt and LoRA to the key database.
SALT = "lmcm.cache_salt"
LORA = "lmcm.lora"

def request_configs(cache_salt: str | None, lora: str | None) -> dict[str, Any]:
    """What store/retrieve/lookup need to derive a request's keys."""
    return {SALT: cache_salt, LORA: lora}


#: LMCache's names of the tiers :func:`build_engine` sets up -> our tier names
#: (the ``tier`` label of our metrics, and :func:`lookup_tiers`' runs).
TIER_NAMES = {
    "LocalCPUBackend": "cpu",
    f"RemoteBackend-{disk.PLUGIN_NAME}": "disk",
    f"RemoteBackend-{mooncake.PLUGIN_NAME}": "store",
}

#: One run of a lookup's hit: the tier that holds every chunk up to ``end`` (a token
#: count) from the previous run's end (or 0).
TierRun = tuple[str, int]


def lookup_tiers(engine: LMCacheEngine, tokens: list[int], request_configs: dict[str, Any]) -> tuple[int, list[TierRun]]:
    """``engine.lookup`` that also says which tier answered for each hit chunk.

    Returns ``(hit, runs)``: ``hit`` as ``engine.lookup`` counts it (tokens of the
    cached prefix), and ``runs`` of :data:`TierRun` covering ``[0, hit)`` in order,
    each naming the tier (:data:`TIER_NAMES`, else LMCache's own name) that held
    those chunks when asked. A tier that verifies a chunk at lookup (disk) keeps
    it in the CPU tier afterwards; the run still names the tier it was found in.
    Like ``engine.lookup`` it pins nothing and reports to LMCache's stats monitor.
    """
    if engine.use_layerwise:  # layer-wise keys are looked up per layer; not used by build_engine
        return engine.lookup(tokens=tokens, request_configs=request_configs), []
    if not engine.is_healthy():
        logger.warning("LMCache is unhealthy, skipping lookup operation")
        return 0, []
    monitor = engine.stats_monitor.on_lookup_request(len(tokens))
    hit = 0
    try:
        chunks = list(engine.token_database.process_tokens(tokens=tokens, request_configs=request_configs))
        found, by_backend = engine.storage_manager.batched_contains(
            [key for _, _, key in chunks], engine.retrieve_locations, False
        )
        runs: list[TierRun] = []
        done = 0
        # batched_contains asks the tiers in order, each for the chunks past the
        # previous ones' hits, so its mapping is the prefix in order, tier by tier.
        for backend, held in by_backend.items():
            done += len(held)
            runs.append((TIER_NAMES.get(backend, backend), chunks[done - 1][1]))
        hit = chunks[found - 1][1] if found else 0
        return hit, runs
    finally:
        engine.stats_monitor.on_lookup_finished(monitor, hit)


class ChunkKeyDatabase(TokenDatabase):
    """LMCache token database that names chunks with :func:`keys.chunk_keys`."""

    def __init__(self, namespace: KeyNamespace, metadata: LMCacheMetadata, save_unfull_chunk: bool):
        # TokenDatabase.__init__ wires LMCache's own hash functions; we need none.
        self.namespace = namespace
        self.metadata = metadata
        self.chunk_size = namespace.chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.save_only_first_rank = False

    def process_tokens(
        self,
        tokens: torch.Tensor | list[int] | None = None,
        hashes: list[int] | None = None,
        offsets: list[int] | None = None,
        mask: torch.Tensor | None = None,
        make_key: bool = True,
        request_configs: dict | None = None,
    ) -> Iterable[tuple[int, int, CacheEngineKey | int]]:
        if tokens is None:
            raise ValueError("ChunkKeyDatabase needs token ids (hash-only calls are not used)")
        token_list = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        rc = request_configs or {}
        skip = 0
        if mask is not None:
            skip = int(mask.numel() - mask.long().sum().item())
            if skip % self.chunk_size:
                raise ValueError("masked prefix is not a multiple of chunk_size")
        for ck in chunk_keys(
            self.namespace, token_list, rc.get(SALT), rc.get(LORA),
            include_partial=self.save_unfull_chunk,
        ):
            if ck.start < skip:
                continue
            if not make_key:
                yield ck.start, ck.end, ck.as_int
                continue
            yield ck.start, ck.end, CacheEngineKey(
                self.metadata.model_name,
                self.metadata.world_size,
                self.metadata.worker_id,
                ck.as_int,
                self.metadata.kv_dtype,
                None,
            )


class PagedKVCopier(GPUConnectorInterface):
    """Copies chunks between vLLM's paged KV (any supported layout) and LMCache buffers.

    kwargs of store/retrieve: ``kvcaches`` (per-layer paged tensors, in layer
    order), ``slot_mapping`` (slot of every token passed to store/retrieve),
    and for retrieve ``skip_leading_tokens`` and ``load_end``: only tokens in
    ``[skip_leading_tokens, load_end)`` are written (vLLM already holds those
    before, possibly shared with other requests, and computes those after).
    """

    def __init__(self, layout: layouts.PagedLayout, num_layers: int, num_kv_heads: int, head_size: int,
                 chunk_layout: str = TOKENS):
        self.layout = layout
        self.num_layers = num_layers
        self.hidden = num_kv_heads * head_size
        #: Chunks keep the paged blocks' own bytes (:mod:`block_chunks`), else token-major.
        self.blocks = chunk_layout == BLOCKS
        # The paged tensors, validated once (vLLM passes the same list every step).
        self._paged: paged_copy.PagedKV | None = None
        #: The host <-> device mover (:meth:`device_copier`); direct copies on CPU tensors.
        self.copier: device_copy.DeviceCopier | None = None

    def paged_kv(self, kvcaches: list[torch.Tensor]) -> paged_copy.PagedKV:
        """vLLM's paged tensors as one validated :class:`paged_copy.PagedKV` (kept while vLLM passes the same ones)."""
        paged = self._paged
        if paged is None or len(paged.kv_caches) != len(kvcaches) or any(
            a is not b for a, b in zip(paged.kv_caches, kvcaches, strict=True)
        ):
            paged = self._paged = paged_copy.PagedKV(self.layout, kvcaches)
        return paged

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def device_copier(self, paged: paged_copy.PagedKV) -> device_copy.DeviceCopier:
        """The worker's host <-> device mover for ``paged``'s device (:func:`device_copy.for_device`;
        tests may set :attr:`copier` to their own)."""
        if self.copier is None or self.copier.device != paged.device:
            self.copier = device_copy.for_device(paged.device)
        return self.copier

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[override]
        """Copy each chunk's tokens from paged KV into its LMCache buffer; the bytes are in the
        buffers when this returns. On CUDA: a gather on the device into a scratch buffer, one
        asynchronous copy into the (pinned) buffer, on the copier's device-to-host stream, after
        what the caller's stream has queued (the KV the model just wrote); see :mod:`device_copy`."""
        paged, slots = self.paged_kv(kwargs["kvcaches"]), kwargs["slot_mapping"]
        copier = self.device_copier(paged)
        if copier.is_cuda:
            slots = paged.check_slots(slots)  # range-checked on the host, on the device once
        handles = [copier.start_to_host(obj.tensor, functools.partial(block_chunks.gather, paged, slots[start:end]))
                   if self.blocks else copier.start_chunk_to_host(paged, slots[start:end], obj.tensor)
                   for obj, start, end in zip(memory_objs, starts, ends, strict=True)]
        for handle in handles:
            copier.synchronize(handle)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[override]
        """Write each chunk's tokens in ``[skip_leading_tokens, load_end)`` into paged KV; they are
        there, for any stream, when this returns. On CUDA: one asynchronous copy of those tokens
        from the (pinned) buffer into a device scratch buffer and a scatter from it on the device,
        on the copier's host-to-device stream; see :mod:`device_copy`."""
        paged, slots = self.paged_kv(kwargs["kvcaches"]), kwargs["slot_mapping"]
        skip = int(kwargs.get("skip_leading_tokens", 0))
        stop = int(kwargs.get("load_end", len(slots)))
        copier = self.device_copier(paged)
        if copier.is_cuda:
            slots = paged.check_slots(slots)
        handles = []
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            lo, hi = max(start, skip), min(end, stop)
            if hi <= lo:
                continue
            if self.blocks:  # the whole chunk buffer: its blocks are not token-major
                scatter = functools.partial(self._scatter_blocks, paged, slots[start:hi], lo - start, hi - start)
                handles.append(copier.start_to_device(obj.tensor, scatter))
            else:
                handles.append(copier.start_chunk_to_device(paged, slots[lo:hi],
                                                            obj.tensor[:, :, lo - start : hi - start]))
        for handle in handles:
            copier.synchronize(handle)

    @staticmethod
    def _scatter_blocks(paged: paged_copy.PagedKV, slots: torch.Tensor, lo: int, hi: int, src: torch.Tensor) -> None:
        block_chunks.scatter(paged, slots, src, lo, hi)


def build_engine(
    cfg: CacheConfig,
    namespace: KeyNamespace,
    layout: layouts.PagedLayout,
    kv_dtype: torch.dtype,
    instance_id: str,
) -> LMCacheEngine:
    """Create and start an LMCache engine with our copier, key database and tiers.

    Its counters, write tracking and tier settings are in
    :func:`context` ``(instance_id)``; close it with :func:`close_engine`.
    """
    ctx = engine_context(instance_id)
    ctx.set_seal(cfg.seal())
    ctx.namespace = namespace  # each tier records its manifest on its first write
    extra: dict[str, Any] = {}
    plugins: list[str] = []
    if cfg.disk_path is not None:
        plugins.append(disk.PLUGIN_NAME)
        ctx.tier_settings[disk.PLUGIN_NAME] = disk.DiskTierSettings(
            cfg.disk_path, int(cfg.max_local_disk_size * 2**30), cfg.verify_on_lookup
        )
        extra.update(disk.DiskTierConnector.plugin_extra_config())
    if cfg.mooncake is not None:
        plugins.append(mooncake.PLUGIN_NAME)
        ctx.tier_settings[mooncake.PLUGIN_NAME] = mooncake.MooncakeTierSettings(
            cfg.mooncake, functools.partial(store_endpoint, cfg.mooncake)
        )
        extra.update(mooncake.MooncakeTierConnector.plugin_extra_config())
    ctx.writers = list(plugins)
    lm_config = LMCacheEngineConfig.from_defaults(
        chunk_size=namespace.chunk_size,
        local_cpu=cfg.local_cpu,
        max_local_cpu_size=cfg.max_local_cpu_size,
        local_disk=None,
        save_unfull_chunk=cfg.save_unfull_chunk,
        remote_storage_plugins=plugins or None,
        extra_config=extra or None,
        # Writes to the next tier must not be skipped or delayed by LMCache's
        # own heuristics: a later process can only find what was written.
        lmcache_instance_id=instance_id,
    )
    metadata = LMCacheMetadata(
        model_name=namespace.hex(),
        world_size=namespace.tp_size,
        local_world_size=namespace.tp_size,
        worker_id=namespace.tp_rank,
        local_worker_id=namespace.tp_rank,
        kv_dtype=kv_dtype,
        kv_shape=(namespace.num_layers, 2, namespace.chunk_size, namespace.num_kv_heads, namespace.head_size),
        chunk_size=namespace.chunk_size,
        role="worker",
    )
    copier = PagedKVCopier(layout, namespace.num_layers, namespace.num_kv_heads, namespace.head_size,
                           namespace.chunk_layout)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, lm_config, metadata, copier, _no_broadcast, _no_broadcast_object
    )
    engine.token_database = ChunkKeyDatabase(namespace, metadata, cfg.save_unfull_chunk)
    engine.post_init()
    if cfg.prefault_cpu_tier:  # before any chunk is stored: the touch writes zeros
        ctx.prefault = prefault.prefault_cpu_tier(engine)
    return engine


def _no_broadcast(tensor: torch.Tensor, src: int) -> None:
    return None


def _no_broadcast_object(obj: Any, src: int) -> Any:
    return obj


def context(engine_or_id: LMCacheEngine | str) -> EngineContext:
    """The counters, write tracking and tier settings of an engine built by :func:`build_engine`."""
    if isinstance(engine_or_id, str):
        return engine_context(engine_or_id)
    return engine_context(str(engine_or_id.config.lmcache_instance_id))


def pending_writes(engine: LMCacheEngine) -> int:
    """Chunks handed to slower tiers (disk, store) whose writes have not finished."""
    return context(engine).writes.count


async def _barrier() -> None:
    return None


def write_barrier(engine: LMCacheEngine) -> concurrent.futures.Future:
    """A future that is done once every write submitted before this call is tracked.

    LMCache hands a store's chunks to slower tiers on its event loop (its
    instrumented connector wraps ours in a coroutine), so a tier's write may
    begin, and be tracked, only after ``engine.store`` returned. A no-op
    scheduled on the same loop after them runs after each of them has begun
    (the loop runs what was scheduled first, first): once it is done, "no
    write of these keys pending" means they are written.
    """
    return asyncio.run_coroutine_threadsafe(_barrier(), engine.storage_manager.loop)


def drain(engine: LMCacheEngine, timeout: float) -> bool:
    """Wait until every write to slower tiers submitted so far has finished; False on timeout."""
    deadline = time.monotonic() + timeout
    try:
        write_barrier(engine).result(timeout)
    except (concurrent.futures.TimeoutError, RuntimeError):
        return False
    return context(engine).writes.wait(max(deadline - time.monotonic(), 0.0))


def close_engine(engine: LMCacheEngine, instance_id: str, timeout: float = 60.0) -> None:
    """Drain pending writes, then close (closing with writes pending can crash LMCache)."""
    if not drain(engine, timeout):
        logger.warning("closing with %d chunk writes still pending", pending_writes(engine))
    LMCacheEngineBuilder.destroy(instance_id)
    release_context(instance_id)
