"""What the scheduler side tells the worker side each step.

Built by :meth:`SchedulerSide.build_connector_meta` in the EngineCore process,
pickled by vLLM to the worker processes, read by :class:`WorkerSide`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadOp:
    """Load chunks covering tokens ``[start, end)`` of ``token_ids`` into paged KV.

    ``token_ids`` runs to the end of the last chunk that holds ``end - 1`` (a
    chunk's key covers all its tokens); ``slots`` has one entry per token of
    ``[0, end)``. Tokens before ``start`` are already in vLLM's KV and are not
    written; tokens from ``end`` on are computed by vLLM and not written either.
    ``asynchronous``: vLLM holds the request until the worker reports the load
    finished (``get_finished``); otherwise the load completes in ``start_load_kv``.
    """

    req_id: str
    token_ids: list[int]
    slots: list[int]
    start: int
    end: int
    block_ids: list[int]
    cache_salt: str | None = None
    lora: str | None = None
    asynchronous: bool = False


@dataclass
class SaveOp:
    """Store the prompt ``token_ids`` (all computed now) from paged KV.

    Chunks wholly before ``skip`` are already stored and are not copied.
    """

    req_id: str
    token_ids: list[int]
    slots: list[int]
    skip: int
    cache_salt: str | None = None
    lora: str | None = None


@dataclass
class StepMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    #: vLLM scheduled no tokens this step (every request waits, e.g. for its load):
    #: the worker then runs this step's asynchronous loads in the step itself.
    idle: bool = False


def slots_for(block_ids: list[int], block_size: int, num_tokens: int) -> list[int]:
    """Slot of each of the first ``num_tokens`` tokens of a request."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_size}")
    return [block_ids[i // block_size] * block_size + i % block_size for i in range(num_tokens)]
