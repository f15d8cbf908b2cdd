"""The shared remote tier: the real Mooncake Store, as an LMCache remote plug-in.

Loaded through LMCache's remote-storage plug-in mechanism (the same one as
:mod:`tiers.disk`), after the CPU and disk tiers. It talks to the store with
:class:`lmcache_mooncake.store.client.StoreClient`: one batched existence
check per lookup, one batched get per load and one batched put per store,
through the client's registered staging region, with a timeout on every call,
so a slow or dead store is a miss within ``mooncake.timeout``, never a hang.
A store that is missing when vLLM starts is a miss too: the tier attaches
when one appears (:mod:`lmcache_mooncake.tiers.attach`).
Objects are verified chunks (:mod:`chunk_format`); bytes from the store are
checked where they arrive (the staging region) and copied once, straight
into LMCache's buffer; a chunk that fails its check is a miss, counted,
logged and removed from the store (so a good copy can take its place).
Writes send the chunk's header and its payload as they lie (no encoded
copy); the header is hashed once for all tiers.

Object names come from :func:`lmcache_mooncake.keys.object_name` (full-width
namespace digest and chunk key), built from validated key fields only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj

from lmcache_mooncake import chunk_format, keys, namespaces
from lmcache_mooncake.config import MooncakeConfig
from lmcache_mooncake.store.client import ERR_UNAVAILABLE, NOT_FOUND, StoreClient, StoreEndpoint, describe
from lmcache_mooncake.tiers.attach import StoreAttachment
from lmcache_mooncake.tiers.base import VerifiedTier

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lmcm_mooncake"


@dataclass(frozen=True)
class MooncakeTierSettings:
    """The ``mooncake:`` section and how to find its store (``engine.store_endpoint``,
    which raises StoreError while ``auto`` finds no store recorded)."""

    config: MooncakeConfig
    resolve: Callable[[], StoreEndpoint]


def object_name(key: CacheEngineKey) -> str:
    """Object name for LMCache's ``key`` (:func:`keys.object_name`); ValueError for a key that is not ours."""
    return keys.object_name(key.model_name, key.chunk_hash)


class MooncakeTierConnector(VerifiedTier):
    """LMCache remote connector over a Mooncake Store (verified chunk objects)."""

    PLUGIN_NAME = PLUGIN_NAME

    def __init__(self, loop: Any, local_cpu_backend: Any, config: Any):
        super().__init__(loop, local_cpu_backend, config)
        s: MooncakeTierSettings = self.settings
        mc = s.config
        self.timeout = float(mc.timeout)
        self.put_timeout = float(mc.put_timeout)
        # A store that is down or not yet recorded at start-up is not an error:
        # calls are misses until it answers (see tiers.attach).
        self.attachment = StoreAttachment(
            mc, s.resolve, lambda endpoint: StoreClient.from_config(mc, endpoint, require=False)
        )
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

        def take(i: int, data: memoryview) -> None:
            # The object is in the client's staging region: check it there and
            # copy its payload once, into LMCache's buffer.
            try:
                header = chunk_format.parse_header(data, keys_[i].to_string(), self.ctx.seal)
            except chunk_format.ChunkVerificationError as e:
                self._bad(names[i], e)
                bad.append(names[i])
                return
            obj = self._allocate(header)
            if obj is None:
                return
            try:
                chunk_format.decode_into(data, keys_[i].to_string(), obj.tensor, header)
            except chunk_format.ChunkVerificationError as e:
                obj.ref_count_down()
                self._bad(names[i], e)
                bad.append(names[i])
                return
            out[i] = obj
            self.stats.add("store_hits")
            self.stats.add("store_bytes_read", len(data))

        client = self.attachment.client()
        if client is None:
            codes = [ERR_UNAVAILABLE] * len(names)
        else:
            codes = client.batch_get_visit(names, [self._max_object] * len(names), take)
        if bad and client is not None:
            self._remove_bad(client, bad)
        for name, code in zip(names, codes, strict=True):
            if code == NOT_FOUND:
                self.stats.add("store_misses")
            elif code < 0:
                self.stats.add("store_get_failures")
                logger.warning("Mooncake tier: get %s failed: %s; recomputing", name, describe(code))
        return out

    def _bad(self, name: str, e: Exception) -> None:
        self.stats.add("store_verify_failures")
        logger.warning("Mooncake tier: chunk %s failed verification (%s); recomputing", name, e)

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
