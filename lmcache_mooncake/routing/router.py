"""The proxy's routing: its configuration, the instance leases, and the work behind each endpoint.

A completion is read and checked (:mod:`~lmcache_mooncake.routing.intake`), named
(:mod:`~lmcache_mooncake.routing.prompt_keys`), run on a prefill instance unless
the store (nearly) holds its prompt, then sent to a decode instance whose answer
goes back as JSON (:meth:`Router._decode_json`) or as a relayed SSE stream
(:meth:`Router._decode_stream`, :mod:`~lmcache_mooncake.routing.relay`). Instances
come from :mod:`~lmcache_mooncake.routing.pool` in the order
:mod:`~lmcache_mooncake.routing.placement` ranks them; failures become
OpenAI-style errors (:mod:`~lmcache_mooncake.routing.errors`). The HTTP app
around it is :mod:`~lmcache_mooncake.routing.app`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from lmcache_mooncake.routing.errors import (
    DIED,
    RETRYABLE,
    UpstreamError,
    error_payload,
    error_response,
    exception_error,
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
from lmcache_mooncake.routing.relay import race_disconnect, relay_sse

__all__ = ["FORWARD_HEADERS", "Lease", "ProxyConfig", "Router", "normalize_url"]

# The proxy's one logger name, whichever of its modules logs.
logger = logging.getLogger("lmcache_mooncake.routing.proxy")

#: Request headers passed on to the instances.
FORWARD_HEADERS = ("authorization",)


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


class Lease:
    """One request outstanding on one instance; :meth:`release` is idempotent."""

    def __init__(self, pool: InstancePool, inst: Instance):
        self.pool, self.inst, self._open = pool, inst, True
        pool.begin(inst)

    def release(self) -> None:
        if self._open:
            self._open = False
            self.pool.end(self.inst)


class Router:
    """The proxy's state and its endpoints' work: the instance pools, placement, the HTTP
    client (set by the app's lifespan), the tokenizer and store threads, and counters."""

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
                    stream: bool = False) -> tuple[Lease, httpx.Response]:
        """Send to the first of ``order``; on a connection error mark it down and try the next.

        Returns (a lease on the instance, its response) for any HTTP status; the caller releases
        the lease when the answer is over. Raises UpstreamError otherwise.
        """
        client = self._client()
        last: UpstreamError | None = None
        for inst in order:
            req = client.build_request(method, inst.url + path, json=body, headers=headers, timeout=self.timeout)
            lease = Lease(pool, inst)
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
        """``POST path`` (a completion or chat completion): intake, then prefill (unless the
        store holds the prompt), then decode; always an answer, an OpenAI-style error at worst."""
        t0 = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        try:
            body = parse_request(await read_body(request, self.config.limits), path)
        except IntakeError as e:
            logger.warning("req %s %s refused: HTTP %d %s", request_id, path, e.status, e.message)
            return error_response(e.status, e.message, e.err_type, request_id, param=e.param)
        body, removed = strip_client_fields(body)
        if removed:
            self.counters["client_kv_transfer_params_removed"] += 1
            logger.info("req %s: removed client-supplied %s", request_id, ", ".join(removed))
        self.counters["requests"] += 1
        headers = {"X-Request-Id": request_id}
        for h in FORWARD_HEADERS:
            if h in request.headers:
                headers[h] = request.headers[h]
        stream = body.get("stream") is True
        route = f"req {request_id} {path} stream={stream}"
        try:
            pk, covered = await race_disconnect(request, self._prompt(path, body))
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
                return _failed(f"{route}: prefill", t0, e, request_id)
            t_prefill = time.perf_counter() - t0
            if kv_params is not None:
                decode_body["kv_transfer_params"] = kv_params
            route += f" prefill={p_url} ({t_prefill:.3f}s, kv_transfer_params={'yes' if kv_params else 'no'})"

        # 2. Decode: the original request.
        call = _DecodeCall(request, request_id, path, decode_body, headers, self._order(self.decode, digests),
                           route, t0, t_prefill, p_url)
        return await (self._decode_stream(call) if stream else self._decode_json(call))

    async def _decode_json(self, call: _DecodeCall) -> Response:
        """The decode step of a non-streaming request: the instance's whole answer, passed on."""
        try:
            d_url, d_resp = await race_disconnect(call.request, self._post_json(self.decode, call.order, call.path,
                                                                               call.body, call.headers))
        except UpstreamError as e:
            return _failed(f"{call.route}: decode", call.t0, e, call.request_id)
        logger.info("%s decode=%s (%.3fs), total %.3fs, HTTP %d", call.route, d_url,
                    time.perf_counter() - call.t0 - call.t_prefill, time.perf_counter() - call.t0,
                    d_resp.status_code)
        return Response(d_resp.content, status_code=d_resp.status_code,
                        media_type=d_resp.headers.get("content-type", "application/json"),
                        headers={"X-Request-Id": call.request_id, "X-Decode-Instance": d_url,
                                 "X-Prefill-Instance": call.p_url})

    async def _decode_stream(self, call: _DecodeCall) -> Response:
        """The decode step of a streaming request: the instance's SSE stream, relayed as it comes
        (an error answer before the stream starts is passed on as an error)."""
        try:
            lease, d_resp = await race_disconnect(call.request, self._send(self.decode, call.order, "POST",
                                                                           call.path, headers=call.headers,
                                                                           body=call.body, stream=True))
        except UpstreamError as e:
            return _failed(f"{call.route}: decode", call.t0, e, call.request_id)
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
            return _failed(f"{call.route} decode={d_url}", call.t0, e, call.request_id)
        route = f"{call.route} decode={d_url}"

        async def finish() -> None:
            await d_resp.aclose()
            lease.release()

        # background: closes the upstream even if the client left before the relay started.
        return StreamingResponse(relay_sse(d_resp, d_url, route, call.t0, lease.release),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": call.request_id, "X-Decode-Instance": d_url,
                                          "X-Prefill-Instance": call.p_url},
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
        p_url, p_resp = await race_disconnect(request, self._post_json(self.prefill, order, path,
                                                                        prefill_body, headers))
        try:
            p_data = p_resp.json()
        except ValueError as e:
            raise UpstreamError(502, f"prefill instance {p_url} answered non-JSON: {e}", "upstream_error") from e
        kv_params = p_data.get("kv_transfer_params") if isinstance(p_data, dict) else None
        return p_url, kv_params if isinstance(kv_params, dict) else None

    async def models(self, request: Request) -> Response:
        t0 = time.perf_counter()
        headers = {h: request.headers[h] for h in FORWARD_HEADERS if h in request.headers}
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


@dataclass(frozen=True)
class _DecodeCall:
    """One request's decode step: what goes to which decode instances, and what its log line says."""

    request: Request
    request_id: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    order: list[Instance]
    route: str  # the log line so far: request, path, stream, the prefill or direct decode
    t0: float
    t_prefill: float
    p_url: str  # the prefill instance, or "skipped"


def _failed(what: str, t0: float, e: UpstreamError, request_id: str) -> Response:
    """Log that ``what`` (the request's route and its failed step) failed, and the client's answer."""
    logger.warning("%s failed after %.3fs: HTTP %d %s", what, time.perf_counter() - t0, e.status, e.message)
    return e.response(request_id)
