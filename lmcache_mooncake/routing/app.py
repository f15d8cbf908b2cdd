"""The proxy as an ASGI app: its endpoints, and the HTTP client and health watcher its lifespan runs.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (prefill, then
decode: :meth:`~lmcache_mooncake.routing.router.Router.completion`), ``GET
/v1/models`` (from a decode instance), ``GET /health`` (200 when a prefill and
a decode instance answer) and ``GET /stats`` (counters, instance states).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmcache_mooncake.routing.prompt_keys import PromptKeyer, StoreCoverage
from lmcache_mooncake.routing.router import ProxyConfig, Router

__all__ = ["build_app"]

# The proxy's one logger name, whichever of its modules logs.
logger = logging.getLogger("lmcache_mooncake.routing.proxy")


def build_app(prefill_urls: list[str], decode_urls: list[str], config: ProxyConfig | None = None, *,
              keyer: PromptKeyer | None = None, coverage: StoreCoverage | None = None) -> FastAPI:
    """The proxy as a FastAPI app.

    ``keyer`` (the model's tokenizer and chunk naming) enables prefix routing and direct
    decode; ``coverage`` (a store client) lets direct decode count what the store holds.
    Both are closed by the app's shutdown. Raises ``ValueError`` for a bad URL or an empty role.
    """
    config = config or ProxyConfig()
    router = Router(prefill_urls, decode_urls, config, keyer, coverage)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.client = httpx.AsyncClient(
            timeout=router.timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,  # talk to the instances directly, never through an HTTP(S)_PROXY
        )
        watcher = asyncio.ensure_future(router.watch_health())
        logger.info("proxy up: prefill %s, decode %s, routing %s%s, direct decode %s",
                    ", ".join(router.prefill.urls), ", ".join(router.decode.urls), config.routing,
                    "" if keyer else " (no --model: without chunk keys, round-robin)",
                    "off" if config.direct_decode_max_uncached is None or keyer is None
                    else f"at most {config.direct_decode_max_uncached} uncached tokens")
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            client, router.client = router.client, None
            await client.aclose()
            router.close()
            for part in (keyer, coverage):
                if part is not None:
                    part.close()

    app = FastAPI(title="lmcache-mooncake prefill/decode proxy", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.completion(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.completion(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/stats")
    async def stats() -> Response:
        return JSONResponse(router.stats())

    return app
