"""Passing an instance's answer back to a client: the SSE relay and the client-disconnect race.

:func:`relay_sse` yields whole SSE events as the decode instance sends them and
ends a broken stream with an OpenAI-style error event; :func:`race_disconnect`
cancels the work behind a request (and so the instance's request) as soon as
the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import httpx
from fastapi import Request

from lmcache_mooncake.routing.errors import UpstreamError, exception_error, sse_error

__all__ = ["event_end", "race_disconnect", "relay_sse"]

# The proxy's one logger name, whichever of its modules logs.
logger = logging.getLogger("lmcache_mooncake.routing.proxy")

T = TypeVar("T")

_SSE_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")


def event_end(buf: bytes) -> int:
    """Index just past the last complete SSE event in ``buf`` (0 if none)."""
    end = 0
    for sep in _SSE_EVENT_ENDS:
        i = buf.rfind(sep)
        if i >= 0:
            end = max(end, i + len(sep))
    return end


async def race_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (so the instance aborts too).

    Raises :class:`UpstreamError` 499 (``client_closed_request``) when the client left.
    """
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


async def relay_sse(resp: httpx.Response, url: str, route: str, t0: float,
                    release: Callable[[], None]) -> AsyncIterator[bytes]:
    """Pass the decode SSE stream ``resp`` (from instance ``url``) through, whole events as they
    arrive; end with an error event if the upstream breaks (a partial event at the break is
    dropped). Closes ``resp`` and calls ``release`` when the stream ends, however it ends, and
    logs one line (``route``, time to first byte and total since ``t0``, outcome)."""
    buf = b""
    first: float | None = None
    outcome = "ok"
    try:
        async for chunk in resp.aiter_bytes():
            if first is None:
                first = time.perf_counter() - t0
            buf += chunk
            end = event_end(buf)
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
        release()
        level = logging.INFO if outcome == "ok" else logging.WARNING
        logger.log(level, "%s first byte %s, total %.3fs, stream %s", route,
                   f"{first:.3f}s" if first is not None else "-", time.perf_counter() - t0, outcome)
