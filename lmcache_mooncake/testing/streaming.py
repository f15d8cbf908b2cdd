"""One streamed ``/v1/completions`` request, timed at the client: the demo's and benchmarks' probe."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamedCompletion:
    """What one streamed request gave."""

    #: Seconds from sending to the first streamed token (None if none came).
    ttft_s: float | None = None
    text: str = ""
    #: The final ``usage`` object (``stream_options.include_usage``).
    usage: dict[str, Any] = field(default_factory=dict)
    #: Response headers (the proxy's ``X-Decode-Instance``, ``X-Prefill-Instance``).
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def stream_completion(client: httpx.Client, base_url: str, body: dict[str, Any]) -> StreamedCompletion:
    """POST ``body`` (``stream`` and ``include_usage`` are set here) and read the stream to its end;
    raises ``httpx.HTTPStatusError`` for an error status and ``RuntimeError`` for an error event."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = StreamedCompletion()
    t0 = time.perf_counter()
    with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        out.headers = dict(resp.headers)
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"request failed: {data['error']}")
            if data.get("choices") and data["choices"][0].get("text") is not None:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - t0
                out.text += data["choices"][0]["text"]
            out.usage = data.get("usage") or out.usage
    return out
