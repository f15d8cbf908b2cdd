"""Stored and removed chunks as vLLM KV events, so a prefix-aware router sees what an instance holds.

vLLM publishes them with its own cache events (``--kv-events-config``, e.g. a
ZMQ publisher): the worker collects events (:class:`KVEventLog`, one per
engine, fed by the worker's saves and the tiers' evictions), hands them to
vLLM after each step (``get_kv_connector_kv_cache_events``), the scheduler
side gathers every worker's (``update_connector_output``) and vLLM takes
them (``take_events``) into the step's ``KVEventBatch``.

Event contents (docs/metrics.md):

- ``BlockStored``: one per saved request: ``block_hashes`` = the 32-byte
  digests of the chunks written (our chunk keys: the object is
  ``lmcm/<namespace>/<digest hex>``), ``parent_block_hash`` = the digest of
  the chunk before the first one (None at the prompt start), ``token_ids`` =
  the tokens of those chunks, ``block_size`` = our chunk size (the last chunk
  may be shorter), ``medium`` = ``"lmcm"`` (our tiers: CPU at once, disk and
  store behind it), ``lora_name``.
- ``BlockRemoved``: chunks a tier evicted: ``block_hashes`` as above,
  ``medium`` = ``"lmcm_disk"``.
"""

from __future__ import annotations

import threading

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

#: ``medium`` of stored chunks; evictions add the tier (``lmcm_disk``).
MEDIUM = "lmcm"
#: At most this many events wait for vLLM; older ones are dropped past it.
MAX_PENDING = 10000


class KVEventLog:
    """Events of one engine since vLLM last took them (thread-safe: tiers write on their own threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []

    def _append(self, event: KVCacheEvent) -> None:
        with self._lock:
            self._events.append(event)
            if len(self._events) > MAX_PENDING:
                del self._events[: len(self._events) - MAX_PENDING]

    def stored(self, digests: list[bytes], parent: bytes | None, token_ids: list[int], chunk_size: int,
               lora_name: str | None) -> None:
        if digests:
            self._append(BlockStored(block_hashes=list(digests), parent_block_hash=parent, token_ids=token_ids,
                                     block_size=chunk_size, lora_id=None, medium=MEDIUM, lora_name=lora_name))

    def removed(self, digests: list[bytes], tier: str) -> None:
        if digests:
            self._append(BlockRemoved(block_hashes=list(digests), medium=f"{MEDIUM}_{tier}"))

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class ChunkEvents(KVConnectorKVEvents):
    """vLLM's container for our events, from one or more workers.

    Every worker (TP rank) stores its own shard of each chunk under its own
    namespace, so events are not de-duplicated across workers."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events or [])
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> ChunkEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 0
