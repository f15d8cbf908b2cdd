"""The worker side of the connector (runs in each vLLM worker process).

It owns the LMCache engine (and so the tiers), answers the scheduler's
lookups, loads planned chunks into paged KV before the forward pass that
needs them, stores newly computed prompts after the forward pass, and
reports blocks whose load failed so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from lmcache_mooncake.chunks.keys import KeyNamespace, namespace_for
from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.connector.direct import ENGINE, DirectLoader
from lmcache_mooncake.connector.layerwise import LayerwiseLoader, LayerwiseSaver
from lmcache_mooncake.connector.lookup import LookupReply, LookupServer
from lmcache_mooncake.connector.metadata import LoadOp, SaveOp, StepMetadata
from lmcache_mooncake.engine import (
    build_engine,
    close_engine,
    context,
    lookup_tiers,
    request_configs,
    write_barrier,
)
from lmcache_mooncake.kv import layouts
from lmcache_mooncake.obs.kv_events import KVEventLog
from lmcache_mooncake.obs.stats import Stats
from lmcache_mooncake.runtime import affinity
from lmcache_mooncake.runtime.heap import HeapTrimmer, fix_mmap_threshold

logger = logging.getLogger(__name__)


def _digest(key) -> bytes:
    """LMCache's key of one of our chunks -> the chunk's 32-byte digest (our chunk key)."""
    return int(key.chunk_hash).to_bytes(32, "big")


class WorkerSide:
    def __init__(
        self,
        cfg: CacheConfig,
        model_id: str,
        backend_name: str,
        block_size: int,
        run_dir: Path,
        lookup_socket: Path,
        instance_id: str,
        tp_rank: int,
        tp_size: int,
        producer: bool = False,
        publish_events: bool = False,
    ):
        self.cfg = cfg
        self.model_id = model_id
        self.layout = layouts.layout_for_backend(backend_name)
        self.block_size = block_size
        self.run_dir = run_dir
        self.lookup_socket = lookup_socket
        self.instance_id = instance_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.kv_caches: list[torch.Tensor] = []
        self.engine = None
        self._direct: DirectLoader | None = None
        self.namespace: KeyNamespace | None = None
        self.lookup_server: LookupServer | None = None
        self._failed_blocks: set[int] = set()
        # Layer-wise mode (cfg.layerwise): layer name -> index, and the two pipelines.
        self.layer_index: dict[str, int] = {}
        self.saver: LayerwiseSaver | None = None
        self.loader: LayerwiseLoader | None = None
        self._staged_loads: list[LoadOp] = []
        fix_mmap_threshold(cfg.heap_mmap_threshold)
        self.heap = HeapTrimmer(cfg.heap_trim_interval)
        # Asynchronous loads in flight, by request; one loader thread.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmcm-load",
                                          initializer=affinity.widen_current_thread, initargs=("lmcm-load",))
        self._loading: dict[str, tuple[Future, LoadOp]] = {}
        # Producer: keys of each request's saved chunks, until they are written
        # everywhere; and the requests vLLM has finished and waits on.
        self.producer = producer
        self._saving: dict[str, tuple[list[str], Future | None]] = {}
        self._finished: set[str] = set()
        self.stats_path = run_dir / f"stats-rank{tp_rank}.json"
        # The engine's own counters (its tiers count into them too).
        self.stats: Stats = context(instance_id).stats
        # Stored/removed chunks for vLLM's KV events, only when vLLM publishes them.
        self.events: KVEventLog | None = None
        if publish_events:
            self.events = context(instance_id).events = KVEventLog()
            logger.info("stored and evicted chunks are published as vLLM KV events (medium %r)", "lmcm")

    # -- set-up ------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        first = self.kv_caches[0]
        _, num_heads, block_size, head_size = self.layout.kv_shape(first, self.block_size)
        if self.cfg.layerwise:
            # block_size: the tensors' own (kernel) block size, which slots count in.
            self.saver = LayerwiseSaver(self.kv_caches, block_size)
            self.loader = LayerwiseLoader(self.kv_caches, block_size, self.layout)
        dtype = str(first.dtype).removeprefix("torch.")
        self.namespace = namespace_for(
            self.model_id, dtype, len(self.kv_caches), num_heads, head_size, self.cfg.chunk_size,
            tp_size=self.tp_size, tp_rank=self.tp_rank,
            chunk_layout=self.layout.chunk_layout(first, self.cfg.chunk_size),
        )
        self.engine = build_engine(self.cfg, self.namespace, self.layout, first.dtype, self.instance_id)
        self._direct = DirectLoader.for_engine(self.engine) if self.engine is not None else None
        if self.tp_rank == 0:
            self.lookup_server = LookupServer(self.lookup_socket, self.lookup)
        ns = self.namespace
        # Compare these lines of a writer and a reader when a reader finds nothing:
        # any difference in them gives the two different keys.
        logger.info(
            "lmcache-mooncake worker ready (TP rank %d of %d): key namespace %s = model %r, KV dtype %s, "
            "%d layers, %d KV heads, head size %d, chunk size %d, chunks as %s; %s layout, disk tier %s; %s",
            self.tp_rank, self.tp_size, ns.hex(), ns.model, ns.kv_dtype, ns.num_layers, ns.num_kv_heads,
            ns.head_size, ns.chunk_size, ns.chunk_layout, self.layout.name, self.cfg.disk_path,
            "layer-wise saves and (synchronous) loads" if self.cfg.layerwise else "whole-step saves and loads",
        )

    def _require_engine(self) -> None:
        if self.engine is None:
            raise RuntimeError("the connector's engine is not built: vLLM has not called register_kv_caches yet")

    # -- lookups (called on the lookup server's thread) --------------------
    def lookup(self, tokens: list[int], salt: str | None, lora: str | None) -> LookupReply:
        """The cached prefix of ``tokens`` and the tier that held each part of it."""
        self._require_engine()
        t0 = time.perf_counter()
        hit, runs = lookup_tiers(self.engine, tokens, request_configs(salt, lora))
        self.stats.add("lookups")
        self.stats.add("lookup_hit_tokens", hit)
        self.stats.observe("lookup_s", time.perf_counter() - t0)
        return LookupReply(hit=hit, runs=runs)

    # -- per step ----------------------------------------------------------
    def start_load_kv(self, meta: StepMetadata) -> None:
        """Start this step's loads: asynchronous ones on the loader thread (vLLM
        holds their requests until :meth:`get_finished` reports them), the
        others here, done when this returns.

        An asynchronous load whose step is idle (vLLM scheduled no tokens: no
        other request runs) and that finds no load in flight runs here too, and
        is reported by this step's :meth:`get_finished`. On the loader thread it
        would share the cores with vLLM's loop of empty steps and take longer:
        an 8,192-token load from the CPU tier took markedly longer there than in
        the step (``benchmarks/step_timeline.py`` times a served load, ``load`` in
        its summary; its ``+sync`` modes load in the step)."""
        self.heap.note_step()
        if self.loader is not None:
            self._begin_layerwise_loads([op for op in meta.loads if not op.asynchronous])
        for op in meta.loads:
            if self.loader is not None and not op.asynchronous:
                continue  # read into staging above; in paged KV layer by layer
            if op.asynchronous and meta.idle and all(f.done() for f, _ in self._loading.values()):
                done: Future = Future()
                done.set_result(self._load(op))
                self._loading[op.req_id] = (done, op)
            elif op.asynchronous:
                self._loading[op.req_id] = (self._loader.submit(self._load, op), op)
            else:
                self._failed_blocks.update(self._load(op))

    def _begin_layerwise_loads(self, ops: list[LoadOp]) -> None:
        """Read this step's synchronous loads into the loader's staging copy and queue their
        layers' copies into paged KV (:mod:`.layerwise`); their failed blocks are reported now."""
        aligned = [self._chunk_start(op) for op in ops]
        self._staged_loads = ops
        try:
            staged = self.loader.begin([(op.slots, a, op.start) for op, a in zip(ops, aligned, strict=True)])
        except Exception:
            logger.exception("layer-wise load: staging failed; vLLM will recompute")
            self._staged_loads = []
            for op in ops:
                self._failed_blocks.update(self._planned_blocks(op))
            return
        for op, into in zip(ops, staged, strict=True):
            self._failed_blocks.update(self._load(op, into.kv_caches, into.slots))
        self.loader.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.loader is not None and self.loader.active:
            self.loader.wait_layer(self.layer_index.get(layer_name, -1))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: StepMetadata) -> None:
        """After layer ``layer_name``'s attention: queue the copy of its blocks of ``meta``'s
        saves. The first call of a step stages them (not ``start_load_kv``: vLLM calls that
        after the forward pass in a step without synchronous loads)."""
        if self.saver is None or not meta.saves:
            return
        if self.saver.step_of is not meta:
            try:
                self.saver.begin([op.slots for op in meta.saves], [op.skip for op in meta.saves], meta)
            except Exception:  # the saves then copy from paged KV after the step, as without layerwise
                logger.exception("layer-wise save: staging failed; saving this step's prompts after the step")
                return
        index = self.layer_index.get(layer_name)
        if index is not None:
            self.saver.layer(index, kv_layer)

    def _chunk_start(self, op: LoadOp) -> int:
        """The start of the chunk ``op.start`` falls in: where ``op``'s load reads from."""
        return (op.start // self.cfg.chunk_size) * self.cfg.chunk_size

    def _planned_blocks(self, op: LoadOp) -> list[int]:
        return op.block_ids[op.start // self.block_size : -(-op.end // self.block_size)]

    def _load(self, op: LoadOp, kv_caches: list[torch.Tensor] | None = None,
              slot_list: list[int] | None = None) -> set[int]:
        """Load one request's planned chunks; returns the blocks that were not loaded.

        The chunks go in order, in runs: those the CPU tier does not hold straight
        from their files, or from the store client's staging region, into paged KV
        (:mod:`.direct`), the others through LMCache's ``retrieve``. The first chunk not loaded
        stops the load; every block from it on is returned.

        ``kv_caches`` / ``slot_list``: where to write instead of vLLM's paged KV at
        ``op.slots`` (the layer-wise loader's staging copy)."""
        self._require_engine()
        kv_caches = self.kv_caches if kv_caches is None else kv_caches
        slot_list = op.slots if slot_list is None else slot_list
        tokens = torch.tensor(op.token_ids, dtype=torch.long)
        slots = torch.tensor(slot_list, dtype=torch.long)
        # Chunks wholly before `start` are not read at all.
        aligned = self._chunk_start(op)
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:aligned] = False
        logger.debug("request %s: loading tokens [%d, %d) from chunks starting at %d",
                     op.req_id, op.start, op.end, aligned)
        t0 = time.perf_counter()
        rc = request_configs(op.cache_salt, op.lora)
        loaded = aligned
        try:
            chunks = list(self.engine.token_database.process_tokens(tokens, mask=mask, request_configs=rc))
            runs = self._direct.segments(chunks, kv_caches) if self._direct is not None else [(ENGINE, chunks)]
            for kind, run in runs:
                first, last = run[0][0], run[-1][1]
                if kind == ENGINE:
                    loaded = self._retrieve(op, tokens[:last], slots, first, rc, kv_caches)
                else:
                    loaded = self._direct.load(kind, run, kv_caches, slot_list, op.start, op.end)
                if loaded < last:
                    break
        except Exception:
            logger.exception("request %s: loading cached KV failed; vLLM will recompute", op.req_id)
        bad: list[int] = []
        if loaded < op.end:
            # Every block holding a token we promised but did not load.
            first_block = max(loaded, op.start) // self.block_size
            last_block = (op.end - 1) // self.block_size
            bad = op.block_ids[first_block : last_block + 1]
            self.stats.add("load_failures")
            self.stats.add("load_failed_tokens", op.end - max(loaded, op.start))
            logger.warning(
                "request %s: loaded %d of %d planned tokens; %d blocks will be recomputed",
                op.req_id, max(loaded, op.start) - op.start, op.end - op.start, len(bad),
            )
        self.stats.add("loaded_tokens", max(min(loaded, op.end) - op.start, 0))
        self.stats.observe("load_s", time.perf_counter() - t0)
        self.stats.add("loads_async" if op.asynchronous else "loads_sync")
        # Offline fallback: on disk before vLLM hears the load is done, so whoever
        # reads the counters after the request's answer sees this load in them.
        self.stats.dump(self.stats_path, force=True)
        return set(bad)

    def _retrieve(self, op: LoadOp, tokens: torch.Tensor, slots: torch.Tensor, first: int,
                  rc: dict, kv_caches: list[torch.Tensor]) -> int:
        """LMCache's retrieve of the chunks of ``tokens`` from ``first`` (a chunk start) on;
        returns where the loaded prefix ends."""
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[first:] = True
        ret = self.engine.retrieve(
            tokens,
            mask=mask,
            kvcaches=kv_caches,
            slot_mapping=slots,
            skip_leading_tokens=op.start,
            load_end=op.end,
            request_configs=rc,
            req_id=op.req_id,
        )
        return first + int(ret[first:].long().cumprod(0).sum().item())

    def save(self, meta: StepMetadata) -> None:
        """End of the step's forward pass (vLLM's ``wait_for_save``): store the planned saves
        (in layer-wise mode from the staging copy the layers filled) and end the step's
        layer-wise loads."""
        if self._staged_loads:
            missing = self.loader.finish()
            for op in self._staged_loads:
                self.stats.add("layerwise_load_fallbacks" if missing else "layerwise_loads")
                if missing:
                    self._failed_blocks.update(self._planned_blocks(op))
        self._staged_loads = []
        staged = self.saver.finish() if self.saver is not None else []
        for i, op in enumerate(meta.saves):
            into = staged[i] if i < len(staged) else None
            if self.saver is not None:
                ok = into is not None and into.kv_caches is not None
                self.stats.add("layerwise_saves" if ok else "layerwise_save_fallbacks")
            self._save(op, into.kv_caches if into else None, into.slots if into else None)
        self.stats.dump(self.stats_path)

    def _save(self, op: SaveOp, kv_caches: list[torch.Tensor] | None = None,
              slots: torch.Tensor | None = None) -> None:
        """Store ``op``'s tokens from paged KV, or from ``kv_caches`` at ``slots`` (staging)."""
        self._require_engine()
        tokens = torch.tensor(op.token_ids, dtype=torch.long)
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[: op.skip] = False
        logger.debug("request %s: storing tokens [%d, %d)", op.req_id, op.skip, len(tokens))
        t0 = time.perf_counter()
        rc = request_configs(op.cache_salt, op.lora)
        # The chunks' keys, when a producer waits for them or KV events name them.
        chunks = (list(self.engine.token_database.process_tokens(tokens, mask=mask, request_configs=rc))
                  if self.producer or self.events is not None else [])
        if self.producer:
            # Registered before the store so a failed store still reports the request.
            self._saving[op.req_id] = ([key.to_string() for _, _, key in chunks], None)
        try:
            self.engine.store(
                tokens,
                mask=mask,
                kvcaches=self.kv_caches if kv_caches is None else kv_caches,
                slot_mapping=torch.tensor(op.slots, dtype=torch.long) if slots is None else slots,
                request_configs=rc,
                req_id=op.req_id,
            )
        except Exception:
            # A failed save is a future miss, never a wrong answer.
            logger.exception("request %s: saving KV failed; it will not be cached", op.req_id)
            self.stats.add("save_failures")
            return
        finally:
            if self.producer:
                # The tiers' writes begin on LMCache's loop; once this barrier
                # has run, every one of them is tracked (engine.write_barrier).
                self._saving[op.req_id] = (self._saving[op.req_id][0], write_barrier(self.engine))
        self.stats.add("saved_tokens", len(tokens) - op.skip)
        if self.events is not None and chunks:
            self._publish_stored(op, tokens, chunks, rc)
        self.stats.observe("save_s", time.perf_counter() - t0)

    def _publish_stored(self, op: SaveOp, tokens: torch.Tensor, chunks: list, rc: dict | None) -> None:
        """One BlockStored event for the chunks of ``op`` (see :mod:`lmcache_mooncake.obs.kv_events`)."""
        first = chunks[0][0]
        parent = None
        if first > 0:
            *_, (_, _, before) = self.engine.token_database.process_tokens(tokens[:first], request_configs=rc)
            parent = _digest(before)
        self.events.stored([_digest(key) for _, _, key in chunks], parent, op.token_ids[first : chunks[-1][1]],
                           self.cfg.chunk_size, op.lora)

    def take_events(self) -> list:
        """KV events since the last call (empty when vLLM's KV events are off)."""
        return self.events.take() if self.events is not None else []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(saved, loaded)``: a producer's finished requests whose chunks are now
        written to every tier, and requests whose asynchronous load has ended
        (its failed blocks are reported by :meth:`take_failed_blocks` in the same step)."""
        loaded = {r for r, (f, _) in self._loading.items() if f.done()}
        for r in loaded:
            future, op = self._loading.pop(r)
            try:
                self._failed_blocks.update(future.result())
            except Exception:  # _load catches its own errors; never let vLLM use unloaded blocks
                logger.exception("request %s: the background load failed; vLLM will recompute", r)
                self._failed_blocks.update(self._planned_blocks(op))
        return self._saved(finished_req_ids), (loaded or None)

    def _saved(self, finished_req_ids: set[str]) -> set[str] | None:
        if not self.producer:
            return None
        self._finished.update(r for r in finished_req_ids if r in self._saving)
        writes = context(self.instance_id).writes
        done = set()
        for r in self._finished:
            keys, barrier = self._saving[r]
            if barrier is not None and barrier.done() and not writes.any_in_flight(keys):
                done.add(r)
        for r in done:
            self._finished.discard(r)
            self._saving.pop(r, None)
        if done:
            self.stats.add("producer_requests_durable", len(done))
        return done or None

    def take_stats(self) -> dict:
        """What this engine counted since the last call (for vLLM's stats hook)."""
        return self.stats.take()

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        if self.loader is not None:
            self.loader.finish_all()
        self.heap.close()
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        if self.engine is not None:
            close_engine(self.engine, self.instance_id)
            self.engine = None
        self.stats.dump(self.stats_path, force=True)
