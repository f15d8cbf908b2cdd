"""The base of our verified tiers (disk, Mooncake store), and what one engine's tiers share.

LMCache builds a remote plug-in itself, as ``cls(loop=, local_cpu_backend=,
config=)``, so a tier cannot be handed objects by its caller. What the
worker and an engine's tiers share lives in one :class:`EngineContext` per
engine, found by the engine's ``lmcache_instance_id``: its counters, its KV
events, its write tracking, the typed settings of each tier, and the headers of chunks
being written (each chunk is hashed once however many tiers it goes to).
Two engines in one process (tests, warm-up) never mix their figures.

:class:`VerifiedTier` is LMCache's ``RemoteConnector`` contract written once
for tiers whose objects are verified chunks (:mod:`lmcache_mooncake.chunks.chunk_format`):

- lookups: :meth:`batched_contains` returns the length of the prefix of keys
  the tier holds (LMCache asks synchronously, ``use_exists_sync``);
- reads: :meth:`batched_get` returns one LMCache ``MemoryObj`` per key (None
  for a miss or a chunk that failed its check), the payload copied once,
  straight into LMCache's buffer, and checked there;
- writes: :meth:`batched_put` returns the coroutine LMCache schedules, and the
  write counts as pending (:class:`WriteTracker`) from the moment it is
  submitted until it ended, written or not.

Subclasses implement ``_contains_prefix``, ``_get_sync`` and ``_put_sync``.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from lmcache_mooncake.chunks import chunk_format
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.chunks.namespaces import ManifestRecorder
from lmcache_mooncake.obs.kv_events import KVEventLog
from lmcache_mooncake.obs.stats import Stats
from lmcache_mooncake.tiers.writes import WriteTracker

logger = logging.getLogger(__name__)


class HeaderCache:
    """Chunk headers computed by the first tier that writes a chunk, reused by the others.

    Keyed by the key and the buffer it was computed from (its address and
    size), so a header is never reused for other bytes under the same key.
    Bounded: the oldest entries go first.
    """

    def __init__(self, capacity: int = 4096):
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._capacity = capacity

    def header(self, key: str, tensor: torch.Tensor, seal: chunk_format.Seal) -> bytes:
        ident = (key, tensor.data_ptr(), tensor.numel() * tensor.element_size())
        with self._lock:
            found = self._items.get(ident)
            if found is not None:
                self._items.move_to_end(ident)
                return found
        header = chunk_format.encode_header(key, tensor, seal)
        with self._lock:
            self._items[ident] = header
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)
        return header

    def forget(self, key: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self._items.pop((key, tensor.data_ptr(), tensor.numel() * tensor.element_size()), None)


class EngineContext:
    """State one engine's worker and tiers share; see the module docstring."""

    def __init__(self, instance_id: str):
        self.instance_id = instance_id
        self.stats = Stats()
        #: Stored and removed chunks, for vLLM's KV events (None: events are off).
        self.events: KVEventLog | None = None
        self.writes = WriteTracker()
        self.headers = HeaderCache()
        #: Typed settings of each tier, by plug-in name, set by ``engine.build_engine``.
        self.tier_settings: dict[str, Any] = {}
        #: Names of the verified tiers that write each chunk (the last one drops its header).
        self.writers: list[str] = []
        #: How this engine's tiers seal chunks they write and check chunks they read.
        self.seal = chunk_format.CHECKSUM_SEAL
        #: The engine's namespace, whose manifest each tier records on its first write.
        self.namespace: KeyNamespace | None = None
        #: What ``engine.build_engine`` touched of the CPU tier (a ``prefault.Prefault``; None: not done).
        self.prefault: Any = None
        #: The verified tiers LMCache built for this engine, by plug-in name (the worker
        #: loads from the disk tier straight into paged KV, see ``connector.direct``).
        self.tiers: dict[str, Any] = {}

    def set_seal(self, seal: chunk_format.Seal) -> None:
        """Use ``seal`` for every chunk written and read from now on (before any tier I/O)."""
        self.seal = seal


_CONTEXTS: dict[str, EngineContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def engine_context(instance_id: str) -> EngineContext:
    """The context of engine ``instance_id`` (made on first use)."""
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(instance_id)
        if ctx is None:
            ctx = _CONTEXTS[instance_id] = EngineContext(instance_id)
        return ctx


def release_context(instance_id: str) -> None:
    with _CONTEXTS_LOCK:
        _CONTEXTS.pop(instance_id, None)


class VerifiedTier(RemoteConnector):
    """LMCache remote connector over verified chunk objects; see the module docstring."""

    PLUGIN_NAME: ClassVar[str]
    #: The prefix of this tier's verification counters (``{prefix}_verify_failures``, ``{prefix}_foreign_kept``).
    STATS_PREFIX: ClassVar[str]
    #: How this tier's warnings name it ("disk tier"), and what becomes of a chunk another writer's
    #: format or secret sealed (the end of :meth:`_count_failed_check`'s warning).
    LOG_NAME: ClassVar[str]
    FOREIGN_KEPT_NOTE: ClassVar[str]

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.ctx = engine_context(str(config.lmcache_instance_id))
        try:
            self.settings = self.ctx.tier_settings[self.PLUGIN_NAME]
        except KeyError:
            raise RuntimeError(
                f"{type(self).__name__} is built by lmcache_mooncake.engine.build_engine, which gives it its "
                "settings; it cannot be named in an LMCache configuration on its own"
            ) from None
        self.stats = self.ctx.stats
        self._manifest = ManifestRecorder(self.PLUGIN_NAME)
        self.ctx.tiers[self.PLUGIN_NAME] = self

    @classmethod
    def plugin_extra_config(cls) -> dict[str, Any]:
        """The ``extra_config`` entries that make LMCache load this tier."""
        prefix = f"remote_storage_plugin.{cls.PLUGIN_NAME}"
        return {
            f"{prefix}.module_path": cls.__module__,
            f"{prefix}.class_name": cls.__name__,
            # LMCache asks remote tiers on its event loop unless told to ask
            # synchronously; our lookups need no loop hop.
            "use_exists_sync": True,
        }

    # -- for subclasses -----------------------------------------------------------
    @abc.abstractmethod
    def _contains_prefix(self, keys: list[CacheEngineKey]) -> int:
        """How many leading ``keys`` this tier holds: 0 to ``len(keys)``, stopping at the first miss.

        Called synchronously by LMCache's lookups (:meth:`batched_contains`, :meth:`exists_sync`),
        on the caller's thread, so it must be quick. A tier that cannot answer (store unreachable,
        file missing, chunk damaged) answers with the prefix it could confirm, 0 at worst (the
        chunks are then recomputed), rather than raising. It may keep chunks it read and checked
        in the CPU tier (:meth:`_promote`)."""

    @abc.abstractmethod
    def _get_sync(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One entry per key, in order: a ``MemoryObj`` from :meth:`_allocate` holding the chunk,
        checked (:mod:`lmcache_mooncake.chunks.chunk_format`), or None for a miss, a chunk that
        failed its check, no CPU memory, or a failed read (those are not exceptions).

        Runs on an executor thread (:meth:`batched_get`); LMCache owns the returned objects."""

    @abc.abstractmethod
    def _put_sync(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Write each chunk under its key, with its header (:meth:`_header`); best effort.

        Runs on an executor thread, after the namespace's manifest was offered to
        :meth:`_record_manifest` (:meth:`_put_recorded`). Failures are counted in ``stats``, not
        returned; an exception is logged and counted as a write error by :meth:`_write`. Must not
        take references of ``memory_objs`` beyond the call (LMCache balances its own)."""

    def _record_manifest(self, namespace: KeyNamespace) -> bool | None:
        """Record ``namespace``'s manifest in this tier (:mod:`lmcache_mooncake.chunks.namespaces`); False: not stored."""

    def _put_recorded(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        self._manifest.record(self.ctx.namespace, self._record_manifest)
        self._put_sync(keys, memory_objs)

    def _count_failed_check(self, name: object, why: Exception) -> bool:
        """Count a chunk that failed its check. One another chunk format version or chunk auth
        secret wrote (:class:`~lmcache_mooncake.chunks.chunk_format.ForeignChunkError`) is also
        counted as kept and warned about (on the tier's own module logger): True, the caller keeps
        it for its writers; False for any other failure (the caller removes the chunk and warns)."""
        self.stats.add(f"{self.STATS_PREFIX}_verify_failures")
        if not isinstance(why, chunk_format.ForeignChunkError):
            return False
        self.stats.add(f"{self.STATS_PREFIX}_foreign_kept")
        logging.getLogger(type(self).__module__).warning(
            "%s: chunk %s is not this instance's to read (%s); %s", self.LOG_NAME, name, why, self.FOREIGN_KEPT_NOTE)
        return True

    def _allocate(self, header: chunk_format.ChunkHeader, busy_loop: bool = True) -> MemoryObj | None:
        """An LMCache buffer for the chunk ``header`` describes, or None (no memory: a miss)."""
        return self._allocate_as(header.shape, header.dtype, busy_loop)

    def _allocate_as(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                     busy_loop: bool = True) -> MemoryObj | None:
        """An LMCache buffer for a chunk of ``shape`` and ``dtype``, or None (no memory: a miss)."""
        obj = self.local_cpu_backend.allocate(
            [torch.Size(shape)], [dtype], MemoryFormat.KV_2LTD, busy_loop=busy_loop
        )
        if obj is None and busy_loop:
            logger.warning("%s: no CPU memory to stage a chunk; treating it as a miss", self.PLUGIN_NAME)
        return obj

    def _header(self, key: CacheEngineKey, memory_obj: MemoryObj) -> bytes:
        """The chunk's header, hashed once for all tiers that write it."""
        return self.ctx.headers.header(key.to_string(), memory_obj.tensor, self.ctx.seal)

    def _done_with_header(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        if self.ctx.writers and self.ctx.writers[-1] == self.PLUGIN_NAME:
            self.ctx.headers.forget(key.to_string(), memory_obj.tensor)

    def _promote(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Keep a chunk this tier read and verified in the CPU tier, so a load that follows
        finds it there instead of reading and checking it again."""
        self.local_cpu_backend.batched_submit_put_task([key], [memory_obj])
        memory_obj.ref_count_down()  # the CPU tier holds its own reference (or none, if off)

    # -- RemoteConnector ---------------------------------------------------------
    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._contains_prefix(list(keys))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._contains_prefix([key]) == 1

    async def exists(self, key: CacheEngineKey) -> bool:
        return self.exists_sync(key)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:  # type: ignore[override]
        # Off the event loop: reads and checks must not hold up lookups and writes.
        return await self.loop.run_in_executor(None, self._get_sync, list(keys))

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        (obj,) = await self.batched_get([key])
        return obj

    def support_batched_put(self) -> bool:
        return True

    def put(self, key: CacheEngineKey, memory_obj: MemoryObj):  # type: ignore[override]
        return self.batched_put([key], [memory_obj])

    # put/batched_put are plain functions returning the coroutine LMCache
    # schedules, so the write counts as pending from the moment it is submitted.
    def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]):  # type: ignore[override]
        keys, memory_objs = list(keys), list(memory_objs)
        names = [k.to_string() for k in keys]
        self.ctx.writes.begin(names)
        return self._write(keys, memory_objs, names)

    async def _write(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj], names: Iterable[str]) -> None:
        try:
            await self.loop.run_in_executor(None, self._put_recorded, keys, memory_objs)
        except Exception:
            logger.exception("%s: writing %d chunks failed; they will be recomputed when needed",
                             self.PLUGIN_NAME, len(keys))
            self.stats.add(f"{self.PLUGIN_NAME}_write_errors")
        finally:
            # No ref_count_down here: LMCache balances the reference its
            # serializer took (checked by tests/engine_checks.py), in a done
            # callback of this coroutine's future. The write ends only after
            # that callback, so "no write pending" means LMCache is done with
            # the buffers too and the engine may close: the task's completion
            # is queued on the loop after this call_soon, its callbacks run
            # then, and the nested call_soon after them.
            for key, obj in zip(keys, memory_objs, strict=True):
                self._done_with_header(key, obj)
            try:
                self.loop.call_soon(self.loop.call_soon, self.ctx.writes.end, list(names))
            except RuntimeError:  # the loop is closing: nothing will run after us
                self.ctx.writes.end(names)

    async def list(self) -> list[str]:
        return []

    async def close(self) -> None:
        return None

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return False

    def support_ping(self) -> bool:
        return False
