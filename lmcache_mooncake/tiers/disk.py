"""A disk tier that a new process can read, plugged into LMCache as a remote plug-in.

LMCache 0.5.6's own ``local_disk`` tier keeps its index in memory only, so a
fresh process sees none of the files an earlier one wrote. This tier needs no
index: a chunk's file name is derived from its key, so "is it there?" is a
``stat``. It is loaded through LMCache's remote-storage plug-in mechanism
(``remote_storage_plugins`` + ``remote_storage_plugin.<name>.module_path`` /
``.class_name``), so LMCache's engine treats it as the tier after its CPU tier.

Every file is a verified chunk (:mod:`lmcache_mooncake.chunk_format`); a file
that fails its check is a miss, is counted, logged and removed. Writes go to a
temporary file and are renamed into place, so a crash never leaves a
half-written file under a valid name. The folder is bounded by
``max_local_disk_size``: past it the least recently written files are removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from lmcache_mooncake import chunk_format, keys
from lmcache_mooncake.stats import STATS
from lmcache_mooncake.tiers import WRITES

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lmcm_disk"
SUFFIX = keys.FILE_SUFFIX


def plugin_extra_config(path: Path, max_bytes: int, verify_on_lookup: bool) -> dict[str, Any]:
    """The ``extra_config`` entries that make LMCache load this tier."""
    prefix = f"remote_storage_plugin.{PLUGIN_NAME}"
    return {
        f"{prefix}.module_path": __name__,
        f"{prefix}.class_name": DiskTierConnector.__name__,
        f"{prefix}.path": str(path),
        f"{prefix}.max_bytes": int(max_bytes),
        f"{prefix}.verify_on_lookup": bool(verify_on_lookup),
        # LMCache asks remote tiers on its event loop unless told to ask
        # synchronously; a stat needs no loop hop.
        "use_exists_sync": True,
    }


def chunk_file_name(key: CacheEngineKey) -> str:
    """File name for LMCache's ``key`` (:func:`keys.file_name`); ValueError for a key that is not ours."""
    return keys.file_name(key.model_name, key.chunk_hash)


class DiskTierConnector(RemoteConnector):
    """LMCache remote connector over a local folder of verified chunk files."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = config.extra_config or {}
        prefix = f"remote_storage_plugin.{PLUGIN_NAME}"
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.root = Path(extra[f"{prefix}.path"])
        self.max_bytes = int(extra[f"{prefix}.max_bytes"])
        self.verify_on_lookup = bool(extra.get(f"{prefix}.verify_on_lookup", True))
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Paths whose bytes were checked, with the (size, mtime) they had then.
        self._verified: dict[str, tuple[int, int]] = {}
        # Oldest-written first; sizes, for the disk budget.
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._total = 0
        self._scan()
        logger.info(
            "disk tier at %s: %d chunks, %.1f MiB of %.1f MiB",
            self.root, len(self._sizes), self._total / 2**20, self.max_bytes / 2**20,
        )

    # -- bookkeeping -------------------------------------------------------
    def _scan(self) -> None:
        entries = []
        for p in self.root.glob(f"*/*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, str(p), st.st_size))
        for _, p, size in sorted(entries):
            self._sizes[p] = size
            self._total += size

    def _path(self, key: CacheEngineKey) -> Path:
        return self.root / chunk_file_name(key)

    def _forget(self, path: str) -> None:
        with self._lock:
            size = self._sizes.pop(path, None)
            if size is not None:
                self._total -= size
            self._verified.pop(path, None)

    def _discard_bad(self, path: Path, why: str) -> None:
        STATS.add("verify_failures")
        logger.warning("disk tier: chunk %s failed verification (%s); removed, will recompute", path, why)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self._forget(str(path))

    def _read_verified(self, path: Path, key: CacheEngineKey) -> torch.Tensor | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            tensor = chunk_format.decode(data, key.to_string())
        except chunk_format.ChunkVerificationError as e:
            self._discard_bad(path, str(e))
            return None
        st = path.stat()
        with self._lock:
            self._verified[str(path)] = (st.st_size, st.st_mtime_ns)
        return tensor

    # -- RemoteConnector ---------------------------------------------------
    def exists_sync(self, key: CacheEngineKey) -> bool:
        try:
            path = self._path(key)
            st = path.stat()
        except (FileNotFoundError, ValueError):
            return False
        if not self.verify_on_lookup:
            return True
        with self._lock:
            known = self._verified.get(str(path))
        if known == (st.st_size, st.st_mtime_ns):
            return True
        return self._read_verified(path, key) is not None

    async def exists(self, key: CacheEngineKey) -> bool:
        return self.exists_sync(key)

    def _get_sync(self, key: CacheEngineKey) -> MemoryObj | None:
        try:
            path = self._path(key)
        except ValueError:
            return None
        tensor = self._read_verified(path, key)
        if tensor is None:
            return None
        memory_obj = self.local_cpu_backend.allocate(
            [tensor.shape], [tensor.dtype], MemoryFormat.KV_2LTD
        )
        if memory_obj is None:
            logger.warning("disk tier: no CPU memory to stage chunk %s; treating as a miss", path.name)
            return None
        memory_obj.tensor.copy_(tensor)
        STATS.add("disk_hits")
        return memory_obj

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return self._get_sync(key)

    def _put_sync(self, key: CacheEngineKey, tensor: torch.Tensor) -> None:
        path = self._path(key)
        logger.debug("disk tier: writing %s (%d tokens)", path.name, tensor.shape[2])
        data = chunk_format.encode(key.to_string(), tensor)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            old = self._sizes.pop(str(path), 0)
            self._sizes[str(path)] = len(data)
            self._total += len(data) - old
            self._verified[str(path)] = (len(data), path.stat().st_mtime_ns)
        STATS.add("disk_writes")
        STATS.add("disk_bytes_written", len(data))
        self._evict()

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self._total <= self.max_bytes or len(self._sizes) <= 1:
                    return
                victim, size = self._sizes.popitem(last=False)
                self._total -= size
                self._verified.pop(victim, None)
            try:
                os.unlink(victim)
                STATS.add("disk_evictions")
            except FileNotFoundError:
                pass

    def put(self, key: CacheEngineKey, memory_obj: MemoryObj):  # type: ignore[override]
        # A plain function returning the coroutine LMCache schedules, so the
        # write counts as pending from the moment it is submitted.
        WRITES.begin([key.to_string()])
        return self._write(key, memory_obj)

    async def _write(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        try:
            # Off the event loop, so lookups are not held up by I/O.
            await self.loop.run_in_executor(None, self._put_sync, key, memory_obj.tensor)
        finally:
            WRITES.end([key.to_string()])

    async def list(self) -> list[str]:
        return [Path(p).name for p in self._sizes]

    async def close(self) -> None:
        logger.info("disk tier closed (%d chunks on disk)", len(self._sizes))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            path = self._path(key)
            path.unlink()
        except (FileNotFoundError, ValueError):
            return False
        self._forget(str(path))
        return True

    def support_ping(self) -> bool:
        return False
