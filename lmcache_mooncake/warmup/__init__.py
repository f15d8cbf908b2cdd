"""``lmcache-mooncake warmup``: compute prompts once and leave their KV chunks in the shared store.

Before real traffic arrives (a system prompt every chat starts with, documents
users will ask about, few-shot examples), run them through one vLLM producer
so that every decode instance finds their chunks in the Mooncake Store:

    lmcache-mooncake warmup --model MODEL --config configs/prefill.yaml --input prompts.jsonl

What it does, in order:

1. **Reads and renders the inputs in this process**, with vLLM's own request
   rendering (:class:`PromptRenderer`: the ``OnlineRenderer`` of vLLM's OpenAI
   server, built without an engine, as vLLM's CPU-only render server builds
   it). A ``messages`` line becomes exactly the token ids
   ``/v1/chat/completions`` gives the same messages (the model's chat
   template, ``add_generation_prompt=True``); a ``prompt`` line and a ``.txt``
   document become what ``/v1/completions`` gives that text (special tokens
   added as the tokenizer does by default); ``prompt_token_ids`` are used as
   given. Bad inputs are reported as ``path:line: what; what to do``.
2. **Computes every input's chunk keys** exactly as the connector's worker
   will (:func:`key_namespace`, :func:`object_names`) and asks the store which
   objects it already holds. An input whose chunks are all there is skipped,
   so a warm-up that was interrupted or is run again only writes what is
   missing (a second run of the same inputs writes nothing and says so).
3. **Starts one vLLM producer** (``kv_role: kv_producer``, ``max_tokens=1``) in
   a child process (:class:`lmcache_mooncake.testing.offline.Instance`) and sends it
   the remaining inputs, ``batch_size`` at a time, each batch as one
   ``generate`` call that vLLM schedules together (so one request's chunks
   are written while the next ones compute). The producer holds each
   request until its chunks are written to every tier.
4. **Verifies durability**: after the producer has exited, every expected
   object name must exist in the store (polled up to ``verify_timeout_s``). An
   input is reported done only then; anything else is counted as failed. Our
   chunk objects are verified on every read, so a half-written object can
   never be served as a chunk either.

Keys depend on the model id (``model_id`` of the config, else the ``--model``
string exactly as given to vLLM, or its ``--served-model-name``), the KV dtype
(``--dtype``), the model shape, ``chunk_size`` and ``cache_salt``: warm up with
the same values the serving instances use.
The package, one module per job:

- :mod:`~lmcache_mooncake.warmup.inputs`: reading inputs, naming bad ones;
- :mod:`~lmcache_mooncake.warmup.rendering`: vLLM's own prompt rendering;
- :mod:`~lmcache_mooncake.warmup.planning`: object names (from
  :mod:`lmcache_mooncake.chunks.keys`) and which chunks the store lacks;
- :mod:`~lmcache_mooncake.warmup.producer`: the vLLM producer and the
  durability check;
- :mod:`~lmcache_mooncake.warmup.run`: :func:`warmup`, which runs them in order;
- :mod:`~lmcache_mooncake.warmup.summary`: errors, inputs and the summary;
- :mod:`~lmcache_mooncake.warmup.cli`: the command.
"""

from lmcache_mooncake.warmup.inputs import read_inputs
from lmcache_mooncake.warmup.planning import key_namespace, object_names
from lmcache_mooncake.warmup.rendering import ModelInfo, PromptRenderer, get_renderer
from lmcache_mooncake.warmup.run import warmup
from lmcache_mooncake.warmup.summary import (
    BadInputError,
    InputProblem,
    WarmupError,
    WarmupInput,
    WarmupSummary,
)


def main_warmup(argv: list[str] | None = None) -> int:
    """``lmcache-mooncake warmup ARGV``."""
    from lmcache_mooncake.warmup.cli import main_warmup as main

    return main(argv)


__all__ = [
    "BadInputError",
    "InputProblem",
    "ModelInfo",
    "PromptRenderer",
    "WarmupError",
    "WarmupInput",
    "WarmupSummary",
    "get_renderer",
    "key_namespace",
    "main_warmup",
    "object_names",
    "read_inputs",
    "warmup",
]
