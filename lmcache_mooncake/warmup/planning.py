"""Which chunks a warm-up must write: names from :mod:`lmcache_mooncake.chunks.keys`, presence from the store.

Names are never derived here: :func:`key_namespace` hands the model's shape to
:func:`lmcache_mooncake.chunks.keys.namespace_for`, the function the connector's
worker calls with the shape of its KV tensors, and :func:`object_names` is
:func:`lmcache_mooncake.chunks.keys.object_names`, the names the Mooncake tier uses.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lmcache_mooncake.warmup.rendering import ModelInfo
from lmcache_mooncake.warmup.summary import WarmupError, WarmupInput, WarmupSummary

if TYPE_CHECKING:
    from lmcache_mooncake.chunks.keys import KeyNamespace
    from lmcache_mooncake.config import CacheConfig
    from lmcache_mooncake.store.client import StoreClient

#: Names per ``batch_exists`` call.
EXISTS_BATCH = 1024


# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------


def key_namespace(info: ModelInfo, cfg: CacheConfig, model_id: str | None = None, *,
                  tp_size: int = 1, tp_rank: int = 0) -> KeyNamespace:
    """The namespace the connector's worker derives for this model and config.

    The worker builds it from its KV cache tensors: dtype, layer count, KV heads,
    head size and the chunk layout its attention backend keeps (from
    ``info.kv_backend`` and ``info.block_size`` here), with the model id of
    ``model_id`` / ``cfg.model_id`` / vLLM's served model name. With ``tp_size`` > 1 it is the namespace of worker
    ``tp_rank``, whose tensors hold ``num_kv_heads // tp_size`` heads (at least
    one, as vLLM splits them). The warm-up command itself runs its producer
    with tensor parallel size 1, so it writes and checks the TP 1 namespace.
    """
    from lmcache_mooncake.chunks.keys import model_identity, namespace_for
    from lmcache_mooncake.kv.layouts import chunk_layout_for

    return namespace_for(
        model_identity(model_id or cfg.model_id, info.served_model_name),
        info.dtype, info.num_layers, max(1, info.num_kv_heads // tp_size), info.head_size, cfg.chunk_size,
        tp_size=tp_size, tp_rank=tp_rank,
        chunk_layout=chunk_layout_for(info.kv_backend, info.dtype, info.block_size, info.head_size, cfg.chunk_size),
    )


def object_names(namespace: KeyNamespace, tokens: Sequence[int], cache_salt: str | None = None,
                 include_partial: bool = True) -> list[str]:
    """Store object names of the chunks of ``tokens``, as the Mooncake tier names them."""
    from lmcache_mooncake.chunks import keys

    return keys.object_names(namespace, tokens, cache_salt, include_partial=include_partial)


def chunk_bytes(info: ModelInfo, tokens: int) -> int:
    """Bytes of a stored chunk of ``tokens`` tokens (payload plus an estimated header)."""
    import torch

    itemsize = torch.empty((), dtype=getattr(torch, info.dtype)).element_size()
    return 2 * info.num_layers * tokens * info.num_kv_heads * info.head_size * itemsize + 400


def name_inputs(good: list[WarmupInput], ns: KeyNamespace, include_partial: bool) -> list[WarmupInput]:
    """Give every input its object names; mark repeats "duplicate" and inputs with no chunk
    "nothing_to_store". Returns the inputs still pending, in order."""
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    for item in good:
        key = (item.cache_salt, tuple(item.token_ids))
        if key in seen:
            item.status = "duplicate"
            continue
        seen.add(key)
        item.names = object_names(ns, item.token_ids, item.cache_salt, include_partial=include_partial)
        if not item.names:
            item.status = "nothing_to_store"
    return [i for i in good if i.status == "pending"]


def mark_present(summary: WarmupSummary, unique: list[WarmupInput], present: dict[str, bool],
                 ns: KeyNamespace, info: ModelInfo) -> list[WarmupInput]:
    """Count what the store holds, mark inputs whose chunks are all there "skipped" and estimate
    the bytes to write. Returns the inputs that still need the producer."""
    all_names = list(present)
    summary.chunks_present_before = sum(present.values())
    missing = [n for n in all_names if not present[n]]
    summary.chunks_to_write = len(missing)
    # Tokens per missing chunk: chunk_size, or less for a prompt's partial last chunk.
    sizes = dict.fromkeys(missing, ns.chunk_size)
    for i in unique:
        i.present_before = sum(present[n] for n in i.names)
        if i.present_before == len(i.names):
            i.status = "skipped"
        elif len(i.token_ids) % ns.chunk_size and i.names[-1] in sizes:
            sizes[i.names[-1]] = len(i.token_ids) % ns.chunk_size
    summary.bytes_estimate = sum(chunk_bytes(info, t) for t in sizes.values())
    pending = [i for i in unique if i.status == "pending"]
    summary.prompt_tokens = sum(len(i.token_ids) for i in pending)
    return pending


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_stderr(log_path: Path | None) -> Iterator[None]:
    """Send file descriptor 2 to ``log_path`` (Mooncake's native logging writes there) for the block."""
    if log_path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log_path, "ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def connect(cfg: CacheConfig, log_path: Path | None) -> StoreClient:
    """A client of the store in ``cfg.mooncake``; :class:`WarmupError` if there is none or it cannot be reached."""
    from lmcache_mooncake.engine import store_endpoint
    from lmcache_mooncake.store.client import StoreClient
    from lmcache_mooncake.store.errors import StoreError

    mc = cfg.mooncake
    if mc is None:
        raise WarmupError("the configuration has no 'mooncake:' section: there is no store to warm")
    try:
        endpoint = store_endpoint(mc)
        with quiet_stderr(log_path):
            # Existence checks only: a small staging region, and patience with a busy store.
            return StoreClient.from_config(mc, endpoint, local_buffer_bytes=1 << 20,
                                           timeout_s=max(mc.timeout, 5.0), connect_timeout_s=15.0)
    except StoreError as e:
        raise WarmupError(str(e)) from e


def exists(client: StoreClient, names: Sequence[str]) -> dict[str, bool]:
    """``{name: in the store}`` for every distinct name, asked in batches of :data:`EXISTS_BATCH`."""
    out: dict[str, bool] = {}
    names = list(dict.fromkeys(names))
    for i in range(0, len(names), EXISTS_BATCH):
        part = names[i : i + EXISTS_BATCH]
        out.update(zip(part, client.batch_exists(part), strict=True))
    return out
