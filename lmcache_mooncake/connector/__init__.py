"""``LMCacheMooncakeConnector``: the vLLM KV connector of lmcache-mooncake.

Load it with::

    --kv-transfer-config '{"kv_connector":"LMCacheMooncakeConnector",
      "kv_connector_module_path":"lmcache_mooncake.connector",
      "kv_role":"kv_both",
      "kv_connector_extra_config":{"config_file":"configs/both.yaml"}}'

vLLM builds one instance per process and role: the scheduler side in the
EngineCore process (:mod:`.scheduler`) and the worker side in each worker
process (:mod:`.worker`). This class only routes each call of vLLM's
``KVConnectorBase_V1`` contract to the side that owns it.

Roles: ``kv_both`` loads and saves; ``kv_producer`` saves only;
``kv_consumer`` loads only.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache_mooncake.chunks.keys import model_identity
from lmcache_mooncake.config import config_from_extra
from lmcache_mooncake.connector.lookup import LookupClient, lookup_socket_path
from lmcache_mooncake.connector.metadata import StepMetadata
from lmcache_mooncake.connector.scheduler import SchedulerSide
from lmcache_mooncake.connector.worker import WorkerSide
from lmcache_mooncake.kv import cpu_isa
from lmcache_mooncake.obs.kv_events import ChunkEvents
from lmcache_mooncake.obs.logs import setup_logging
from lmcache_mooncake.obs.metrics import LMCacheMooncakePromMetrics, LMCacheMooncakeStats

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

setup_logging()
logger = logging.getLogger(__name__)

__all__ = ["LMCacheMooncakeConnector"]


def _model_id(vllm_config: VllmConfig, configured: str | None) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0]
    return model_identity(configured, str(name or vllm_config.model_config.model))


def _backend_name(vllm_config: VllmConfig) -> str:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    names = {
        layer.get_attn_backend().get_name()
        for layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).values()
    }
    if len(names) != 1:
        raise ValueError(
            f"lmcache-mooncake needs one attention backend for all layers, found {sorted(names)}"
        )
    return names.pop()


def _kv_events_on(vllm_config: VllmConfig) -> bool:
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kec is not None and kec.enable_kv_cache_events)


class LMCacheMooncakeConnector(KVConnectorBase_V1):
    """Saves and loads content-hashed KV chunks through LMCache's tiers."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        # Errors here name the file and key; vLLM shows them at start-up.
        self.cfg = config_from_extra(ktc.kv_connector_extra_config)
        engine_id = str(ktc.engine_id)
        self.run_dir = Path(self.cfg.run_dir or Path(tempfile.gettempdir()) / "lmcache-mooncake" / engine_id[:12])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Not in run_dir: a Unix socket path has at most 107 bytes (lookup_socket_path).
        socket = lookup_socket_path(self.run_dir, engine_id, vllm_config.parallel_config.data_parallel_rank)
        block_size = vllm_config.cache_config.block_size
        save = ktc.kv_role in ("kv_both", "kv_producer")
        load = ktc.kv_role in ("kv_both", "kv_consumer")

        self._events: list[KVCacheEvent] = []  # scheduler: workers' KV events not yet taken
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's default is to fail a request whose KV load fails; a cache
            # must instead recompute. The scheduler reads this after building us.
            ktc.kv_load_failure_policy = self.cfg.load_failure_policy
            self._scheduler = SchedulerSide(
                self.cfg, block_size, LookupClient(socket, self.cfg.lookup_timeout), save=save, load=load,
                stats_path=self.run_dir / "stats-scheduler.json",
                load_granularity=cpu_isa.load_granularity(vllm_config),
            )
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self._worker = WorkerSide(
                self.cfg,
                model_id=_model_id(vllm_config, self.cfg.model_id),
                backend_name=_backend_name(vllm_config),
                block_size=block_size,
                run_dir=self.run_dir,
                lookup_socket=socket,
                instance_id=f"lmcm-{engine_id}",
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=get_tensor_model_parallel_world_size(),
                producer=save and not load,
                publish_events=_kv_events_on(vllm_config),
            )
        logger.info("LMCacheMooncakeConnector (%s, %s) config: %s", role.name, ktc.kv_role, self.cfg)

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call reached the scheduler-side LMCacheMooncakeConnector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call reached the worker-side LMCacheMooncakeConnector")
        return self._scheduler

    def _step_metadata(self) -> StepMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StepMetadata):
            raise RuntimeError(f"expected this connector's StepMetadata from the scheduler, got {type(meta).__name__}")
        return meta

    # ==============================
    # Worker side
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker: called once with every layer's paged KV tensor, in layer order."""
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker: start this step's planned loads. Asynchronous ones run on a
        loader thread while the step goes on (their requests are not in it), or
        here when vLLM scheduled nothing this step; synchronous ones are in
        paged KV when this returns."""
        self._worker_side().start_load_kv(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, before each attention layer: with ``layerwise``, wait (the compute stream
        waits, on CUDA) for this layer's share of the step's synchronous loads; else
        nothing to wait for (whole-step loads are in paged KV before the forward pass)."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Worker, after each attention layer: with ``layerwise``, queue the copy of this
        layer's blocks of the step's planned saves; else nothing (saves copy all layers in
        wait_for_save)."""
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, kv_layer, self._step_metadata())

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM, at start-up: the per-layer hooks must run between CUDA graph pieces when
        ``layerwise`` is on (a captured graph would skip them on replay)."""
        try:
            return config_from_extra(extra_config).layerwise
        except Exception:  # the connector's own start-up reports a bad config
            return False

    def wait_for_save(self) -> None:
        """Worker: copy out and store the prompts this step finished computing."""
        self._worker_side().save(self._step_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker: a producer's finished requests whose chunks are now written
        (vLLM frees their blocks then), and requests whose asynchronous load
        ended (vLLM schedules them then; failed blocks follow in
        get_block_ids_with_load_errors of the same step)."""
        return self._worker_side().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker: blocks whose planned load failed this step; vLLM recomputes them."""
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Both sides, after every step: what this side counted since the last call
        (the worker: its engine and tiers; the scheduler: consumer waits and producer
        holds). vLLM aggregates them and feeds its log line and ``/metrics``."""
        side = self._worker if self._worker is not None else self._scheduler
        if side is None:
            return None
        stats = LMCacheMooncakeStats(data=side.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """API process: rebuild our stats from the dict the scheduler sent."""
        return LMCacheMooncakeStats(data=data) if data is not None else LMCacheMooncakeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LMCacheMooncakePromMetrics:
        """API process: our Prometheus metrics (docs/metrics.md), registered once."""
        return LMCacheMooncakePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> ChunkEvents | None:
        """Worker, after every step: chunks stored and removed since the last call, as vLLM
        KV events (:mod:`lmcache_mooncake.obs.kv_events`); None when there are none."""
        events = self._worker.take_events() if self._worker is not None else []
        return ChunkEvents(events) if events else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, after every step: keep the workers' KV events until vLLM takes them; a
        request whose load failed is computed, never sent to the same chunks again."""
        events = connector_output.kv_cache_events
        if isinstance(events, ChunkEvents):
            self._events.extend(events.get_all_events())
        self._scheduler_side().update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler: the workers' KV events since the last call (vLLM publishes them)."""
        events, self._events = self._events, []
        if events:
            logger.debug("publishing %d KV events", len(events))
        return events

    def shutdown(self) -> None:
        """Both sides: drain pending writes and close the tiers."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ==============================
    # Scheduler side
    # ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler: prompt tokens beyond ``num_computed_tokens`` the tiers can supply, and
        whether they load asynchronously (``async_loading``, default on). Looks them up
        (a lookup is a question to the worker, bounded by ``lookup_timeout``);
        ``None`` ("ask again at the next step") while the worker's answer has not come
        within ``LOOKUP_WAIT_S``, and while a consumer waits for chunks a producer promised."""
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Scheduler: blocks are allocated; remember to load ``num_external_tokens``."""
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Scheduler, after update_state_after_alloc: the tokens vLLM loads through us, by the
        tier that held them (CPU tier ``host``, disk ``disk``, the store ``external_unspecified``);
        vLLM counts them in ``vllm:prompt_tokens_cached_by_source``. No side effects."""
        return self._scheduler_side().hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler: this step's loads and saves, for the workers."""
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler: the blocks can be freed at once (saves copy out within their step)."""
        return self._scheduler_side().request_finished(request, block_ids)
