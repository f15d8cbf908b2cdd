"""The shared remote tier: the real Mooncake Store, as an LMCache remote plug-in.

Loaded through LMCache's remote-storage plug-in mechanism (the same one as
:mod:`tiers.disk`), after the CPU and disk tiers. It talks to the store with
:class:`lmcache_mooncake.store.client.StoreClient`: batched existence checks,
batched puts and gets through one registered buffer, and a timeout on every
call, so a slow or dead store is a miss within ``mooncake.timeout``, never a
hang. Objects are verified chunks (:mod:`chunk_format`): bytes from the store
that fail their check are a miss, counted and logged.

Object names come from :func:`lmcache_mooncake.keys.object_name` (full-width
namespace digest and chunk key), built from validated key fields only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from lmcache_mooncake import chunk_format, keys
from lmcache_mooncake.stats import STATS
from lmcache_mooncake.store.client import NOT_FOUND, StoreClient, describe
from lmcache_mooncake.tiers import WRITES

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lmcm_mooncake"
_PREFIX = f"remote_storage_plugin.{PLUGIN_NAME}"
# Room for the safetensors header beside a full chunk's payload.
_HEADER_ROOM = 64 * 1024


def plugin_extra_config(addresses: dict[str, str], mc: Any) -> dict[str, Any]:
    """The ``extra_config`` entries that make LMCache load this tier.

    ``addresses``: ``master_addr``, ``metadata_url`` and, for same-host shared
    memory, ``client_addr`` and ``mode``; ``mc``: the ``MooncakeConfig``.
    """
    return {
        f"{_PREFIX}.module_path": __name__,
        f"{_PREFIX}.class_name": MooncakeTierConnector.__name__,
        f"{_PREFIX}.master_addr": addresses["master_addr"],
        f"{_PREFIX}.metadata_url": addresses["metadata_url"],
        f"{_PREFIX}.client_addr": addresses.get("client_addr", ""),
        f"{_PREFIX}.mode": addresses.get("mode", "tcp"),
        f"{_PREFIX}.protocol": mc.protocol,
        f"{_PREFIX}.rdma_devices": mc.rdma_devices,
        f"{_PREFIX}.local_hostname": mc.local_hostname,
        f"{_PREFIX}.local_buffer_size": int(mc.local_buffer_size),
        f"{_PREFIX}.global_segment_size": int(mc.global_segment_size),
        f"{_PREFIX}.timeout": float(mc.timeout),
        f"{_PREFIX}.put_timeout": float(mc.put_timeout),
        f"{_PREFIX}.replica_num": int(mc.replica_num),
        "use_exists_sync": True,
    }


def object_name(key: CacheEngineKey) -> str:
    """Object name for LMCache's ``key`` (:func:`keys.object_name`); ValueError for a key that is not ours."""
    return keys.object_name(key.model_name, key.chunk_hash)


class MooncakeTierConnector(RemoteConnector):
    """LMCache remote connector over a Mooncake Store (verified chunk objects)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = config.extra_config or {}

        def opt(name: str) -> Any:
            return extra[f"{_PREFIX}.{name}"]

        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.timeout = float(opt("timeout"))
        self.put_timeout = float(opt("put_timeout"))
        # A store that is down at start-up is not an error: calls are misses
        # until it answers (the client reconnects by itself).
        self.client = StoreClient.connect(
            opt("master_addr"),
            opt("metadata_url"),
            protocol=opt("protocol"),
            rdma_devices=opt("rdma_devices"),
            local_buffer_bytes=int(opt("local_buffer_size")),
            timeout_s=self.timeout,
            mode=opt("mode"),
            client_addr=opt("client_addr"),
            global_segment_bytes=int(opt("global_segment_size")),
            local_hostname=opt("local_hostname"),
            replica_num=int(opt("replica_num")),
            connect_timeout_s=max(self.timeout, 5.0),
            require=False,
        )
        STATS.register("store_client_", self.client.stats)
        # One receive buffer sized for a full chunk; partial chunks are smaller.
        self._max_object = self.full_chunk_size_bytes + _HEADER_ROOM
        self._recv = bytearray(self._max_object)
        self._recv_lock = threading.Lock()
        logger.info(
            "Mooncake tier: master %s (%s mode), timeout %.1f s, connected: %s",
            opt("master_addr"), opt("mode"), self.timeout, self.client.healthy,
        )

    # -- lookups -----------------------------------------------------------
    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` the store holds (0 on any failure)."""
        names = [object_name(k) for k in keys]
        found = self.client.batch_exists(names)
        hits = 0
        for present in found:
            if not present:
                break
            hits += 1
        STATS.add("store_lookups")
        return hits

    def support_batched_contains(self) -> bool:
        return True

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    async def exists(self, key: CacheEngineKey) -> bool:
        return self.exists_sync(key)

    # -- reads -------------------------------------------------------------
    def _get_sync(self, key: CacheEngineKey) -> MemoryObj | None:
        with self._recv_lock:  # one receive buffer, gets may come from several threads
            return self._get_locked(key)

    def _get_locked(self, key: CacheEngineKey) -> MemoryObj | None:
        name = object_name(key)
        (n,) = self.client.batch_get_into([name], [memoryview(self._recv)])
        if n < 0:
            if n == NOT_FOUND:
                STATS.add("store_misses")
            else:
                STATS.add("store_get_failures")
                logger.warning("Mooncake tier: get %s failed: %s; recomputing", name, describe(n))
            return None
        try:
            tensor = chunk_format.decode(memoryview(self._recv)[:n], key.to_string())
        except chunk_format.ChunkVerificationError as e:
            STATS.add("verify_failures")
            logger.warning("Mooncake tier: chunk %s failed verification (%s); recomputing", name, e)
            return None
        memory_obj = self.local_cpu_backend.allocate([tensor.shape], [tensor.dtype], MemoryFormat.KV_2LTD)
        if memory_obj is None:
            logger.warning("Mooncake tier: no CPU memory to stage chunk %s; treating as a miss", name)
            return None
        memory_obj.tensor.copy_(tensor)
        STATS.add("store_hits")
        STATS.add("store_bytes_read", n)
        return memory_obj

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return await self.loop.run_in_executor(None, self._get_sync, key)

    # -- writes ------------------------------------------------------------
    def _put_sync(self, keys: list[CacheEngineKey], tensors: list[torch.Tensor]) -> None:
        names = [object_name(k) for k in keys]
        blobs = [chunk_format.encode(k.to_string(), t) for k, t in zip(keys, tensors, strict=True)]
        codes = self.client.batch_put(names, blobs, timeout_s=self.put_timeout)
        for name, blob, code in zip(names, blobs, codes, strict=True):
            if code == 0:
                STATS.add("store_puts")
                STATS.add("store_bytes_written", len(blob))
            else:
                STATS.add("store_put_failures")
                logger.info("Mooncake tier: put %s not stored: %s", name, describe(code))

    # put/batched_put are plain functions returning the coroutine LMCache
    # schedules, so the write counts as pending from the moment it is submitted.
    def put(self, key: CacheEngineKey, memory_obj: MemoryObj):  # type: ignore[override]
        return self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]):  # type: ignore[override]
        WRITES.begin(k.to_string() for k in keys)
        return self._write(list(keys), list(memory_objs))

    async def _write(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        try:
            await self.loop.run_in_executor(None, self._put_sync, keys, [m.tensor for m in memory_objs])
        finally:
            # No ref_count_down here: LMCache balances the reference its
            # serializer took (checked by tests/test_engine.py).
            WRITES.end(k.to_string() for k in keys)

    async def list(self) -> list[str]:
        return []

    async def close(self) -> None:
        self.client.close()

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return False

    def support_ping(self) -> bool:
        return False
