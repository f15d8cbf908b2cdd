"""The scheduler side of the connector (runs in vLLM's EngineCore process).

It asks the worker how long a cached prefix the tiers hold, tells vLLM how
many tokens will be loaded, and each step plans the loads and saves the
worker carries out. It holds no KV itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.connector.lookup import LookupClient
from lmcache_mooncake.connector.metadata import LoadOp, SaveOp, StepMetadata, slots_for
from lmcache_mooncake.stats import Stats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# A consumer waiting for promised chunks looks them up at most this often.
_RECHECK_S = 0.05


@dataclass
class _Tracked:
    """What the scheduler side remembers about one live request."""

    token_ids: list[int]
    cache_salt: str | None
    lora: str | None
    block_ids: list[int]
    external_hit: int = 0  # prompt tokens the tiers hold (chunk-aligned or the whole prompt)
    load: tuple[int, int] | None = None  # planned [start, end) to load
    saved: bool = False
    save_planned: bool = False  # a SaveOp went to the workers: they report when it is written
    stored_tokens: int = 0  # prompt tokens the tiers hold or will hold once the save is written


#: Key of our entry in a request's kv_transfer_params.
PARAMS_KEY = "lmcache_mooncake"


def _lora_name(request: Request) -> str | None:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else str(lora.lora_name)


class SchedulerSide:
    def __init__(self, cfg: CacheConfig, block_size: int, lookup: LookupClient, save: bool, load: bool,
                 stats_path: Path):
        self.cfg = cfg
        self.block_size = block_size
        self.lookup_client = lookup
        self.save_enabled = save
        self.load_enabled = load
        # Hit, salt and LoRA found by get_num_new_matched_tokens, before blocks
        # are allocated (vLLM's per-step request data does not carry the salt).
        self._hits: dict[str, tuple[int, str | None, str | None]] = {}
        # The locally computed (vLLM prefix cache) token count vLLM gave the
        # lookup: where a load starts. vLLM sets request.num_computed_tokens
        # only after update_state_after_alloc, so it cannot be read there.
        self._local: dict[str, int] = {}
        self._planned_loads: dict[str, tuple[int, int]] = {}
        self._reqs: dict[str, _Tracked] = {}
        # Consumer: when we first looked for chunks a producer promised.
        self._waiting_since: dict[str, float] = {}
        self._last_lookup: dict[str, float] = {}
        self.producer = save and not load
        self.stats = Stats()
        self.stats_path = stats_path

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        if not self.load_enabled and not self.save_enabled:
            return 0, False
        req_id = request.request_id
        promised = self._promised(request, len(prompt))
        now = time.monotonic()
        if promised and now - self._last_lookup.get(req_id, 0.0) < _RECHECK_S:
            return None, False  # asked again too soon: no new lookup yet
        self._last_lookup[req_id] = now
        salt, lora = request.cache_salt, _lora_name(request)
        hit = self.lookup_client.lookup(prompt, salt, lora)
        if promised and hit < promised:
            # The producer's writes may still be on their way: ask vLLM to
            # come back, up to load_wait_timeout, then compute the rest.
            since = self._waiting_since.setdefault(req_id, now)
            if now - since < self.cfg.load_wait_timeout:
                return None, False
            self.stats.add("consumer_short_hits")
            self.stats.add("consumer_missing_tokens", promised - hit)
            logger.warning(
                "request %s: the producer promised %d cached tokens, %d found after %.1f s; computing the rest",
                req_id, promised, hit, now - since,
            )
        if promised:
            self.stats.add("consumer_requests")
            self.stats.add("consumer_wait_ms", int((now - self._waiting_since.pop(req_id, now)) * 1000))
        self._last_lookup.pop(req_id, None)
        self._hits[req_id] = (hit, salt, lora)
        self._local[req_id] = num_computed_tokens
        if not self.load_enabled:
            return 0, False
        # vLLM must compute at least one prompt token to sample the next one.
        usable = min(hit, len(prompt) - 1)
        new = max(usable - num_computed_tokens, 0)
        logger.debug(
            "request %s: %d prompt tokens, %d cached in tiers, %d computed locally, loading %d",
            request.request_id, len(prompt), hit, num_computed_tokens, new,
        )
        return new, False

    def _promised(self, request: Request, prompt_len: int) -> int:
        """Prompt tokens a producer said it stored (0 if none, or not a consumer)."""
        if not self.load_enabled:
            return 0
        params = getattr(request, "kv_transfer_params", None) or {}
        ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if not isinstance(ours, dict):
            return 0
        try:
            return min(int(ours.get("stored_prompt_tokens", 0)), prompt_len)
        except (TypeError, ValueError):
            return 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        start = self._local.pop(request.request_id, 0)
        if num_external_tokens > 0:
            self._planned_loads[request.request_id] = (start, start + num_external_tokens)

    def _chunk_end(self, token_count: int, pos: int) -> int:
        """End of the chunk holding token ``pos - 1`` (chunks end at multiples or at the prompt end)."""
        size = self.cfg.chunk_size
        return min(-(-pos // size) * size, token_count)

    def build_connector_meta(self, out: SchedulerOutput) -> StepMetadata:
        meta = StepMetadata()
        for new in out.scheduled_new_reqs:
            req_id = new.req_id
            known = req_id in self._hits
            hit, salt, lora = self._hits.pop(req_id, (0, None, None))
            tracked = _Tracked(
                token_ids=list(new.prompt_token_ids or []),
                cache_salt=salt,
                lora=lora,
                block_ids=list(new.block_ids[0]),
                external_hit=hit,
                load=self._planned_loads.pop(req_id, None),
                # Never store under a guessed salt: a request we did not look
                # up (so whose salt we do not know) is not saved.
                saved=not known,
            )
            self._reqs[req_id] = tracked
            if tracked.load is not None:
                meta.loads.append(self._load_op(req_id, tracked))
            self._maybe_save(meta, req_id, tracked, new.num_computed_tokens + out.num_scheduled_tokens[req_id])

        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._reqs.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A preempted request resumes with a fresh block list and recomputes.
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            done = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            self._maybe_save(meta, req_id, tracked, done)

        for req_id in out.finished_req_ids:
            self._reqs.pop(req_id, None)
            self._hits.pop(req_id, None)
            self._planned_loads.pop(req_id, None)
            self._local.pop(req_id, None)
        self.stats.dump(self.stats_path)
        return meta

    def _load_op(self, req_id: str, t: _Tracked) -> LoadOp:
        start, end = t.load  # type: ignore[misc]
        upto = self._chunk_end(len(t.token_ids), end)
        return LoadOp(
            req_id=req_id,
            token_ids=t.token_ids[:upto],
            slots=slots_for(t.block_ids, self.block_size, upto),
            start=start,
            end=end,
            block_ids=list(t.block_ids),
            cache_salt=t.cache_salt,
            lora=t.lora,
        )

    def _maybe_save(self, meta: StepMetadata, req_id: str, t: _Tracked, computed: int) -> None:
        """Plan the save of the whole prompt in the step that computes its last token."""
        if not self.save_enabled or t.saved or computed < len(t.token_ids):
            return
        t.saved = True
        n = len(t.token_ids)
        size = self.cfg.chunk_size
        # Chunks the tiers already hold are not copied again.
        skip = (t.external_hit // size) * size
        storable = n if self.cfg.save_unfull_chunk else (n // size) * size
        t.stored_tokens = max(storable, min(t.external_hit, n))
        if t.external_hit >= n or storable <= skip:
            return
        t.save_planned = True
        meta.saves.append(
            SaveOp(
                req_id=req_id,
                token_ids=t.token_ids,
                slots=slots_for(t.block_ids, self.block_size, n),
                skip=skip,
                cache_salt=t.cache_salt,
                lora=t.lora,
            )
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A producer holds the request (reported finished by the workers only
        once its chunks are written) and tells the consumer what it stored."""
        req_id = request.request_id
        t = self._reqs.pop(req_id, None)
        self._waiting_since.pop(req_id, None)
        self._last_lookup.pop(req_id, None)
        if not self.producer or t is None or not t.stored_tokens:
            return False, None
        params = {PARAMS_KEY: {"stored_prompt_tokens": t.stored_tokens}}
        # Saves copy out of paged KV within their step; what we wait for is the
        # write to the shared tier, reported by the workers in get_finished.
        return t.save_planned, params

    def shutdown(self) -> None:
        self.stats.dump(self.stats_path, force=True)
        self.lookup_client.close()
