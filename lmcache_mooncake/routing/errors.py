"""OpenAI-style errors for what can go wrong between the proxy and an instance.

:class:`UpstreamError` carries the HTTP status and message the client gets; the
helpers turn an instance's error answer (:func:`status_error`) or a transport
failure (:func:`exception_error`) into one, and :func:`sse_error` into the last
event of a broken stream. The body is always ``{"error": {"message", "type",
"param", "code"}}``, the shape vLLM answers with.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

# Errors raised before any byte of the request reached the instance: safe to retry elsewhere.
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# The instance closed the connection before its answer was whole (it died while computing): nothing
# went to the client yet, so the request is tried on the next instance too.
DIED = (httpx.RemoteProtocolError, httpx.ReadError)


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


def error_payload(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body (the same shape vLLM returns); ``param`` names the request field at fault."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, err_type: str, request_id: str | None = None, *,
                   param: str | None = None) -> JSONResponse:
    """:func:`error_payload` as an HTTP ``status`` answer, with ``X-Request-Id`` when given."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return JSONResponse(error_payload(message, err_type, status, param), status_code=status, headers=headers)


def upstream_message(body: bytes) -> str:
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


def status_error(role: str, url: str, status: int, body: bytes, content_type: str | None) -> UpstreamError:
    if 400 <= status < 500:
        # A client error (bad request, unknown model, auth): the client gets the instance's answer.
        return UpstreamError(status, upstream_message(body), "invalid_request_error",
                             body=body, content_type=content_type)
    return UpstreamError(502, f"{role} instance {url} answered HTTP {status}: {upstream_message(body)}",
                         "upstream_error")


def exception_error(role: str, url: str, exc: Exception) -> UpstreamError:
    what = type(exc).__name__
    detail = str(exc) or what
    if isinstance(exc, RETRYABLE):
        return UpstreamError(503, f"{role} instance {url} is unreachable ({what}: {detail})",
                             "service_unavailable")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(504, f"{role} instance {url} timed out ({what})", "timeout")
    return UpstreamError(502, f"{role} instance {url} failed ({what}: {detail})", "upstream_error")


def sse_error(err: UpstreamError) -> bytes:
    return b"data: " + json.dumps(err.payload()).encode() + b"\n\n"
