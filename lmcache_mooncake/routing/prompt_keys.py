"""A request's chunk keys, named exactly as the connector's worker names them.

Token ids come from vLLM's own renderer
(:class:`lmcache_mooncake.warmup.rendering.PromptRenderer`, what vLLM's
OpenAI server runs), the namespace from
:func:`lmcache_mooncake.warmup.planning.key_namespace` (which hands the
model's shape to :func:`lmcache_mooncake.chunks.keys.namespace_for`, as the worker
does) and the keys from :func:`lmcache_mooncake.chunks.keys.chunk_keys`. So the
proxy's routing and store checks and the workers' caching cannot disagree on a
name, as long as the proxy is given the model, ``--dtype`` and cache
configuration the instances run with.

:class:`StoreCoverage` answers how many leading tokens of a prompt the
Mooncake Store holds, with one ``batch_exists`` call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_mooncake.chunks import keys

if TYPE_CHECKING:
    from lmcache_mooncake.config import CacheConfig
    from lmcache_mooncake.store.client import StoreClient

logger = logging.getLogger("lmcache_mooncake.routing.proxy")


@dataclass(frozen=True)
class PromptKeySpec:
    """What the instances serve, as far as chunk names depend on it."""

    #: Model folder (or name) the instances were started with.
    model: str
    #: vLLM's ``--dtype`` of the instances (the KV dtype enters the namespace).
    dtype: str = "auto"
    #: The instances' cache configuration file (chunk size, model id, store); None: the defaults.
    config_file: str | None = None
    #: Folder of the store started by ``lmcache-mooncake store up`` (overrides the config's).
    store_dir: str | None = None


@dataclass(frozen=True)
class PromptKeys:
    """A request's tokens and chunk keys."""

    tokens: list[int]
    keys: list[keys.ChunkKey]

    @property
    def digests(self) -> list[bytes]:
        return [k.digest for k in self.keys]


class PromptKeyer:
    """Tokenizes requests and names their chunks. Building it loads the tokenizer (seconds).

    Calls are synchronous and not thread-safe: the proxy runs them on one worker thread.
    """

    def __init__(self, spec: PromptKeySpec):
        from lmcache_mooncake.config import load_config
        from lmcache_mooncake.warmup.planning import key_namespace
        from lmcache_mooncake.warmup.rendering import PromptRenderer

        overrides: dict[str, Any] = {}
        if spec.store_dir is not None:
            overrides["mooncake"] = {"store_dir": spec.store_dir}
        self.spec = spec
        self.config: CacheConfig = load_config(spec.config_file, overrides=overrides)
        self.renderer = PromptRenderer(spec.model, dtype=spec.dtype)
        self.namespace = key_namespace(self.renderer.info, self.config)
        self.served_model_name = self.renderer.info.served_model_name

    def tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the instance will see them; None for what this cannot
        render alike (a batch of prompts, a request vLLM would reject)."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        try:
            if path.endswith("/chat/completions"):
                return self.renderer.chat(body["messages"], cache_salt=salt)
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return [int(t) for t in prompt]
            if isinstance(prompt, str):
                return self.renderer.text(prompt, cache_salt=salt)
        except Exception as e:  # noqa: BLE001 - the instance will give the client the real error
            logger.debug("cannot tokenize a %s request here (%s); routing it without keys", path, e)
        return None

    def keys_for(self, path: str, body: dict[str, Any]) -> PromptKeys | None:
        """Tokens and chunk keys of the request, or None (see :meth:`tokens`)."""
        tokens = self.tokens(path, body)
        if tokens is None:
            return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        model = body.get("model")
        # A model name other than the served one is a LoRA adapter: its name enters the keys.
        lora = model if isinstance(model, str) and model != self.served_model_name else None
        return PromptKeys(tokens, keys.chunk_keys(self.namespace, tokens, salt, lora,
                                                  include_partial=self.config.save_unfull_chunk))

    def close(self) -> None:
        self.renderer.close()


class StoreCoverage:
    """How many leading tokens of a prompt the Mooncake Store holds."""

    def __init__(self, client: StoreClient, namespace: keys.KeyNamespace):
        self.client = client
        self.namespace = namespace

    @classmethod
    def connect(cls, config: CacheConfig, namespace: keys.KeyNamespace) -> StoreCoverage:
        """Attach to the store of ``config.mooncake`` (lazily: an unreachable store covers nothing)."""
        from lmcache_mooncake.engine import store_endpoint
        from lmcache_mooncake.store.client import StoreClient

        mc = config.mooncake
        if mc is None:
            raise ValueError("the cache configuration has no 'mooncake:' section: there is no store to ask")
        # Existence checks only: a small staging region.
        client = StoreClient.from_config(mc, store_endpoint(mc), local_buffer_bytes=1 << 20, require=False)
        return cls(client, namespace)

    def covered_tokens(self, chunk_keys: Sequence[keys.ChunkKey]) -> int:
        """Tokens of the longest run of leading chunks the store holds (0 on any failure)."""
        if not chunk_keys:
            return 0
        names = [keys.object_name(self.namespace, k) for k in chunk_keys]
        covered = 0
        for key, present in zip(chunk_keys, self.client.batch_exists(names), strict=True):
            if not present:
                break
            covered = key.end
        return covered

    def close(self) -> None:
        self.client.close()
