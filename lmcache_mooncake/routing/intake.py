"""Reading a client's request before the proxy sends anything on.

The contract (every failure is an OpenAI-style error naming what was wrong):

- The body is at most :attr:`IntakeLimits.max_body_bytes` bytes, else HTTP 413.
  A ``Content-Length`` above the limit is refused before a byte is read.
- The whole body arrives within :attr:`IntakeLimits.read_timeout_s` seconds,
  else HTTP 408: a client that trickles its body cannot hold a proxy task forever.
- It is one JSON object with the fields the endpoint needs (``model``, and
  ``prompt`` for ``/v1/completions`` or ``messages`` for
  ``/v1/chat/completions``; ``stream`` a boolean if present), else HTTP 400
  with the field in ``param``.
- ``kv_transfer_params`` is the proxy's business: a client's own is removed
  (:func:`strip_client_fields`), so a client cannot make a decode instance
  wait for chunks nobody stores. Only what a prefill instance answered goes on.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

#: Fields only the proxy may set on the requests it sends upstream.
PROXY_OWNED_FIELDS = ("kv_transfer_params",)


@dataclass(frozen=True)
class IntakeLimits:
    """Bounds on what a client may send."""

    #: Largest request body in bytes. 8 MiB holds a 128k-token prompt as text or as token ids.
    max_body_bytes: int = 8 << 20
    #: Seconds the whole body may take to arrive.
    read_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be positive")
        if self.read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s={self.read_timeout_s} must be positive")


class IntakeError(Exception):
    """A request the proxy refuses, with the HTTP status and the offending field (if one)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def err_type(self) -> str:
        return {408: "request_timeout", 413: "request_too_large"}.get(self.status, "invalid_request_error")


async def read_body(request: Request, limits: IntakeLimits) -> bytes:
    """The request body, within ``limits``; raises :class:`IntakeError` (413, 408, 400)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise IntakeError(400, f"Content-Length {declared!r} is not a number") from None
        if size > limits.max_body_bytes:
            raise IntakeError(413, _too_large(limits, f"{size} bytes"))

    async def collect() -> bytes:
        parts: list[bytes] = []
        total = 0
        async for part in request.stream():
            total += len(part)
            if total > limits.max_body_bytes:
                raise IntakeError(413, _too_large(limits, f"more than {limits.max_body_bytes} bytes"))
            parts.append(part)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(collect(), limits.read_timeout_s)
    except asyncio.TimeoutError:
        raise IntakeError(408, f"the request body did not arrive within {limits.read_timeout_s:g} s; "
                               "send it whole, without pauses") from None
    except ClientDisconnect:
        raise IntakeError(499, "client disconnected while sending the request") from None


def _too_large(limits: IntakeLimits, got: str) -> str:
    return (f"request body of {got} is over the proxy's limit of {limits.max_body_bytes} bytes "
            "(lmcache-mooncake proxy --max-body-bytes)")


def parse_request(raw: bytes, path: str) -> dict[str, Any]:
    """The JSON object of a completion request at ``path``, checked; raises :class:`IntakeError` (400)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise IntakeError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise IntakeError(400, f"request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise IntakeError(400, "field 'model' is missing or not a non-empty string", "model")
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise IntakeError(400, "field 'messages' is missing or not a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise IntakeError(400, "field 'messages' must be a list of objects", "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise IntakeError(400, "field 'prompt' is missing or not a string or a non-empty list", "prompt")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise IntakeError(400, "field 'stream' must be true or false", "stream")
    return body


def strip_client_fields(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``body`` without the fields only the proxy may set, and the names of those removed."""
    removed = [f for f in PROXY_OWNED_FIELDS if f in body]
    return {k: v for k, v in body.items() if k not in PROXY_OWNED_FIELDS}, removed
