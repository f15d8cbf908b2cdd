"""OpenAI-compatible router for prefill/decode disaggregation.

Every ``/v1/completions`` and ``/v1/chat/completions`` request goes first to a
prefill instance (round-robin) as a one-token, non-streaming request, so that
instance computes the prompt's KV cache and stores its chunks (LMCache tiers /
Mooncake Store). The original request then goes to a decode instance
(round-robin), which finds the prompt's chunks and only generates; its answer
(JSON or an SSE stream, passed through as it arrives) goes back to the client.
If the prefill answer carries a top-level ``kv_transfer_params`` object it is
copied into the decode request.

Failures never hang the client: an unreachable instance, a timeout, an upstream
error or a stream that breaks mid-way becomes an OpenAI-style error
(``{"error": {"message", "type", "param", "code"}}``; for a broken stream, a
last ``data: {"error": ...}`` SSE event). A connection error before anything
was sent is retried on the next instance of the same role; no instance is ever
blacklisted, so one that comes back is used again at once.

Run it with ``lmcache-mooncake proxy --prefill URL... --decode URL... --port P``
or serve :func:`build_app` with any ASGI server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger("lmcache_mooncake.proxy")

T = TypeVar("T")

# Errors raised before any byte of the request reached the instance: safe to retry elsewhere.
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Request headers passed on to the instances.
_FORWARD_HEADERS = ("authorization",)
_SSE_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")


class UpstreamError(Exception):
    """A failure to turn into an OpenAI-style error response for the client."""

    def __init__(self, status: int, message: str, err_type: str, body: bytes | None = None,
                 content_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.body = body  # the upstream's own body, passed through for its 4xx answers
        self.content_type = content_type

    def payload(self) -> dict[str, Any]:
        return error_payload(self.message, self.err_type, self.status)

    def response(self, request_id: str) -> Response:
        headers = {"X-Request-Id": request_id}
        if self.body is not None:
            return Response(self.body, status_code=self.status, headers=headers,
                            media_type=self.content_type or "application/json")
        return JSONResponse(self.payload(), status_code=self.status, headers=headers)


def error_payload(message: str, err_type: str, code: int) -> dict[str, Any]:
    """The OpenAI error body (the same shape vLLM returns)."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def _error_response(status: int, message: str, err_type: str, request_id: str | None = None) -> JSONResponse:
    headers = {"X-Request-Id": request_id} if request_id else None
    return JSONResponse(error_payload(message, err_type, status), status_code=status, headers=headers)


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


class _Pool:
    """Round-robin over the instances of one role (no blacklisting)."""

    def __init__(self, role: str, urls: list[str]):
        if not urls:
            raise ValueError(f"at least one {role} URL is needed")
        self.role = role
        self.urls = [normalize_url(u) for u in urls]
        self._next = 0

    def order(self) -> list[str]:
        """All instances, starting at the next one in turn; advances the turn by one."""
        i = self._next
        self._next = (i + 1) % len(self.urls)
        return self.urls[i:] + self.urls[:i]


def _upstream_message(body: bytes) -> str:
    """The error message inside an upstream error body, or the body's start."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if data.get("message"):
            return str(data["message"])
        if data.get("detail"):
            return str(data["detail"])
    return json.dumps(data)[:300]


def _status_error(role: str, url: str, status: int, body: bytes, content_type: str | None) -> UpstreamError:
    if 400 <= status < 500:
        # A client error (bad request, unknown model, auth): the client gets the instance's answer.
        return UpstreamError(status, _upstream_message(body), "invalid_request_error",
                             body=body, content_type=content_type)
    return UpstreamError(502, f"{role} instance {url} answered HTTP {status}: {_upstream_message(body)}",
                         "upstream_error")


def _exception_error(role: str, url: str, exc: Exception) -> UpstreamError:
    what = type(exc).__name__
    detail = str(exc) or what
    if isinstance(exc, _RETRYABLE):
        return UpstreamError(503, f"{role} instance {url} is unreachable ({what}: {detail})",
                             "service_unavailable")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(504, f"{role} instance {url} timed out ({what})", "timeout")
    return UpstreamError(502, f"{role} instance {url} failed ({what}: {detail})", "upstream_error")


def _sse_error(err: UpstreamError) -> bytes:
    return b"data: " + json.dumps(err.payload()).encode() + b"\n\n"


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


class _Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float,
                 connect_timeout_s: float):
        self.prefill = _Pool("prefill", prefill_urls)
        self.decode = _Pool("decode", decode_urls)
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.health_timeout = httpx.Timeout(max(connect_timeout_s, 2.0), connect=connect_timeout_s)
        self.client: httpx.AsyncClient | None = None

    # -- plumbing -----------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the proxy's HTTP client is not running (app lifespan not started)")
        return self.client

    async def _send(self, pool: _Pool, method: str, path: str, *, headers: dict[str, str],
                    body: dict[str, Any] | None = None, stream: bool = False,
                    timeout: httpx.Timeout | None = None) -> tuple[str, httpx.Response]:
        """Send to the next instance of ``pool``; on a connection error try the following ones.

        Returns (instance URL, response) for any HTTP status; raises UpstreamError otherwise.
        """
        client = self._client()
        last: UpstreamError | None = None
        for url in pool.order():
            req = client.build_request(method, url + path, json=body, headers=headers,
                                       timeout=timeout or self.timeout)
            try:
                return url, await client.send(req, stream=stream)
            except _RETRYABLE as e:
                last = _exception_error(pool.role, url, e)
                logger.warning("%s; trying the next %s instance", last.message, pool.role)
            except httpx.HTTPError as e:
                raise _exception_error(pool.role, url, e) from e
        if last is None:  # the pool has no instances: build_app refuses that, so this is a bug
            raise UpstreamError(503, f"no {pool.role} instance is configured", "service_unavailable")
        if len(pool.urls) > 1:
            last.message = f"no {pool.role} instance is reachable (last: {last.message})"
        raise last

    async def _post_json(self, pool: _Pool, path: str, body: dict[str, Any],
                         headers: dict[str, str]) -> tuple[str, httpx.Response]:
        url, resp = await self._send(pool, "POST", path, headers=headers, body=body)
        if resp.status_code >= 400:
            raise _status_error(pool.role, url, resp.status_code, resp.content,
                                resp.headers.get("content-type"))
        return url, resp

    # -- endpoints ----------------------------------------------------------------------------

    async def completion(self, request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return _error_response(400, f"request body is not valid JSON: {e}", "invalid_request_error",
                                   request_id)
        if not isinstance(body, dict):
            return _error_response(400, "request body must be a JSON object", "invalid_request_error",
                                   request_id)
        headers = {"X-Request-Id": request_id}
        for h in _FORWARD_HEADERS:
            if h in request.headers:
                headers[h] = request.headers[h]
        stream = body.get("stream") is True
        route = f"req {request_id} {path} stream={stream}"

        # 1. Prefill: one token, no stream.
        prefill_body = dict(body)
        prefill_body["max_tokens"] = 1
        if path.endswith("/chat/completions") and "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)
        prefill_body.pop("min_tokens", None)  # would exceed max_tokens=1 and be rejected
        try:
            p_url, p_resp = await _race_disconnect(request, self._post_json(self.prefill, path, prefill_body,
                                                                            headers))
            try:
                p_data = p_resp.json()
            except ValueError as e:
                raise UpstreamError(502, f"prefill instance {p_url} answered non-JSON: {e}",
                                    "upstream_error") from e
        except UpstreamError as e:
            logger.warning("%s: prefill failed after %.3fs: HTTP %d %s", route, time.perf_counter() - t0,
                           e.status, e.message)
            return e.response(request_id)
        t_prefill = time.perf_counter() - t0

        decode_body = dict(body)
        kv_params = p_data.get("kv_transfer_params") if isinstance(p_data, dict) else None
        if isinstance(kv_params, dict):
            decode_body["kv_transfer_params"] = kv_params
        route += f" prefill={p_url} ({t_prefill:.3f}s, kv_transfer_params={'yes' if kv_params else 'no'})"

        # 2. Decode: the original request.
        if not stream:
            try:
                d_url, d_resp = await _race_disconnect(request, self._post_json(self.decode, path,
                                                                                decode_body, headers))
            except UpstreamError as e:
                logger.warning("%s: decode failed after %.3fs: HTTP %d %s", route,
                               time.perf_counter() - t0, e.status, e.message)
                return e.response(request_id)
            logger.info("%s decode=%s (%.3fs), total %.3fs, HTTP %d", route, d_url,
                        time.perf_counter() - t0 - t_prefill, time.perf_counter() - t0, d_resp.status_code)
            return Response(d_resp.content, status_code=d_resp.status_code,
                            media_type=d_resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": request_id})

        try:
            d_url, d_resp = await _race_disconnect(request, self._send(self.decode, "POST", path,
                                                                       headers=headers, body=decode_body,
                                                                       stream=True))
        except UpstreamError as e:
            logger.warning("%s: decode failed after %.3fs: HTTP %d %s", route, time.perf_counter() - t0,
                           e.status, e.message)
            return e.response(request_id)
        if d_resp.status_code >= 400:
            try:
                err_body = await d_resp.aread()
            except httpx.HTTPError:
                err_body = b""
            finally:
                await d_resp.aclose()
            e = _status_error("decode", d_url, d_resp.status_code, err_body, d_resp.headers.get("content-type"))
            logger.warning("%s decode=%s failed after %.3fs: HTTP %d %s", route, d_url,
                           time.perf_counter() - t0, e.status, e.message)
            return e.response(request_id)
        route += f" decode={d_url}"
        # background: closes the upstream even if the client left before the relay started.
        return StreamingResponse(self._relay(d_resp, d_url, route, t0), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": request_id},
                                 background=BackgroundTask(d_resp.aclose))

    async def _relay(self, resp: httpx.Response, url: str, route: str, t0: float) -> AsyncIterator[bytes]:
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
            err = _exception_error("decode", url, e)
            err.message = f"stream broken: {err.message}"
            outcome = f"error: {err.message}"
            yield _sse_error(err)
        except BaseException:
            outcome = "client went away"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            level = logging.INFO if outcome == "ok" else logging.WARNING
            logger.log(level, "%s first byte %s, total %.3fs, stream %s", route,
                       f"{first:.3f}s" if first is not None else "-", time.perf_counter() - t0, outcome)

    async def models(self, request: Request) -> Response:
        t0 = time.perf_counter()
        headers = {h: request.headers[h] for h in _FORWARD_HEADERS if h in request.headers}
        client = self._client()
        problems = []
        for url in self.decode.urls:
            try:
                resp = await client.get(url + "/v1/models", headers=headers, timeout=self.health_timeout)
            except httpx.HTTPError as e:
                problems.append(_exception_error("decode", url, e).message)
                continue
            if resp.status_code == 200 or 400 <= resp.status_code < 500:
                logger.info("/v1/models from decode=%s (%.3fs), HTTP %d", url, time.perf_counter() - t0,
                            resp.status_code)
                return Response(resp.content, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type", "application/json"))
            problems.append(f"decode instance {url} answered HTTP {resp.status_code}")
        logger.warning("/v1/models: no decode instance answered: %s", "; ".join(problems))
        return _error_response(503, "no decode instance answered /v1/models: " + "; ".join(problems),
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


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600,
              connect_timeout_s: float = 5) -> FastAPI:
    """The proxy as a FastAPI app.

    ``timeout_s`` bounds each read from an instance (for a non-streaming request, the whole
    generation; for a stream, the gap between chunks); ``connect_timeout_s`` bounds opening a
    connection (after which the next instance of the same role is tried).
    """
    router = _Router(prefill_urls, decode_urls, timeout_s, connect_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.client = httpx.AsyncClient(
            timeout=router.timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,  # talk to the instances directly, never through an HTTP(S)_PROXY
        )
        logger.info("proxy up: prefill %s, decode %s", ", ".join(router.prefill.urls),
                    ", ".join(router.decode.urls))
        try:
            yield
        finally:
            client, router.client = router.client, None
            await client.aclose()

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

    return app


_PROXY_DESCRIPTION = """\
OpenAI-compatible router for prefill/decode disaggregation.

Each /v1/completions or /v1/chat/completions request goes first to a prefill
instance (round-robin) with max_tokens=1 and stream=false, which computes the
prompt's KV cache and stores its chunks; then the original request goes to a
decode instance (round-robin), which loads those chunks and generates. Streams
are passed through as they arrive. A kv_transfer_params object in the prefill
answer is copied into the decode request. GET /v1/models answers from the first
decode instance that responds; GET /health is 200 when at least one prefill and
one decode instance answer their /health, else 503 listing those that are down.

An unreachable instance is skipped for that request (the next one of the same
role is tried) and used again as soon as it answers.
"""

_PROXY_EPILOG = """\
example:
  lmcache-mooncake proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
      http://127.0.0.1:8201 --port 8000
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default info)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``lmcache-mooncake proxy``: check the flags and serve the proxy with uvicorn."""
    from lmcache_mooncake.logs import setup_logging

    p = args.parser
    if not 0 < args.port < 65536:
        p.error(f"--port {args.port} is not a valid port")
    if args.timeout <= 0 or args.connect_timeout <= 0:
        p.error("--timeout and --connect-timeout must be positive")
    try:
        app = build_app(args.prefill, args.decode, timeout_s=args.timeout,
                        connect_timeout_s=args.connect_timeout)
    except ValueError as e:
        p.error(str(e))

    import uvicorn

    setup_logging()
    logging.getLogger("lmcache_mooncake").setLevel(args.log_level.upper())
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def main_proxy(argv: list[str] | None = None) -> int:
    """``lmcache-mooncake proxy ARGV``."""
    import sys

    from lmcache_mooncake.cli import main

    return main(["proxy", *(sys.argv[1:] if argv is None else argv)])
