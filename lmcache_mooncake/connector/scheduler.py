"""The scheduler side of the connector (runs in vLLM's EngineCore process).

It asks the worker how long a cached prefix the tiers hold, tells vLLM how
many tokens will be loaded (and that they load asynchronously, so other
requests keep running meanwhile), and each step plans the loads and saves
the worker carries out. It holds no KV itself. All it knows of a request is
one :class:`_Request` record, made at its first lookup and dropped when vLLM
finishes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.connector.lookup import LookupClient
from lmcache_mooncake.connector.metadata import LoadOp, SaveOp, StepMetadata, slots_for
from lmcache_mooncake.obs.stats import Stats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# A consumer waiting for promised chunks looks them up at most this often.
_RECHECK_S = 0.05
#: How long one call of get_num_new_matched_tokens waits for the worker's answer
#: before telling vLLM to ask again (None): vLLM takes in and schedules requests
#: that arrived meanwhile, instead of waiting behind a long prompt's disk reads.
LOOKUP_WAIT_S = 0.01

#: Key of our entry in a request's kv_transfer_params.
PARAMS_KEY = "lmcache_mooncake"

#: Our tiers (``LookupReply.runs``) as vLLM's cache-hit sources. The store is
#: neither this host's memory nor another vLLM instance (``p2p``): vLLM files a
#: remote store under ``external_unspecified`` (its ``CacheHitSource`` docs).
HIT_SOURCES = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
               "store": CacheHitSource.EXTERNAL_UNSPECIFIED}
#: Our tiers from the fastest; a tier we do not know counts as the slowest.
_TIER_ORDER = {"cpu": 0, "disk": 1, "store": 2}


def outermost_runs(old: list[tuple[str, int]], new: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """An earlier and the latest lookup's ``(tier, end)`` runs of one request, merged over
    the latest one's extent: each token keeps the slower of the tiers the two found it
    in. A chunk moves to a faster tier only because someone read it (a disk lookup
    verifies a chunk into the CPU tier), so the slower tier is where this request's
    lookups first found it."""
    def tier_at(runs: list[tuple[str, int]], pos: int) -> str | None:
        return next((tier for tier, end in runs if pos < end), None)

    def rank(tier: str | None) -> int:
        return -1 if tier is None else _TIER_ORDER.get(tier, len(_TIER_ORDER))

    out: list[tuple[str, int]] = []
    start, extent = 0, max((e for _, e in new), default=0)
    for end in sorted({min(e, extent) for _, e in old} | {e for _, e in new}):
        if end <= start:
            continue
        tier = max(tier_at(old, start), tier_at(new, start), key=rank)
        if tier is None:
            break  # neither lookup found this far: runs stay a prefix
        if out and out[-1][0] == tier:
            out[-1] = (tier, end)
        else:
            out.append((tier, end))
        start = end
    return out


@dataclass
class _Request:
    """What the scheduler side remembers about one request."""

    token_ids: list[int]
    cache_salt: str | None
    lora: str | None
    #: Prompt tokens the tiers hold (chunk-aligned, or the whole prompt).
    external_hit: int = 0
    #: Where they are: (tier, end) runs over [0, external_hit) (LookupReply.runs; over
    #: several lookups of the request, the slowest tier each token was found in).
    hit_runs: list[tuple[str, int]] = field(default_factory=list)
    #: Tokens vLLM's own prefix cache supplied (where a load starts). vLLM sets
    #: request.num_computed_tokens only after update_state_after_alloc.
    local_computed: int = 0
    #: Planned [start, end) to load, and whether it loads asynchronously.
    load: tuple[int, int] | None = None
    load_async: bool = False
    #: The load went to the workers (an asynchronous one before vLLM schedules the request).
    load_sent: bool = False
    #: Workers reported a block of this request's load as failed: vLLM recomputes it,
    #: and it is not sent back to the same chunks (which may fail again, at once, forever).
    load_failed: bool = False
    block_ids: list[int] | None = None
    #: We know the request's salt (it was looked up): only then is it saved.
    looked_up: bool = False
    saved: bool = False
    #: A SaveOp went to the workers: they report when it is written.
    save_planned: bool = False
    #: Prompt tokens the tiers hold or will hold once the save is written.
    stored_tokens: int = 0
    #: Consumer: when we first looked for chunks a producer promised, and last looked.
    waiting_since: float | None = None
    last_lookup: float = 0.0


def _lora_name(request: Request) -> str | None:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else str(lora.lora_name)


class SchedulerSide:
    def __init__(self, cfg: CacheConfig, block_size: int, lookup: LookupClient, save: bool, load: bool,
                 stats_path: Path, load_granularity: int = 1):
        self.cfg = cfg
        self.block_size = block_size
        #: Loads end on a multiple of this many tokens (1: any token; a block where the
        #: attention kernel cannot start computing inside a block, see cpu_isa.load_granularity).
        self.load_granularity = max(1, int(load_granularity))
        self.lookup_client = lookup
        self.save_enabled = save
        self.load_enabled = load
        self.producer = save and not load
        #: Loads go to the worker's loader thread, the request held until done; never in
        #: layer-wise mode, whose loads run in the request's own step, layer by layer.
        self._load_async = cfg.async_loading and not cfg.layerwise
        self._reqs: dict[str, _Request] = {}
        self.stats = Stats()
        self.stats_path = stats_path

    def _record(self, request: Request) -> _Request:
        rec = self._reqs.get(request.request_id)
        if rec is None:
            rec = self._reqs[request.request_id] = _Request(
                token_ids=list(request.prompt_token_ids or []),
                cache_salt=request.cache_salt,
                lora=_lora_name(request),
            )
        return rec

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.load_enabled and not self.save_enabled:
            return 0, False
        rec = self._record(request)
        if rec.load_failed:
            rec.load = None
            self.stats.add("loads_failed_recomputed")
            return 0, False
        prompt_len = len(rec.token_ids)
        promised = self._promised(request, prompt_len)
        now = time.monotonic()
        asking = self.lookup_client.is_open(request.request_id)
        if promised and not asking and now - rec.last_lookup < _RECHECK_S:
            return None, False  # asked again too soon: no new lookup yet
        if not asking:
            rec.last_lookup = now
        reply = self.lookup_client.ask(request.request_id, rec.token_ids, rec.cache_salt, rec.lora,
                                       wait=LOOKUP_WAIT_S)
        if reply is None:
            self.stats.add("lookup_deferred_steps")
            return None, False  # the worker is still looking: vLLM asks again next step
        now = time.monotonic()
        hit = reply.hit
        if promised and hit < promised:
            # The producer's writes may still be on their way: ask vLLM to
            # come back, up to load_wait_timeout, then compute the rest.
            if rec.waiting_since is None:
                rec.waiting_since = now
            if now - rec.waiting_since < self.cfg.load_wait_timeout:
                return None, False
            self.stats.add("consumer_short_hits")
            self.stats.add("consumer_missing_tokens", promised - hit)
            logger.warning(
                "request %s: the producer promised %d cached tokens, %d found after %.1f s; computing the rest",
                request.request_id, promised, hit, now - rec.waiting_since,
            )
        if promised:
            self.stats.add("consumer_requests")
            self.stats.observe("consumer_wait_s", now - (rec.waiting_since or now))
        rec.external_hit, rec.local_computed, rec.looked_up = hit, num_computed_tokens, True
        # Asked again (vLLM could not schedule it yet, or a consumer waits): a chunk the
        # earlier lookup promoted from disk was still found on disk for this request.
        rec.hit_runs = outermost_runs(rec.hit_runs, list(reply.runs))
        if not self.load_enabled:
            return 0, False
        # vLLM must compute at least one prompt token to sample the next one.
        usable = min(hit, prompt_len - 1)
        usable -= usable % self.load_granularity
        new = max(usable - num_computed_tokens, 0)
        logger.debug(
            "request %s: %d prompt tokens, %d cached in tiers, %d computed locally, loading %d",
            request.request_id, prompt_len, hit, num_computed_tokens, new,
        )
        return new, bool(new and self._load_async)

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
        rec = self._reqs.get(request.request_id)
        if rec is None or num_external_tokens <= 0:
            return
        rec.load = (rec.local_computed, rec.local_computed + num_external_tokens)
        rec.load_async, rec.load_sent = self._load_async, False
        if rec.load_async:
            # The request waits (not scheduled) until the workers report the
            # load finished: its blocks are known now, and the load goes out
            # with the next step's metadata.
            rec.block_ids = list(blocks.get_block_ids()[0])

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``{source: tokens}`` of the ``num_external_tokens`` vLLM loads through us, i.e.
        prompt tokens ``[local_computed, local_computed + num_external_tokens)``, by the
        tier the lookup found them in (:data:`HIT_SOURCES`); tokens no run covers are
        ``external_unspecified``. Non-zero entries only; they sum to
        ``num_external_tokens``. Reads the request's record, changes nothing."""
        if num_external_tokens <= 0:
            return {}
        rec = self._reqs.get(request.request_id)
        start = rec.local_computed if rec is not None else 0
        end = start + num_external_tokens
        out: dict[CacheHitSource, int] = {}
        run_start = 0
        for tier, run_end in rec.hit_runs if rec is not None else []:
            n = min(run_end, end) - max(run_start, start)
            if n > 0:
                source = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
                out[source] = out.get(source, 0) + n
            run_start = max(run_start, run_end)
        rest = num_external_tokens - sum(out.values())
        if rest > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + rest
        return out

    def update_connector_output(self, output: Any) -> None:
        """Mark requests whose load the workers reported failed (``invalid_block_ids``)."""
        invalid = getattr(output, "invalid_block_ids", None)
        if not invalid:
            return
        for req_id, rec in self._reqs.items():
            if rec.load_sent and rec.block_ids and not invalid.isdisjoint(rec.block_ids):
                if not rec.load_failed:
                    logger.info("request %s: its load failed; computing it instead", req_id)
                rec.load_failed = True

    def _chunk_end(self, token_count: int, pos: int) -> int:
        """End of the chunk holding token ``pos - 1`` (chunks end at multiples or at the prompt end)."""
        size = self.cfg.chunk_size
        return min(-(-pos // size) * size, token_count)

    def build_connector_meta(self, out: SchedulerOutput) -> StepMetadata:
        meta = StepMetadata(idle=out.total_num_scheduled_tokens == 0)
        # Asynchronous loads of requests vLLM holds until they finish.
        for req_id, rec in self._reqs.items():
            if rec.load is not None and rec.load_async and not rec.load_sent and rec.block_ids is not None:
                rec.load_sent = True
                meta.loads.append(self._load_op(req_id, rec, asynchronous=True))

        for new in out.scheduled_new_reqs:
            req_id = new.req_id
            rec = self._reqs.get(req_id)
            if rec is None:
                # Never looked up, so its salt is unknown: never stored under a guess.
                rec = self._reqs[req_id] = _Request(list(new.prompt_token_ids or []), None, None)
            rec.block_ids = list(new.block_ids[0])
            if rec.load is not None and not rec.load_sent:
                rec.load_sent = True
                meta.loads.append(self._load_op(req_id, rec, asynchronous=False))
            self._maybe_save(meta, req_id, rec, new.num_computed_tokens + out.num_scheduled_tokens[req_id])

        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            rec = self._reqs.get(req_id)
            if rec is None or rec.block_ids is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A preempted request resumes with a fresh block list and recomputes.
                rec.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                rec.block_ids.extend(new_blocks[0])
            done = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            self._maybe_save(meta, req_id, rec, done)

        for req_id in out.finished_req_ids:
            self._reqs.pop(req_id, None)
            self.lookup_client.cancel(req_id)
        self.stats.dump(self.stats_path)
        return meta

    def _load_op(self, req_id: str, rec: _Request, asynchronous: bool) -> LoadOp:
        start, end = rec.load  # type: ignore[misc]
        upto = self._chunk_end(len(rec.token_ids), end)
        return LoadOp(
            req_id=req_id,
            token_ids=rec.token_ids[:upto],
            # Slots of the tokens a load may write: vLLM allocated blocks for
            # [0, end) (the chunk's other tokens are only hashed).
            slots=slots_for(rec.block_ids or [], self.block_size, end),
            start=start,
            end=end,
            block_ids=list(rec.block_ids or []),
            cache_salt=rec.cache_salt,
            lora=rec.lora,
            asynchronous=asynchronous,
        )

    def _maybe_save(self, meta: StepMetadata, req_id: str, rec: _Request, computed: int) -> None:
        """Plan the save of the whole prompt in the step that computes its last token."""
        if not self.save_enabled or not rec.looked_up or rec.saved or computed < len(rec.token_ids):
            return
        rec.saved = True
        n = len(rec.token_ids)
        size = self.cfg.chunk_size
        # Chunks the tiers already hold are not copied again.
        skip = (rec.external_hit // size) * size
        storable = n if self.cfg.save_unfull_chunk else (n // size) * size
        rec.stored_tokens = max(storable, min(rec.external_hit, n))
        if rec.external_hit >= n or storable <= skip:
            return
        rec.save_planned = True
        meta.saves.append(
            SaveOp(
                req_id=req_id,
                token_ids=rec.token_ids,
                slots=slots_for(rec.block_ids or [], self.block_size, n),
                skip=skip,
                cache_salt=rec.cache_salt,
                lora=rec.lora,
            )
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A producer holds the request (reported finished by the workers only
        once its chunks are written) and tells the consumer what it stored."""
        rec = self._reqs.pop(request.request_id, None)
        self.lookup_client.cancel(request.request_id)
        if not self.producer or rec is None or not rec.stored_tokens:
            return False, None
        params = {PARAMS_KEY: {"stored_prompt_tokens": rec.stored_tokens}}
        if rec.save_planned:
            self.stats.add("producer_requests_held")
        # Saves copy out of paged KV within their step; what we wait for is the
        # write to the shared tier, reported by the workers in get_finished.
        return rec.save_planned, params

    def take_stats(self) -> dict:
        """What the scheduler side counted since the last call (for vLLM's stats hook)."""
        return self.stats.take()

    def shutdown(self) -> None:
        self.stats.dump(self.stats_path, force=True)
        self.lookup_client.close()
