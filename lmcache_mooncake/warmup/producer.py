"""Running the missing inputs through one vLLM producer, then verifying every chunk is in the store."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache_mooncake.warmup.planning import exists
from lmcache_mooncake.warmup.rendering import ModelInfo
from lmcache_mooncake.warmup.summary import WarmupInput, WarmupSummary

#: Chunks written (with ``tier="store"``). The producer is vLLM's offline ``LLM``,
#: which has no /metrics: its counters come from the run folder (metrics_client.read_offline).
STORED = "vllm:lmcm_chunks_written"

if TYPE_CHECKING:
    from lmcache_mooncake.store.client import StoreClient


@dataclass(frozen=True)
class ProducerSettings:
    """How to run the producer: the model as vLLM gets it, its cache configuration, the limits."""

    model: str
    #: The producer's cache configuration YAML and the keys that override it.
    config_path: Path
    info: ModelInfo
    #: Folder for the vLLM log (``vllm/``) and the connector's counters (``producer-run/``).
    work: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 16
    kv_cache_gib: int = 2
    batch_timeout_s: float = 900.0
    verify_timeout_s: float = 60.0
    progress: bool = True


def batches(pending: list[WarmupInput], batch_size: int) -> list[list[WarmupInput]]:
    """``pending`` in batches of at most ``batch_size`` that vLLM schedules together, in order,
    except that an input sharing a chunk with one already in the batch waits for a later batch:
    computed together, both would write the shared chunks; one batch later, vLLM's prefix cache
    in the producer holds them and only the new chunks are written."""
    out: list[list[WarmupInput]] = []
    left = list(pending)
    while left:
        batch: list[WarmupInput] = []
        names: set[str] = set()
        later: list[WarmupInput] = []
        for i in left:
            if len(batch) < batch_size and names.isdisjoint(i.names):
                batch.append(i)
                names.update(i.names)
            else:
                later.append(i)
        out.append(batch)
        left = later
    return out


def produce(summary: WarmupSummary, pending: list[WarmupInput], client: StoreClient,
            settings: ProducerSettings) -> None:
    """Run ``pending`` through one vLLM producer, then check every chunk is in the store.

    Sets each input's status ("done" only when every one of its chunks is in
    the store, else "failed") and the summary's counters and timings; a
    producer that fails is reported in ``summary.error``, not raised.
    """
    from tqdm import tqdm

    from lmcache_mooncake.obs.metrics_client import MetricsSnapshot, read_offline
    from lmcache_mooncake.testing.offline import Instance, RunSpec

    work, info = settings.work, settings.info
    run_dir = work / "producer-run"
    extra: dict[str, Any] = {"config_file": str(settings.config_path), **settings.overrides,
                             "run_dir": str(run_dir), "model_id": summary.model_id}
    spec = RunSpec(
        model=settings.model, prompts=[], kv_role="kv_producer", extra_config=extra, max_tokens=1,
        dtype=info.dtype, max_model_len=info.max_model_len, kv_cache_gib=settings.kv_cache_gib,
        prefix_caching=True, timeout_s=settings.batch_timeout_s, batched=True,
        # Our quiet import settings must not reach the vLLM log.
        env={"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
             "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "INFO")},
    )
    progress, batch_size = settings.progress, settings.batch_size
    n_chunks = summary.chunks_to_write
    bar = tqdm(total=len(pending), unit="input", desc="warm-up", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    if progress:
        bar.write(f"starting the vLLM producer for {len(pending)} inputs, {summary.prompt_tokens} prompt tokens, "
                  f"{n_chunks} chunks to write (log: {work / 'vllm' / 'vllm.log'})", file=sys.stderr)
    sent: list[WarmupInput] = []
    tokens = 0
    busy = 0.0
    t_first = t_end = None
    try:
        with Instance(spec, work / "vllm") as inst:
            try:
                for batch in batches(pending, batch_size):
                    t0 = time.monotonic()
                    results = inst.run([i.token_ids for i in batch], [i.cache_salt for i in batch])
                    t1 = time.monotonic()
                    if t_first is None:
                        t_first = t0
                        # The first batch also waited for vLLM to start.
                        summary.startup_s = max((t1 - t0) - sum(r.ttft_s for r in results), 0.0)
                    busy += sum(r.ttft_s for r in results)
                    sent.extend(batch)
                    tokens += sum(len(i.token_ids) for i in batch)
                    bar.update(len(batch))
                    bar.set_postfix(tokens=tokens, chunks=read_offline(run_dir).count(STORED, tier="store"),
                                    refresh=True)
                t_end = time.monotonic()
            except RuntimeError as e:
                summary.error = f"the vLLM producer failed: {str(e).splitlines()[0]} (see {inst.log_path})"
            try:
                inst.stop()
            except RuntimeError as e:
                summary.error = summary.error or f"the vLLM producer did not exit cleanly: {str(e).splitlines()[0]}"
        stats = read_offline(run_dir) if run_dir.exists() else MetricsSnapshot()
        bar.set_postfix(tokens=tokens, chunks=stats.count(STORED, tier="store"), refresh=True)
    finally:
        bar.close()
    summary.chunks_written = stats.count(STORED, tier="store")
    summary.bytes_written = stats.count("vllm:lmcm_written_bytes", tier="store")
    summary.store_put_failures = stats.count("vllm:lmcm_write_errors", tier="store")

    summary.durable_s = verify(summary, pending, sent, client, settings.verify_timeout_s)
    summary.prompt_tokens = tokens
    if t_first is not None:
        end = t_end if t_end is not None else time.monotonic()
        summary.warm_s = max(end - t_first - summary.startup_s, busy) + summary.durable_s
        summary.prompt_tokens_per_s = tokens / summary.warm_s if summary.warm_s > 0 else 0.0


def verify(summary: WarmupSummary, pending: list[WarmupInput], sent: list[WarmupInput], client: StoreClient,
           timeout_s: float) -> float:
    """Durability: wait up to ``timeout_s`` for every chunk of ``sent`` to be in the store; mark each
    pending input "done" or "failed". Returns the seconds it took."""
    t_v = time.monotonic()
    names = list(dict.fromkeys(n for i in sent for n in i.names))
    present = exists(client, names)
    deadline = time.monotonic() + timeout_s
    # The last batch's writes are still landing when its requests return: poll soon, then
    # back off (a fixed 0.5 s sleep added up to half a second to every warm-up).
    pause = 0.01
    while not all(present.values()) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
        present.update(exists(client, [n for n, ok in present.items() if not ok]))
    summary.chunks_missing_after = sum(not ok for ok in present.values())
    sent_ids = {id(i) for i in sent}
    for i in pending:
        if id(i) in sent_ids and all(present[n] for n in i.names):
            i.status = "done"
        else:
            i.status = "failed"
    return time.monotonic() - t_v
