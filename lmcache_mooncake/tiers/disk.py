"""A disk tier that a new process can read, plugged into LMCache as a remote plug-in.

LMCache 0.5.6's own ``local_disk`` tier keeps its index in memory only, so a
fresh process sees none of the files an earlier one wrote. This tier needs no
index: a chunk's file name is derived from its key (:func:`keys.file_name`),
so "is it there?" is a ``stat``. It is loaded through LMCache's remote-storage
plug-in mechanism, so LMCache's engine treats it as the tier after its CPU tier.

Every file is a verified chunk (:mod:`lmcache_mooncake.chunks.chunk_format`); a file
that fails its check is a miss, is counted, logged and removed, unless another
format version or chunk auth secret wrote it (``ForeignChunkError``: kept for
the instances that share the folder and can read it). Reads go
straight into LMCache's buffer (``readinto``) and are checked there: one copy.
With ``verify_on_lookup`` a lookup reads and checks each chunk it has not
checked before and keeps it in the CPU tier, so the load that follows copies
it once into paged KV and reads nothing again. A chunk the CPU tier does not
hold at load time (``verify_on_lookup`` off, or no room) is read by
:meth:`DiskTierConnector.read_into` straight into paged KV
(``connector/direct.py``): one copy, checked where it landed. The chunks of one lookup (or
one load) are read and checked by a few threads at once, one per core the
process may use (:data:`READ_THREADS` at most): each read is a copy out of the
page cache, which runs at one core's memory bandwidth. Writes go to a temporary file
(the header and the payload as it lies in LMCache's buffer) and are renamed
into place, so a crash never leaves a half-written file under a valid name.
The folder is bounded by ``max_local_disk_size``: past it the least recently
written files are removed.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj

from lmcache_mooncake.chunks import chunk_format, keys, namespaces
from lmcache_mooncake.runtime import affinity
from lmcache_mooncake.tiers.base import VerifiedTier

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lmcm_disk"
SUFFIX = keys.FILE_SUFFIX
#: Most threads that read and check the chunks of one lookup or load at once.
READ_THREADS = 4


@dataclass(frozen=True)
class DiskTierSettings:
    path: Path
    max_bytes: int
    verify_on_lookup: bool = True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _preadv_all(fd: int, targets: list[memoryview], offset: int) -> int:
    """``os.preadv`` of ``targets`` from ``offset``, resumed after short reads; bytes read."""
    done, i, total = 0, 0, sum(len(t) for t in targets)
    todo = list(targets)
    while i < len(todo):
        n = os.preadv(fd, todo[i : i + _IOV_MAX], offset + done)
        if n <= 0:
            break
        done += n
        while i < len(todo) and n >= len(todo[i]):
            n -= len(todo[i])
            i += 1
        if n:
            todo[i] = todo[i][n:]
    return min(done, total)


#: Most buffers one ``preadv`` takes (Linux's IOV_MAX).
_IOV_MAX = 1024
#: Bytes read (then hashed) at a time by :meth:`DiskTierConnector.read_into`: small enough to
#: stay in a core's cache between the read and the hash.
_PIECE_BYTES = 512 << 10


def _pieces(views: list[memoryview], size: int) -> list[list[memoryview]]:
    """``views`` cut into consecutive groups of at most ``size`` bytes (views split where needed)."""
    out: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = size
    for v in views:
        while len(v):
            take = v[:room]
            cur.append(take)
            v = v[len(take):]
            room -= len(take)
            if room == 0:
                out.append(cur)
                cur, room = [], size
    if cur:
        out.append(cur)
    return out


def chunk_file_name(key: CacheEngineKey) -> str:
    """File name for LMCache's ``key`` (:func:`keys.file_name`); ValueError for a key that is not ours."""
    return keys.file_name(key.model_name, key.chunk_hash)


class DiskTierConnector(VerifiedTier):
    """LMCache remote connector over a local folder of verified chunk files."""

    PLUGIN_NAME = PLUGIN_NAME
    STATS_PREFIX = "disk"
    LOG_NAME = "disk tier"
    FOREIGN_KEPT_NOTE = "kept, will recompute"

    def __init__(self, loop: Any, local_cpu_backend: Any, config: Any):
        super().__init__(loop, local_cpu_backend, config)
        s: DiskTierSettings = self.settings
        self.root = Path(s.path)
        self.max_bytes = int(s.max_bytes)
        self.verify_on_lookup = bool(s.verify_on_lookup)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Paths whose bytes were checked, with the (size, mtime) they had then.
        self._verified: dict[str, tuple[int, int]] = {}
        # Oldest-written first; sizes, for the disk budget.
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._total = 0
        # Readers of one lookup's or load's chunks (None: one core, read in the caller's thread).
        n = min(READ_THREADS, len(affinity.process_cpus()))
        self._readers = (ThreadPoolExecutor(n, thread_name_prefix="lmcm-disk-read",
                                            initializer=affinity.widen_current_thread,
                                            initargs=("lmcm-disk-read",)) if n > 1 else None)
        self._scan()
        logger.info(
            "disk tier at %s: %d chunks, %.1f MiB of %.1f MiB",
            self.root, len(self._sizes), self._total / 2**20, self.max_bytes / 2**20,
        )

    # -- bookkeeping -------------------------------------------------------
    def _scan(self) -> None:
        # A writer killed mid-write leaves its temporary file (never read, but
        # it takes space): remove those of processes that are gone.
        for tmp in self.root.glob("*/.*.tmp"):
            parts = tmp.name.split(".")
            pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else 0
            if pid and not _pid_alive(pid):
                tmp.unlink(missing_ok=True)
                logger.info("disk tier: removed %s, left by a writer that is gone", tmp)
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

    def _discard_bad(self, path: Path, why: chunk_format.ChunkVerificationError) -> None:
        """Count a chunk that failed its check and remove it, unless another format version or
        chunk auth secret wrote it (a folder may be shared): that one stays for its writers."""
        if self._count_failed_check(path, why):
            return
        logger.warning("disk tier: chunk %s failed verification (%s); removed, will recompute", path, why)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self._forget(str(path))

    def _read_verified(self, path: Path, key: CacheEngineKey, busy_loop: bool = True) -> MemoryObj | None:
        """Read the chunk at ``path`` straight into a new LMCache buffer and check it there."""
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        with f:
            st = os.fstat(f.fileno())
            try:
                head = f.read(8)
                (hlen,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
                header = chunk_format.parse_header(head + f.read(min(hlen, chunk_format.HEADER_ROOM)),
                                                   key.to_string(), self.ctx.seal)
                if header.total_nbytes != st.st_size:
                    raise chunk_format.ChunkVerificationError(
                        f"file is {st.st_size} bytes, its header says {header.total_nbytes}")
            except chunk_format.ChunkVerificationError as e:
                self._discard_bad(path, e)
                return None
            obj = self._allocate(header, busy_loop=busy_loop)
            if obj is None:
                return None
            payload = chunk_format.tensor_bytes(obj.tensor)
            n = f.readinto(payload)
            try:
                if n != header.payload_nbytes:
                    raise chunk_format.ChunkVerificationError(f"read {n} of {header.payload_nbytes} payload bytes")
                chunk_format.verify(header, payload)
            except chunk_format.ChunkVerificationError as e:
                obj.ref_count_down()
                self._discard_bad(path, e)
                return None
        with self._lock:
            self._verified[str(path)] = (st.st_size, st.st_mtime_ns)
        self.stats.add("disk_bytes_read", st.st_size)
        return obj

    def has(self, key: CacheEngineKey) -> bool:
        """Whether a file is there for ``key`` (not read or checked)."""
        try:
            return self._path(key).is_file()
        except ValueError:
            return False

    def read_into(self, key: CacheEngineKey, shape: tuple[int, ...], dtype: torch.dtype,
                  targets: list[memoryview]) -> bool:
        """Read the chunk ``key`` (of ``dtype`` and ``shape``) into ``targets`` (byte views covering
        its payload in order, see ``block_chunks.read_targets``) and check it there: one copy.

        False for a missing file, and for one that fails its check (counted, logged and removed);
        then what ``targets`` hold is undefined and must not be used."""
        try:
            path = self._path(key)
            f = open(path, "rb")
        except (FileNotFoundError, ValueError):
            return False
        with f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            try:
                head = os.pread(fd, 4096, 0)
                (hlen,) = struct.unpack("<Q", head[:8]) if len(head) >= 8 else (0,)
                if 8 + hlen > len(head):
                    head += os.pread(fd, min(8 + hlen, chunk_format.HEADER_ROOM) - len(head), len(head))
                header = chunk_format.parse_header(head, key.to_string(), self.ctx.seal)
                if header.shape != tuple(shape) or header.dtype != dtype:
                    raise chunk_format.ChunkVerificationError(
                        f"chunk is {header.dtype} {list(header.shape)}, expected {dtype} {list(shape)}")
                if header.total_nbytes != size:
                    raise chunk_format.ChunkVerificationError(f"file is {size} bytes, its header says {header.total_nbytes}")
                if sum(len(t) for t in targets) != header.payload_nbytes:
                    raise ValueError(f"targets hold {sum(len(t) for t in targets)} bytes, the payload is "
                                     f"{header.payload_nbytes}")
                # Read in pieces and hash each right after it lands, while it is still in
                # the core's cache: the check then costs no pass over memory of its own.
                hasher = chunk_format.payload_hasher(header)
                offset = header.payload_offset
                for piece in _pieces(targets, _PIECE_BYTES):
                    got = _preadv_all(fd, piece, offset)
                    if got != sum(len(t) for t in piece):
                        raise chunk_format.ChunkVerificationError(
                            f"read {offset - header.payload_offset + got} of {header.payload_nbytes} payload bytes")
                    for part in piece:
                        hasher.update(part)
                    offset += got
                chunk_format.check_digest(header, hasher.hexdigest())
            except chunk_format.ChunkVerificationError as e:
                self._discard_bad(path, e)
                return False
        self.stats.add("disk_hits")
        self.stats.add("disk_bytes_read", size)
        return True

    def map_reads(self, fn: Any, items: list) -> list:
        """``[fn(x) for x in items]``, on this tier's reader threads when there are several."""
        return self._map(fn, items)

    def _verify_unkept(self, path: Path, key: CacheEngineKey) -> bool:
        try:
            data = path.read_bytes()
            st = path.stat()
        except FileNotFoundError:
            return False
        try:
            header = chunk_format.parse_header(data, key.to_string(), self.ctx.seal)
            chunk_format.verify(header, memoryview(data)[header.payload_offset :])
        except chunk_format.ChunkVerificationError as e:
            self._discard_bad(path, e)
            return False
        with self._lock:
            self._verified[str(path)] = (st.st_size, st.st_mtime_ns)
        return True

    # -- VerifiedTier --------------------------------------------------------
    def _contains_prefix(self, keys_: list[CacheEngineKey]) -> int:
        """How many leading keys have a file here (checked, with ``verify_on_lookup``)."""
        self.stats.add("disk_lookups")
        found: list[tuple[CacheEngineKey, Path]] = []
        unchecked: list[int] = []
        for key in keys_:
            try:
                path = self._path(key)
                st = path.stat()
            except (FileNotFoundError, ValueError):
                break
            if self.verify_on_lookup:
                with self._lock:
                    known = self._verified.get(str(path))
                if known != (st.st_size, st.st_mtime_ns):
                    unchecked.append(len(found))
            found.append((key, path))
        ok = self._map(lambda i: self._check(*found[i]), unchecked)
        for i, good in zip(unchecked, ok, strict=True):
            if not good:
                return i
        return len(found)

    def _map(self, fn: Any, items: list) -> list:
        """``[fn(x) for x in items]``, on the reader threads when there are several items."""
        if self._readers is None or len(items) < 2:
            return [fn(x) for x in items]
        return list(self._readers.map(fn, items))

    def _check(self, key: CacheEngineKey, path: Path) -> bool:
        """Read and check the chunk at ``path`` (a lookup): kept in the CPU tier when there is room."""
        # Checked once, and kept in the CPU tier for the load that follows.
        obj = self._read_verified(path, key, busy_loop=False)
        if obj is None:
            # No CPU memory to keep it (or it was damaged and is gone): check it
            # without keeping it, so a full CPU tier does not turn hits into misses.
            return self._verify_unkept(path, key)
        # A disk hit: this chunk is served from what was read here.
        self.stats.add("disk_hits")
        self.stats.add("disk_verified_on_lookup")
        self._promote(key, obj)
        return True

    def _get_sync(self, keys_: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return self._map(self._get_one, keys_)

    def _get_one(self, key: CacheEngineKey) -> MemoryObj | None:
        try:
            path = self._path(key)
        except ValueError:
            return None
        obj = self._read_verified(path, key)
        if obj is not None:
            self.stats.add("disk_hits")
        return obj

    def _put_sync(self, keys_: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        for key, obj in zip(keys_, memory_objs, strict=True):
            self._put_one(key, obj)

    def _record_manifest(self, namespace: keys.KeyNamespace) -> None:
        namespaces.write_disk_manifest(self.root, namespace)

    def _put_one(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        path = self._path(key)
        tensor = memory_obj.tensor
        logger.debug("disk tier: writing %s (%d tokens)", path.name, tensor.shape[2])
        header = self._header(key, memory_obj)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        size = len(header) + tensor.numel() * tensor.element_size()
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(chunk_format.tensor_bytes(tensor))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            old = self._sizes.pop(str(path), 0)
            self._sizes[str(path)] = size
            self._total += size - old
            self._verified[str(path)] = (size, path.stat().st_mtime_ns)
        self.stats.add("disk_writes")
        self.stats.add("disk_bytes_written", size)
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
                self.stats.add("disk_evictions")
            except FileNotFoundError:
                continue
            if self.ctx.events is not None:
                self.ctx.events.removed([bytes.fromhex(Path(victim).name.removesuffix(SUFFIX))], "disk")

    async def list(self) -> list[str]:
        return [Path(p).name for p in self._sizes]

    async def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        logger.info("disk tier closed (%d chunks on disk)", len(self._sizes))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            path = self._path(key)
            path.unlink()
        except (FileNotFoundError, ValueError):
            return False
        self._forget(str(path))
        return True
