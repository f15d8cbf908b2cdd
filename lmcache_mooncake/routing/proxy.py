"""OpenAI-compatible router for prefill/decode disaggregation.

Every ``/v1/completions`` and ``/v1/chat/completions`` request is read and
checked first (:mod:`lmcache_mooncake.routing.intake`: size limit, body read
timeout, JSON, required fields; a client's own ``kv_transfer_params`` are
removed). Then it goes to a prefill instance as a one-token, non-streaming
request, so that instance computes the prompt's KV cache and stores its chunks
(LMCache tiers / Mooncake Store). The original request then goes to a decode
instance, which finds the prompt's chunks and only generates; its answer (JSON
or an SSE stream, passed through as it arrives) goes back to the client. Only
a ``kv_transfer_params`` object the prefill answered is copied into the decode
request.

With the model's tokenizer (a :class:`~lmcache_mooncake.routing.prompt_keys.PromptKeyer`)
the proxy names the prompt's chunks as the workers do. It then routes by
prefix (:mod:`lmcache_mooncake.routing.placement`: same first chunk, same
instance, within a load bound) and, with a store client
(:class:`~lmcache_mooncake.routing.prompt_keys.StoreCoverage`), sends a request
whose prompt the store (nearly) holds straight to decode, skipping the prefill
round trip (:attr:`ProxyConfig.direct_decode_max_uncached`).

Failures never hang the client: an unreachable instance, a timeout, an upstream
error or a stream that breaks mid-way becomes an OpenAI-style error
(``{"error": {"message", "type", "param", "code"}}``; for a broken stream, a
last ``data: {"error": ...}`` SSE event). A connection error before anything
was sent is retried on the next instance of the same role and takes the
instance out of rotation until its ``/health`` answers again
(:mod:`lmcache_mooncake.routing.pool`: checks with back-off).

Run it with ``lmcache-mooncake proxy --prefill URL... --decode URL... --port P``
or serve :func:`build_app` with any ASGI server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from lmcache_mooncake.routing.errors import (
    DIED,
    RETRYABLE,
    UpstreamError,
    error_payload,
    error_response,
    exception_error,
    sse_error,
    status_error,
)
from lmcache_mooncake.routing.intake import (
    IntakeError,
    IntakeLimits,
    parse_request,
    read_body,
    strip_client_fields,
)
from lmcache_mooncake.routing.placement import choose, make_placement
from lmcache_mooncake.routing.pool import HealthPolicy, Instance, InstancePool
from lmcache_mooncake.routing.prompt_keys import PromptKeyer, PromptKeys, StoreCoverage

logger = logging.getLogger("lmcache_mooncake.routing.proxy")

T = TypeVar("T")

# Request headers passed on to the instances.
_FORWARD_HEADERS = ("authorization",)
_SSE_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")


def normalize_url(url: str) -> str:
    """``host:port``, ``http://host:port/`` or ``http://host:port/v1`` -> ``http://host:port``."""
    u = url.strip()
    if "://" not in u:
        u = "http://" + u
    try:
        parsed = httpx.URL(u)
    except (httpx.InvalidURL, ValueError) as e:
        raise ValueError(f"instance URL {url!r} is not a valid URL: {e}") from e
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"instance URL {url!r}: only http:// and https:// are supported")
    if not parsed.host:
        raise ValueError(f"instance URL {url!r} has no host")
    u = u.rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


def _event_end(buf: bytes) -> int:
    """Index just past the last complete SSE event in ``buf`` (0 if none)."""
    end = 0
    for sep in _SSE_EVENT_ENDS:
        i = buf.rfind(sep)
        if i >= 0:
            end = max(end, i + len(sep))
    return end


async def _race_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (so the instance aborts too)."""
    task = asyncio.ensure_future(work)

    async def _wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(_wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise UpstreamError(499, "client disconnected", "client_closed_request")
    return task.result()


@dataclass(frozen=True)
class ProxyConfig:
    """How the proxy talks to clients and instances and routes between them."""

    #: Seconds each read from an instance may take (for a non-streaming request, the whole
    #: generation; for a stream, the gap between chunks); past it the client gets 504.
    timeout_s: float = 600.0
    #: Seconds to open a connection to an instance, after which the next one is tried.
    connect_timeout_s: float = 5.0
    #: What a client may send (body size, body read time).
    limits: IntakeLimits = field(default_factory=IntakeLimits)
    #: How instances are watched (health checks with back-off).
    health: HealthPolicy = field(default_factory=HealthPolicy)
    #: "prefix" (rendezvous hashing of the first chunk key; round-robin for requests the proxy
    #: cannot tokenize, and for all requests when it has no model) or "round-robin".
    routing: str = "prefix"
    #: Requests in flight on the preferred instance past which a request goes to the least loaded one.
    max_outstanding: int = 8
    #: Send a request straight to decode (no prefill) when at most this many of its prompt
    #: tokens are missing from the store; None never does. Needs the model (tokens).
    direct_decode_max_uncached: int | None = None

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be positive")
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding={self.max_outstanding} must be at least 1")
        if self.direct_decode_max_uncached is not None and self.direct_decode_max_uncached < 0:
            raise ValueError(f"direct_decode_max_uncached={self.direct_decode_max_uncached} must be >= 0")
        make_placement(self.routing)  # raises for an unknown name


class _Lease:
    """One request outstanding on one instance; :meth:`release` is idempotent."""

    def __init__(self, pool: InstancePool, inst: Instance):
        self.pool, self.inst, self._open = pool, inst, True
        pool.begin(inst)

    def release(self) -> None:
        if self._open:
            self._open = False
            self.pool.end(self.inst)


class _Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], config: ProxyConfig,
                 keyer: PromptKeyer | None = None, coverage: StoreCoverage | None = None):
        self.config = config
        self.prefill = InstancePool("prefill", [normalize_url(u) for u in prefill_urls], config.health)
        self.decode = InstancePool("decode", [normalize_url(u) for u in decode_urls], config.health)
        # One placement per role: a round-robin turn is per role.
        self.placements = {pool.role: make_placement(config.routing) for pool in (self.prefill, self.decode)}
        self.keyer = keyer
        self.coverage = coverage
        self.timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self.health_timeout = httpx.Timeout(max(config.connect_timeout_s, 2.0), connect=config.connect_timeout_s)
        self.client: httpx.AsyncClient | None = None
        # One thread each: the tokenizer is not thread-safe; a store call may take its timeout.
        self._keys_thread = ThreadPoolExecutor(1, thread_name_prefix="lmcm-proxy-keys")
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="lmcm-proxy-store")
        self.counters = {"requests": 0, "direct_decode": 0, "via_prefill": 0, "tokenized": 0,
                         "client_kv_transfer_params_removed": 0}

    # -- plumbing -----------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the proxy's HTTP client is not running (app lifespan not started)")
        return self.client

    async def watch_health(self) -> None:
        """Check instances as their checks fall due, until cancelled."""
        client = self._client()
        while True:
            for pool in (self.prefill, self.decode):
                try:
                    changed = await pool.check_due(client)
                except Exception:  # noqa: BLE001 - a bug here must not stop the watching
                    logger.exception("health check of the %s instances failed", pool.role)
                    continue
                for inst, up in changed:
                    if up:
                        logger.info("%s instance %s is healthy again; routing to it", pool.role, inst.url)
                    else:
                        logger.warning("%s instance %s is down (%s); next check in %.1fs", pool.role,
                                       inst.url, inst.last_error, inst.backoff_s)
            await asyncio.sleep(0.2)

    def _order(self, pool: InstancePool, digests: list[bytes]) -> list[Instance]:
        return choose(self.placements[pool.role].rank(digests, pool.instances), self.config.max_outstanding)

    async def _send(self, pool: InstancePool, order: list[Instance], method: str, path: str, *,
                    headers: dict[str, str], body: dict[str, Any] | None = None,
                    stream: bool = False) -> tuple[_Lease, httpx.Response]:
        """Send to the first of ``order``; on a connection error mark it down and try the next.

        Returns (a lease on the instance, its response) for any HTTP status; the caller releases
        the lease when the answer is over. Raises UpstreamError otherwise.
        """
        client = self._client()
        last: UpstreamError | None = None
        for inst in order:
            req = client.build_request(method, inst.url + path, json=body, headers=headers, timeout=self.timeout)
            lease = _Lease(pool, inst)
            try:
                return lease, await client.send(req, stream=stream)
            except (*RETRYABLE, *DIED) as e:
                lease.release()
                last = exception_error(pool.role, inst.url, e)
                if isinstance(e, RETRYABLE):
                    # Refused: down until its /health answers. A connection closed under a request
                    # may be a stale keep-alive one; the next request or health check tells.
                    pool.mark_down(inst, f"{type(e).__name__}")
                logger.warning("%s; trying the next %s instance", last.message, pool.role)
            except httpx.HTTPError as e:
                lease.release()
                raise exception_error(pool.role, inst.url, e) from e
            except BaseException:
                lease.release()
                raise
        if last is None:  # the pool has no instances: build_app refuses that, so this is a bug
            raise UpstreamError(503, f"no {pool.role} instance is configured", "service_unavailable")
        if len(order) > 1:
            last.message = f"no {pool.role} instance is reachable (last: {last.message})"
        raise last

    async def _post_json(self, pool: InstancePool, order: list[Instance], path: str, body: dict[str, Any],
                         headers: dict[str, str]) -> tuple[str, httpx.Response]:
        lease, resp = await self._send(pool, order, "POST", path, headers=headers, body=body)
        lease.release()  # not streamed: the whole answer is in
        url = lease.inst.url
        if resp.status_code >= 400:
            raise status_error(pool.role, url, resp.status_code, resp.content,
                                resp.headers.get("content-type"))
        return url, resp

    async def _prompt(self, path: str, body: dict[str, Any]) -> tuple[PromptKeys | None, int | None]:
        """The request's chunk keys (None if the proxy cannot tokenize it) and how many of its
        leading tokens the store holds (None when not asked)."""
        if self.keyer is None:
            return None, None
        loop = asyncio.get_running_loop()
        pk = await loop.run_in_executor(self._keys_thread, self.keyer.keys_for, path, body)
        if pk is None:
            return None, None
        self.counters["tokenized"] += 1
        if self.coverage is None or self.config.direct_decode_max_uncached is None:
            return pk, None
        if len(pk.tokens) <= self.config.direct_decode_max_uncached:
            return pk, 0  # short enough whatever the store holds
        covered = await loop.run_in_executor(self._store_thread, self.coverage.covered_tokens, pk.keys)
        return pk, covered

    def _goes_direct(self, pk: PromptKeys | None, covered: int | None) -> bool:
        limit = self.config.direct_decode_max_uncached
        if pk is None or limit is None:
            return False
        return len(pk.tokens) - (covered or 0) <= limit

    # -- endpoints ----------------------------------------------------------------------------

    async def completion(self, request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        try:
            body = parse_request(await read_body(request, self.config.limits), path)
        except IntakeError as e:
            logger.warning("req %s %s refused: HTTP %d %s", request_id, path, e.status, e.message)
            return JSONResponse({"error": {"message": e.message, "type": e.err_type, "param": e.param,
                                           "code": e.status}},
                                status_code=e.status, headers={"X-Request-Id": request_id})
        body, removed = strip_client_fields(body)
        if removed:
            self.counters["client_kv_transfer_params_removed"] += 1
            logger.info("req %s: removed client-supplied %s", request_id, ", ".join(removed))
        self.counters["requests"] += 1
        headers = {"X-Request-Id": request_id}
        for h in _FORWARD_HEADERS:
            if h in request.headers:
                headers[h] = request.headers[h]
        stream = body.get("stream") is True
        route = f"req {request_id} {path} stream={stream}"
        try:
            pk, covered = await _race_disconnect(request, self._prompt(path, body))
        except UpstreamError as e:
            return e.response(request_id)
        digests = pk.digests if pk is not None else []
        decode_body = dict(body)
        if self._goes_direct(pk, covered):
            self.counters["direct_decode"] += 1
            route += f" direct (prompt {len(pk.tokens)} tokens, {covered or 0} in the store)" if pk else " direct"
            t_prefill = 0.0
            p_url = "skipped"
        else:
            self.counters["via_prefill"] += 1
            try:
                p_url, kv_params = await self._prefill(request, path, body, headers, digests)
            except UpstreamError as e:
                logger.warning("%s: prefill failed after %.3fs: HTTP %d %s", route, time.perf_counter() - t0,
                               e.status, e.message)
                return e.response(request_id)
            t_prefill = time.perf_counter() - t0
            if kv_params is not None:
                decode_body["kv_transfer_params"] = kv_params
            route += f" prefill={p_url} ({t_prefill:.3f}s, kv_transfer_params={'yes' if kv_params else 'no'})"

        # 2. Decode: the original request.
        order = self._order(self.decode, digests)
        if not stream:
            try:
                d_url, d_resp = await _race_disconnect(request, self._post_json(self.decode, order, path,
                                                                                decode_body, headers))
            except UpstreamError as e:
                logger.warning("%s: decode failed after %.3fs: HTTP %d %s", route,
                               time.perf_counter() - t0, e.status, e.message)
                return e.response(request_id)
            logger.info("%s decode=%s (%.3fs), total %.3fs, HTTP %d", route, d_url,
                        time.perf_counter() - t0 - t_prefill, time.perf_counter() - t0, d_resp.status_code)
            return Response(d_resp.content, status_code=d_resp.status_code,
                            media_type=d_resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": request_id, "X-Decode-Instance": d_url,
                                     "X-Prefill-Instance": p_url})

        try:
            lease, d_resp = await _race_disconnect(request, self._send(self.decode, order, "POST", path,
                                                                       headers=headers, body=decode_body,
                                                                       stream=True))
        except UpstreamError as e:
            logger.warning("%s: decode failed after %.3fs: HTTP %d %s", route, time.perf_counter() - t0,
                           e.status, e.message)
            return e.response(request_id)
        d_url = lease.inst.url
        if d_resp.status_code >= 400:
            try:
                err_body = await d_resp.aread()
            except httpx.HTTPError:
                err_body = b""
            finally:
                await d_resp.aclose()
                lease.release()
            e = status_error("decode", d_url, d_resp.status_code, err_body, d_resp.headers.get("content-type"))
            logger.warning("%s decode=%s failed after %.3fs: HTTP %d %s", route, d_url,
                           time.perf_counter() - t0, e.status, e.message)
            return e.response(request_id)
        route += f" decode={d_url}"

        async def finish() -> None:
            await d_resp.aclose()
            lease.release()

        # background: closes the upstream even if the client left before the relay started.
        return StreamingResponse(self._relay(d_resp, d_url, route, t0, lease), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": request_id, "X-Decode-Instance": d_url,
                                          "X-Prefill-Instance": p_url},
                                 background=BackgroundTask(finish))

    async def _prefill(self, request: Request, path: str, body: dict[str, Any], headers: dict[str, str],
                       digests: list[bytes]) -> tuple[str, dict[str, Any] | None]:
        """Run the prompt on a prefill instance (one token, no stream); returns its URL and the
        ``kv_transfer_params`` it answered (None if it gave none)."""
        prefill_body = dict(body)
        prefill_body["max_tokens"] = 1
        if path.endswith("/chat/completions") and "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)
        prefill_body.pop("min_tokens", None)  # would exceed max_tokens=1 and be rejected
        order = self._order(self.prefill, digests)
        p_url, p_resp = await _race_disconnect(request, self._post_json(self.prefill, order, path,
                                                                        prefill_body, headers))
        try:
            p_data = p_resp.json()
        except ValueError as e:
            raise UpstreamError(502, f"prefill instance {p_url} answered non-JSON: {e}", "upstream_error") from e
        kv_params = p_data.get("kv_transfer_params") if isinstance(p_data, dict) else None
        return p_url, kv_params if isinstance(kv_params, dict) else None

    async def _relay(self, resp: httpx.Response, url: str, route: str, t0: float,
                     lease: _Lease) -> AsyncIterator[bytes]:
        """Pass the decode SSE stream through, whole events as they arrive; end with an error event
        if the upstream breaks (a partial event at the break is dropped)."""
        buf = b""
        first: float | None = None
        outcome = "ok"
        try:
            async for chunk in resp.aiter_bytes():
                if first is None:
                    first = time.perf_counter() - t0
                buf += chunk
                end = _event_end(buf)
                if end:
                    out, buf = buf[:end], buf[end:]
                    yield out
            if buf:
                yield buf
        except httpx.HTTPError as e:
            err = exception_error("decode", url, e)
            err.message = f"stream broken: {err.message}"
            outcome = f"error: {err.message}"
            yield sse_error(err)
        except BaseException:
            outcome = "client went away"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            lease.release()
            level = logging.INFO if outcome == "ok" else logging.WARNING
            logger.log(level, "%s first byte %s, total %.3fs, stream %s", route,
                       f"{first:.3f}s" if first is not None else "-", time.perf_counter() - t0, outcome)

    async def models(self, request: Request) -> Response:
        t0 = time.perf_counter()
        headers = {h: request.headers[h] for h in _FORWARD_HEADERS if h in request.headers}
        client = self._client()
        problems = []
        for url in [i.url for i in self.decode.instances if i.up] + [i.url for i in self.decode.instances
                                                                        if not i.up]:
            try:
                resp = await client.get(url + "/v1/models", headers=headers, timeout=self.health_timeout)
            except httpx.HTTPError as e:
                problems.append(exception_error("decode", url, e).message)
                continue
            if resp.status_code == 200 or 400 <= resp.status_code < 500:
                logger.info("/v1/models from decode=%s (%.3fs), HTTP %d", url, time.perf_counter() - t0,
                            resp.status_code)
                return Response(resp.content, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type", "application/json"))
            problems.append(f"decode instance {url} answered HTTP {resp.status_code}")
        logger.warning("/v1/models: no decode instance answered: %s", "; ".join(problems))
        return error_response(503, "no decode instance answered /v1/models: " + "; ".join(problems),
                               "service_unavailable")

    async def _check(self, url: str) -> str:
        try:
            resp = await self._client().get(url + "/health", timeout=self.health_timeout)
        except httpx.HTTPError as e:
            return f"down ({type(e).__name__}: {e})" if str(e) else f"down ({type(e).__name__})"
        return "ok" if resp.status_code == 200 else f"down (HTTP {resp.status_code})"

    async def health(self) -> Response:
        t0 = time.perf_counter()
        pools = (self.prefill, self.decode)
        states = iter(await asyncio.gather(*(self._check(u) for pool in pools for u in pool.urls)))
        body: dict[str, Any] = {pool.role: {u: next(states) for u in pool.urls} for pool in pools}
        down = [f"{pool.role} {u}: {s}" for pool in pools for u, s in body[pool.role].items() if s != "ok"]
        missing = [pool.role for pool in pools if "ok" not in body[pool.role].values()]
        body = {"status": "unavailable" if missing else "ok", **body, "down": down}
        if not missing:
            logger.debug("/health ok (%.3fs); down: %s", time.perf_counter() - t0, "; ".join(down) or "none")
            return JSONResponse(body)
        logger.warning("/health unavailable (%.3fs); down: %s", time.perf_counter() - t0, "; ".join(down))
        message = " and ".join(f"no {role} instance is healthy" for role in missing) + "; down: " + "; ".join(down)
        body["error"] = error_payload(message, "service_unavailable", 503)["error"]
        return JSONResponse(body, status_code=503)


    def stats(self) -> dict[str, Any]:
        """What the proxy did: request counters and each instance's state and load."""
        return {"routing": self.config.routing, **self.counters,
                **{pool.role: {i.url: i.describe() for i in pool.instances} for pool in (self.prefill, self.decode)}}

    def close(self) -> None:
        self._keys_thread.shutdown(wait=False, cancel_futures=True)
        self._store_thread.shutdown(wait=False, cancel_futures=True)


def build_app(prefill_urls: list[str], decode_urls: list[str], config: ProxyConfig | None = None, *,
              keyer: PromptKeyer | None = None, coverage: StoreCoverage | None = None) -> FastAPI:
    """The proxy as a FastAPI app.

    ``keyer`` (the model's tokenizer and chunk naming) enables prefix routing and direct
    decode; ``coverage`` (a store client) lets direct decode count what the store holds.
    Both are closed by the app's shutdown. Raises ``ValueError`` for a bad URL or an empty role.
    """
    config = config or ProxyConfig()
    router = _Router(prefill_urls, decode_urls, config, keyer, coverage)

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


_PROXY_DESCRIPTION = """\
OpenAI-compatible router for prefill/decode disaggregation.

Each /v1/completions or /v1/chat/completions request goes first to a prefill
instance with max_tokens=1 and stream=false, which computes the prompt's KV
cache and stores its chunks; then the original request goes to a decode
instance, which loads those chunks and generates. Streams are passed through as
they arrive. Only the kv_transfer_params the prefill answered go to decode; a
client's own are removed.

Routing (--routing prefix, the default, needs --model): requests whose prompts
share their first chunk go to the same instance of each role (rendezvous
hashing of the chunk key the connector names it by), unless it has
--max-outstanding requests in flight (then: the least loaded instance).
Without --model, or with --routing round-robin: round-robin.

Direct decode (needs --model and --config with a mooncake: section): a request
whose prompt has at most --direct-decode-max-uncached tokens that the store
does not hold skips the prefill round trip.

Instances are health-checked; one that fails is left out (re-checked with
back-off) and taken back when its /health answers again. GET /health is 200
when at least one prefill and one decode instance answer; GET /stats shows the
counters and each instance's state and load. Requests over --max-body-bytes
get 413, a body that takes over --body-timeout seconds 408, invalid JSON or a
missing field 400.
"""

_PROXY_EPILOG = """\
example:
  lmcache-mooncake proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
      http://127.0.0.1:8201 --port 8000 --model /models/qwen --config configs/decode.yaml
  then point any OpenAI client at http://127.0.0.1:8000/v1
"""


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``proxy`` to the command line's subparsers."""
    p = subparsers.add_parser("proxy", help=help, description=_PROXY_DESCRIPTION, epilog=_PROXY_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   help="prefill vLLM instance(s), e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   help="decode vLLM instance(s), e.g. http://127.0.0.1:8200 (repeatable)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest wait for an instance's answer, or between two chunks of a stream "
                        "(default 600)")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="longest wait to connect to an instance before trying the next one (default 5)")
    p.add_argument("--max-body-bytes", type=int, default=IntakeLimits.max_body_bytes, metavar="BYTES",
                   help=f"largest request body accepted, else 413 (default {IntakeLimits.max_body_bytes})")
    p.add_argument("--body-timeout", type=float, default=IntakeLimits.read_timeout_s, metavar="SECONDS",
                   help=f"longest time a request body may take to arrive, else 408 "
                        f"(default {IntakeLimits.read_timeout_s:g})")
    p.add_argument("--routing", choices=["prefix", "round-robin"], default="prefix",
                   help="prefix: same first chunk, same instance (needs --model); round-robin (default prefix)")
    p.add_argument("--max-outstanding", type=int, default=ProxyConfig.max_outstanding, metavar="N",
                   help="requests in flight on the preferred instance past which a request goes to the "
                        f"least loaded one (default {ProxyConfig.max_outstanding})")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="the model the instances serve (its tokenizer names the chunks: prefix routing, "
                        "direct decode)")
    p.add_argument("--dtype", default="auto", help="the instances' vLLM --dtype (it enters chunk names)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the instances' cache configuration (chunk size, model id, store)")
    p.add_argument("--store-dir", default=None, metavar="DIR",
                   help="state folder of the store from 'lmcache-mooncake store up' (overrides the config's)")
    p.add_argument("--direct-decode-max-uncached", type=int, default=256, metavar="TOKENS",
                   help="skip prefill when at most this many prompt tokens are not in the store "
                        "(default 256; needs --model)")
    p.add_argument("--no-direct-decode", action="store_true", help="always go through a prefill instance")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default info)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``lmcache-mooncake proxy``: check the flags and serve the proxy with uvicorn."""
    from lmcache_mooncake.obs.logs import setup_logging

    p = args.parser
    if not 0 < args.port < 65536:
        p.error(f"--port {args.port} is not a valid port")
    direct = None if args.no_direct_decode else args.direct_decode_max_uncached
    try:
        config = ProxyConfig(timeout_s=args.timeout, connect_timeout_s=args.connect_timeout,
                             limits=IntakeLimits(args.max_body_bytes, args.body_timeout),
                             routing=args.routing, max_outstanding=args.max_outstanding,
                             direct_decode_max_uncached=direct)
        for u in (*args.prefill, *args.decode):
            normalize_url(u)
    except ValueError as e:
        p.error(str(e))
    setup_logging()
    logging.getLogger("lmcache_mooncake").setLevel(args.log_level.upper())
    keyer = coverage = None
    if args.model is not None:
        keyer, coverage = _prompt_parts(args, direct is not None)
    try:
        app = build_app(args.prefill, args.decode, config, keyer=keyer, coverage=coverage)
    except ValueError as e:
        p.error(str(e))

    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def _prompt_parts(args: argparse.Namespace, direct: bool) -> tuple[PromptKeyer, StoreCoverage | None]:
    """The tokenizer and chunk naming of ``--model``, and a store client when direct decode may use it."""
    from lmcache_mooncake.routing.prompt_keys import PromptKeySpec

    try:
        keyer = PromptKeyer(PromptKeySpec(args.model, args.dtype, args.config, args.store_dir))
    except Exception as e:  # noqa: BLE001 - any failure here is "cannot name this model's chunks"
        args.parser.error(f"--model {args.model}: cannot load its tokenizer and chunk naming: {e}")
    logger.info("chunk names: namespace %s (model %s, %s, chunk size %d)", keyer.namespace.hex()[:16],
                keyer.namespace.model, keyer.namespace.kv_dtype, keyer.namespace.chunk_size)
    coverage = None
    if direct and keyer.config.mooncake is not None:
        try:
            coverage = StoreCoverage.connect(keyer.config, keyer.namespace)
        except Exception as e:  # noqa: BLE001 - without the store, only short prompts go direct
            logger.warning("direct decode cannot ask the store (%s): only prompts of at most "
                           "--direct-decode-max-uncached tokens go straight to decode", e)
    return keyer, coverage


def main_proxy(argv: list[str] | None = None) -> int:
    """``lmcache-mooncake proxy ARGV``."""
    import sys

    from lmcache_mooncake.cli import main

    return main(["proxy", *(sys.argv[1:] if argv is None else argv)])
