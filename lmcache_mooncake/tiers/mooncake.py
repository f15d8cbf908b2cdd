"""The shared remote tier: the real Mooncake Store, as an LMCache remote plug-in.

Loaded through LMCache's remote-storage plug-in mechanism (the same one as
:mod:`tiers.disk`), after the CPU and disk tiers. It talks to the store with
:class:`lmcache_mooncake.store.client.StoreClient`: one batched existence
check per lookup, one batched get per load (in ``tcp`` mode one size query
before it) and one batched put per store, with a timeout on every call,
so a slow or dead store is a miss within ``mooncake.timeout``, never a hang.
A store that is missing when vLLM starts is a miss too: the tier attaches
when one appears (:mod:`lmcache_mooncake.tiers.attach`).
Objects are verified chunks (:mod:`chunk_format`), checked where they arrive.
In ``tcp`` mode a full chunk arrives straight in an LMCache buffer: LMCache's
CPU pool is registered with the client, each object's size is asked first,
and its header lands in the client's staging region, its payload in the
buffer (:mod:`lmcache_mooncake.store.direct`); the buffers of a get that timed
out are never handed back (:mod:`lmcache_mooncake.tiers.quarantine`). Other
objects (a short tail chunk, ``shm`` mode, where Mooncake writes only into the
storage process's shared memory) arrive in the staging region and are copied
once into LMCache's buffer. A chunk that fails its check is a miss, counted
and logged. It is removed from the store (so a good copy can take its place)
only when it is damaged under this instance's own format and seal: a chunk
written in another ``FORMAT_VERSION`` or sealed with another chunk auth
secret (:class:`~lmcache_mooncake.chunks.chunk_format.ForeignChunkError`) may
be another instance's good chunk, and stays.
Writes send the chunk's header and its payload as they lie (no encoded
copy); the header is hashed once for all tiers.

Object names come from :func:`lmcache_mooncake.chunks.keys.object_name` (full-width
namespace digest and chunk key), built from validated key fields only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj

from lmcache_mooncake.chunks import chunk_format, keys, namespaces
from lmcache_mooncake.config import MooncakeConfig
from lmcache_mooncake.store.client import (
    ERR_BAD_BUFFER,
    ERR_TIMEOUT,
    ERR_UNAVAILABLE,
    NOT_FOUND,
    OK,
    StoreClient,
    StoreEndpoint,
    describe,
)
from lmcache_mooncake.tiers.attach import StoreAttachment
from lmcache_mooncake.tiers.base import VerifiedTier
from lmcache_mooncake.tiers.quarantine import Quarantine

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lmcm_mooncake"


@dataclass(frozen=True)
class MooncakeTierSettings:
    """The ``mooncake:`` section and how to find its store (``engine.store_endpoint``,
    which raises StoreError while ``auto`` finds no store recorded)."""

    config: MooncakeConfig
    resolve: Callable[[], StoreEndpoint]


#: Share of LMCache's CPU pool that buffers of timed-out direct gets may take before
#: the tier goes back to staging (tiers.quarantine).
QUARANTINE_LIMIT = 0.25


def lmcache_pool(local_cpu_backend: Any) -> tuple[int, int] | None:
    """Address and size of the CPU memory LMCache's allocator hands out chunk buffers from
    (its ``MixedMemoryAllocator``'s one contiguous buffer), or None if it has no such buffer."""
    buf = getattr(getattr(local_cpu_backend, "memory_allocator", None), "buffer", None)
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous() or not buf.numel():
        return None
    return buf.data_ptr(), buf.numel() * buf.element_size()


def object_name(key: CacheEngineKey) -> str:
    """Object name for LMCache's ``key`` (:func:`keys.object_name`); ValueError for a key that is not ours."""
    return keys.object_name(key.model_name, key.chunk_hash)


class MooncakeTierConnector(VerifiedTier):
    """LMCache remote connector over a Mooncake Store (verified chunk objects)."""

    PLUGIN_NAME = PLUGIN_NAME
    STATS_PREFIX = "store"
    LOG_NAME = "Mooncake tier"
    FOREIGN_KEPT_NOTE = "recomputing, the chunk stays in the store for the instances that wrote it"

    def __init__(self, loop: Any, local_cpu_backend: Any, config: Any):
        super().__init__(loop, local_cpu_backend, config)
        s: MooncakeTierSettings = self.settings
        mc = s.config
        self.timeout = float(mc.timeout)
        self.put_timeout = float(mc.put_timeout)
        # Full chunks are read straight into LMCache's CPU pool where Mooncake can write
        # it (tcp mode): registered once with every client, and bounded losses when a
        # get times out (see tiers.quarantine).
        self._full_shape = tuple(self.meta_shapes[0])
        self._full_dtype = self.meta_dtypes[0]
        self._pool = lmcache_pool(local_cpu_backend) if len(self.meta_shapes) == 1 else None
        self._quarantine = Quarantine(self.stats, int(QUARANTINE_LIMIT * (self._pool[1] if self._pool else 0)))
        # A store that is down or not yet recorded at start-up is not an error:
        # calls are misses until it answers (see tiers.attach).
        self.attachment = StoreAttachment(mc, s.resolve, self._new_client)
        self.stats.register("store_client_", self.attachment.stats)
        self.stats.register("cpu_tier_", self._cpu_tier_counts)
        # The largest object: a full chunk's payload and its header.
        self._max_object = self.full_chunk_size_bytes + chunk_format.HEADER_ROOM
        endpoint, client = self.attachment.endpoint, self.attachment.client()
        logger.info(
            "Mooncake tier: master %s (%s mode), timeout %.1f s, connected: %s",
            endpoint.master_addr if endpoint else "not yet recorded", endpoint.mode if endpoint else "-",
            self.timeout, client is not None and client.healthy,
        )

    def _new_client(self, endpoint: StoreEndpoint) -> StoreClient:
        client = StoreClient.from_config(self.settings.config, endpoint, require=False)
        if self._pool is not None:
            client.register_destination(*self._pool)
        return client

    def _cpu_tier_counts(self) -> dict[str, int]:
        """Chunks in LMCache's CPU tier and how many are pinned (a lookup pins what it
        found until the load that follows; none may stay pinned once requests end)."""
        backend = self.local_cpu_backend
        hot = getattr(backend, "hot_cache", None)
        if hot is None:
            return {}
        with backend.cpu_lock:
            objs = list(hot.values())
        return {"chunks": len(objs), "pinned_chunks": sum(1 for m in objs if m.is_pinned)}

    # -- lookups -----------------------------------------------------------
    def _contains_prefix(self, keys_: list[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` the store holds (0 on any failure)."""
        self.stats.add("store_lookups")
        client = self.attachment.client()
        if client is None:
            return 0
        found = client.batch_exists([object_name(k) for k in keys_])
        hits = 0
        for present in found:
            if not present:
                break
            hits += 1
        return hits

    # -- reads -------------------------------------------------------------
    def _get_sync(self, keys_: list[CacheEngineKey]) -> list[MemoryObj | None]:
        names = [object_name(k) for k in keys_]
        out: list[MemoryObj | None] = [None] * len(keys_)
        bad: list[str] = []
        client = self.attachment.client()
        if client is None:
            codes = [ERR_UNAVAILABLE] * len(names)
        else:
            codes = [OK] * len(names)
            staged = list(range(len(names)))
            if self._direct_possible(client):
                staged = self._get_direct(client, keys_, names, staged, out, codes, bad)
            if staged:
                for i, code in zip(staged, self._get_staged(client, keys_, names, staged, out, bad), strict=True):
                    codes[i] = code
        if bad and client is not None:
            self._remove_bad(client, bad)
        self._count_codes(names, codes)
        return out

    def _count_codes(self, names: list[str], codes: list[int]) -> None:
        for name, code in zip(names, codes, strict=True):
            if code == NOT_FOUND:
                self.stats.add("store_misses")
            elif code < 0:
                self.stats.add("store_get_failures")
                logger.warning("Mooncake tier: get %s failed: %s; recomputing", name, describe(code))

    def _direct_possible(self, client: StoreClient) -> bool:
        return self._pool is not None and client.direct_ready and not self._quarantine.full

    def _get_direct(self, client: StoreClient, keys_: list[CacheEngineKey], names: list[str], todo: list[int],
                    out: list[MemoryObj | None], codes: list[int], bad: list[str]) -> list[int]:
        """Get full chunks straight into LMCache buffers (one copy fewer than staging), checked there.

        Sets ``out``/``codes`` for the keys it read or that failed; returns the indices left
        for the staged path (objects of another size than a full chunk: a short tail chunk,
        or a chunk written otherwise)."""
        sizes = client.batch_object_sizes([names[i] for i in todo])
        direct: list[tuple[int, int, MemoryObj]] = []  # (index, header bytes, buffer)
        rest: list[int] = []
        for i, size in zip(todo, sizes, strict=True):
            head = chunk_format.header_nbytes(keys_[i].to_string(), self._full_dtype, self._full_shape, self.ctx.seal)
            if size < 0:
                codes[i] = size
            elif size != head + self.full_chunk_size_bytes:
                rest.append(i)
            else:
                obj = self._allocate_as(self._full_shape, self._full_dtype)
                if obj is None:  # no memory: a miss, said by _allocate
                    continue
                direct.append((i, head, obj))
        if not direct:
            return rest
        done: set[int] = set()

        def check(j: int, head: memoryview) -> None:
            # The payload is in LMCache's buffer, the header in the client's staging region.
            i, _, obj = direct[j]
            done.add(j)
            try:
                header = chunk_format.parse_header(head, keys_[i].to_string(), self.ctx.seal)
                if header.payload_offset != len(head):
                    raise chunk_format.ChunkVerificationError(
                        f"header is {header.payload_offset} bytes, a full chunk's is {len(head)}")
                chunk_format.check_destination(header, obj.tensor)
                chunk_format.verify(header, chunk_format.tensor_bytes(obj.tensor))
            except chunk_format.ChunkVerificationError as e:
                self._reject(obj, names[i], e, bad)
                return
            out[i] = obj
            self._count_read("store_direct_reads", len(head) + self.full_chunk_size_bytes)

        got = client.batch_get_split(
            [names[i] for i, _, _ in direct], [h for _, h, _ in direct],
            [(obj.tensor.data_ptr(), self.full_chunk_size_bytes) for _, _, obj in direct], check,
        )
        abandoned: list[MemoryObj] = []
        abandoned_names: list[str] = []
        for j, ((i, _, obj), code) in enumerate(zip(direct, got, strict=True)):
            if j in done:
                continue
            if code == ERR_TIMEOUT:  # Mooncake may still write it: never handed back
                abandoned.append(obj)
                abandoned_names.append(names[i])
            else:
                obj.ref_count_down()
            if code == ERR_BAD_BUFFER:  # outside the registered pool (not LMCache's main buffer)
                rest.append(i)
            else:
                codes[i] = code
        self._quarantine.hold(abandoned, abandoned_names)
        return rest

    def _get_staged(self, client: StoreClient, keys_: list[CacheEngineKey], names: list[str], todo: list[int],
                    out: list[MemoryObj | None], bad: list[str]) -> list[int]:
        """Get ``todo`` through the client's staging region: checked there, copied once into LMCache's buffer."""

        def take(j: int, data: memoryview) -> None:
            i = todo[j]
            obj = None
            try:
                header = chunk_format.parse_header(data, keys_[i].to_string(), self.ctx.seal)
                obj = self._allocate(header)
                if obj is None:
                    return
                chunk_format.decode_into(data, keys_[i].to_string(), obj.tensor, header)
            except chunk_format.ChunkVerificationError as e:
                self._reject(obj, names[i], e, bad)
                return
            out[i] = obj
            self._count_read("store_staged_reads", len(data))

        return client.batch_get_visit([names[i] for i in todo], [self._max_object] * len(todo), take)

    # -- for loads straight into paged KV (connector/direct.py) ---------------
    def gets_through_staging(self) -> bool:
        """Whether this tier's gets land in the client's staging region (``shm`` mode, or
        direct gets unavailable), so a load may copy them straight into paged KV from there."""
        client = self.attachment.client()
        return client is not None and not self._direct_possible(client)

    def get_visit(self, names: list[str], visit: Callable[[int, memoryview, list[str]], None]) -> None:
        """Get ``names`` in one batched call through the staging region, calling ``visit(index,
        bytes, bad)`` for each one read (see ``StoreClient.batch_get_visit``; ``bad`` goes to
        :meth:`check_staged`). Misses and failures are counted and logged as for LMCache's
        gets; chunks that failed their check are removed from the store."""
        bad: list[str] = []
        client = self.attachment.client()
        codes = ([ERR_UNAVAILABLE] * len(names) if client is None
                 else client.batch_get_visit(names, [self._max_object] * len(names),
                                             lambda j, data: visit(j, data, bad)))
        if bad and client is not None:
            self._remove_bad(client, bad)
        self._count_codes(names, codes)

    def check_staged(self, key: CacheEngineKey, data: memoryview, shape: tuple[int, ...],
                     dtype: torch.dtype, bad: list[str]) -> chunk_format.ChunkHeader | None:
        """Check the chunk ``key`` (expected of ``dtype`` and ``shape``) in ``data`` where
        :meth:`get_visit` read it; its header, or None (counted, logged, its name added to
        ``bad`` for removal)."""
        name = object_name(key)
        try:
            header = chunk_format.parse_header(data, key.to_string(), self.ctx.seal)
            if header.shape != tuple(shape) or header.dtype != dtype:
                raise chunk_format.ChunkVerificationError(
                    f"chunk is {header.dtype} {list(header.shape)}, expected {dtype} {list(shape)}")
            chunk_format.verify(header, data[header.payload_offset : header.total_nbytes])
        except chunk_format.ChunkVerificationError as e:
            self._reject(None, name, e, bad)
            return None
        self._count_read("store_staged_reads", header.total_nbytes)
        return header

    def _count_read(self, path: str, nbytes: int) -> None:
        self.stats.add("store_hits")
        self.stats.add(path)
        self.stats.add("store_bytes_read", nbytes)

    def _reject(self, obj: MemoryObj | None, name: str, e: Exception, bad: list[str]) -> None:
        """A chunk that failed its check: its buffer back to LMCache, counted, and to be
        removed unless it is another writer's (another format or chunk auth secret)."""
        if obj is not None:
            obj.ref_count_down()
        if self._count_failed_check(name, e):
            return
        logger.warning("Mooncake tier: chunk %s failed verification (%s); recomputing", name, e)
        bad.append(name)

    def _remove_bad(self, client: StoreClient, names: list[str]) -> None:
        """Remove objects that failed their check: the store keeps the first value put under
        a key, so a damaged object left there would block every good copy written later."""
        for name, code in zip(names, client.batch_remove(names, force=True), strict=True):
            if code == 0:
                self.stats.add("store_bad_removed")
            else:
                logger.warning("Mooncake tier: could not remove damaged chunk %s (%s)", name, describe(code))

    # -- writes ------------------------------------------------------------
    def _record_manifest(self, namespace: keys.KeyNamespace) -> bool:
        client = self.attachment.client()
        if client is None:  # no store attached yet: recorded with a later write
            raise namespaces.ManifestNotReady
        return namespaces.write_store_manifest(client, namespace, self.put_timeout)

    def _put_sync(self, keys_: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        names = [object_name(k) for k in keys_]
        parts = [(self._header(k, m), m.tensor) for k, m in zip(keys_, memory_objs, strict=True)]
        client = self.attachment.client()
        if client is None:  # no store yet: said once, by the attachment
            self.stats.add("store_put_failures", len(names))
            return
        codes = client.batch_put(names, parts, timeout_s=self.put_timeout)
        for name, (header, tensor), code in zip(names, parts, codes, strict=True):
            if code == 0:
                self.stats.add("store_puts")
                self.stats.add("store_bytes_written", len(header) + tensor.numel() * tensor.element_size())
            else:
                self.stats.add("store_put_failures")
                logger.info("Mooncake tier: put %s not stored: %s", name, describe(code))

    async def close(self) -> None:
        self.attachment.close()
