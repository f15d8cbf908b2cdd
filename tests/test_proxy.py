"""The prefill/decode proxy (lmcache_mooncake.routing.proxy) against fake OpenAI upstreams.

The upstreams here are small FastAPI apps served by uvicorn on 127.0.0.1: they record what
they were sent and can fail in ways a real vLLM cannot be made to (HTTP 500, a connection
dropped mid-stream, a stalled stream). The proxy itself also runs under uvicorn, and the
client is the ``openai`` package (or httpx for the raw SSE bytes).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmcache_mooncake.chunks import keys
from lmcache_mooncake.routing.app import build_app
from lmcache_mooncake.routing.intake import IntakeLimits
from lmcache_mooncake.routing.placement import RendezvousPlacement
from lmcache_mooncake.routing.pool import HealthPolicy
from lmcache_mooncake.routing.prompt_keys import PromptKeys
from lmcache_mooncake.routing.proxy import main_proxy
from lmcache_mooncake.routing.router import ProxyConfig, normalize_url

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_http_proxy(monkeypatch):
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")


# --- a fake OpenAI-compatible upstream -----------------------------------------------------------


class Fake:
    """A fake vLLM OpenAI server.

    mode: "ok" | "error500" (completions answer 500) | "bad_request" (completions answer 400)
          | "drop" (streams drop the connection after 2 events) | "stall" (streams stop after 1 event)
          | "slow" (non-stream answers after 5 s, watching for the caller going away)
          | "unhealthy" (/health answers 503).
    """

    def __init__(self, name: str, mode: str = "ok", kv: dict | None = None, chunks: int = 3,
                 chunk_delay: float = 0.0):
        self.name = name
        self.mode = mode
        self.kv = kv
        self.chunks = chunks
        self.chunk_delay = chunk_delay
        self.requests: list[tuple[str, dict, dict]] = []  # (path, body, headers)
        self.disconnected = threading.Event()
        self.app = self._make_app()

    def bodies(self) -> list[dict]:
        return [b for _, b, _ in self.requests]

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=503 if self.mode == "unhealthy" else 200)

        @app.get("/v1/models")
        async def models():
            return {"object": "list",
                    "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": self.name}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._complete(request, chat=True)

        return app

    async def _complete(self, request: Request, chat: bool):
        body = await request.json()
        self.requests.append((request.url.path, body, dict(request.headers)))
        if self.mode == "error500":
            return JSONResponse({"error": {"message": "engine exploded", "type": "InternalServerError",
                                           "param": None, "code": 500}}, status_code=500)
        if self.mode == "bad_request":
            return JSONResponse({"error": {"message": "prompt is too long", "type": "BadRequestError",
                                           "param": None, "code": 400}}, status_code=400)
        if body.get("stream"):
            return StreamingResponse(self._events(chat), media_type="text/event-stream")
        if self.mode == "slow":
            for _ in range(100):
                if await request.is_disconnected():
                    self.disconnected.set()
                    break
                await asyncio.sleep(0.05)
        text = f"{self.name}-answer"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        out = {"id": "x-1", "object": "chat.completion" if chat else "text_completion", "created": 0,
               "model": body.get("model", "fake-model"), "choices": [choice],
               "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        if self.kv is not None:
            out["kv_transfer_params"] = self.kv
        return out

    async def _events(self, chat: bool):
        for i in range(self.chunks):
            if self.mode == "drop" and i == 2:
                raise RuntimeError("fake upstream drops the connection")  # uvicorn closes the socket
            if self.mode == "stall" and i == 1:
                await asyncio.sleep(5)
            if i and self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            piece = f"{self.name}-{i} "
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                      else {"index": 0, "text": piece, "finish_reason": None})
            data = {"id": "x-1", "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 0, "model": "fake-model", "choices": [choice]}
            yield f"data: {json.dumps(data)}\n\n".encode()
        yield b"data: [DONE]\n\n"


# --- serving apps on 127.0.0.1 in background threads ---------------------------------------------


class Served:
    """An ASGI app under uvicorn in a thread, on a given or free 127.0.0.1 port."""

    def __init__(self, app, port: int = 0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def serve():
    started: list[Served] = []

    def _serve(app, port: int = 0) -> Served:
        s = Served(app, port)
        started.append(s)
        return s

    yield _serve
    for s in started:  # stop them all at once: each takes a few event-loop ticks
        s.server.should_exit = True
    for s in started:
        s.thread.join(10)


def dead_url() -> str:
    """A 127.0.0.1 URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def proxy_for(serve, prefill: list[str], decode: list[str], config: ProxyConfig | None = None, **kw) -> str:
    return serve(build_app(prefill, decode, config, **kw)).url


def client(proxy_url: str, timeout: float = 15) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def ask(c: openai.OpenAI, chat: bool, **kw):
    if chat:
        return c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], **kw)
    return c.completions.create(model="fake-model", prompt="hi", **kw)


def text_of(resp, chat: bool) -> str:
    return resp.choices[0].message.content if chat else resp.choices[0].text


# --- routing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_prefill_then_decode(serve, chat, stream):
    kv = {"do_remote_prefill": True, "remote_host": "p0", "remote_block_ids": [1, 2]}
    p, d = Fake("P", kv=kv), Fake("D")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    kw = {"max_tokens": 20, "temperature": 0, "stream": stream}
    if stream:
        kw["stream_options"] = {"include_usage": True}
    resp = ask(client(proxy), chat, **kw)
    if stream:
        got = "".join((ch.choices[0].delta.content or "") if chat else ch.choices[0].text for ch in resp)
        assert got == "D-0 D-1 D-2 "
    else:
        assert text_of(resp, chat) == "D-answer"

    path = "/v1/chat/completions" if chat else "/v1/completions"
    [(p_path, p_body, p_headers)] = p.requests
    [(d_path, d_body, d_headers)] = d.requests
    assert p_path == d_path == path
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body and "kv_transfer_params" not in p_body
    assert d_body["max_tokens"] == 20 and d_body["kv_transfer_params"] == kv
    assert d_body.get("stream", False) is stream
    assert ("stream_options" in d_body) is stream
    assert p_headers["authorization"] == d_headers["authorization"] == "Bearer x"
    assert p_headers["x-request-id"] == d_headers["x-request-id"]


def test_chat_max_completion_tokens_and_no_kv_params(serve):
    p, d = Fake("P"), Fake("D")  # the prefill answer has no kv_transfer_params
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    resp = ask(client(proxy), True, max_completion_tokens=50, extra_body={"min_tokens": 5})
    assert resp.choices[0].message.content == "D-answer"
    [pb], [db] = p.bodies(), d.bodies()
    assert pb["max_completion_tokens"] == 1 and pb["max_tokens"] == 1 and "min_tokens" not in pb
    assert db["max_completion_tokens"] == 50 and db["min_tokens"] == 5
    assert "max_tokens" not in db and "kv_transfer_params" not in db


def test_stream_chunks_arrive_as_they_are_made(serve):
    p, d = Fake("P"), Fake("D", chunks=4, chunk_delay=0.3)
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    t0 = time.monotonic()
    arrivals, pieces = [], []
    for ch in ask(client(proxy), True, stream=True, max_tokens=8):
        arrivals.append(time.monotonic() - t0)
        pieces.append(ch.choices[0].delta.content)
    assert pieces == ["D-0 ", "D-1 ", "D-2 ", "D-3 "]
    # Made 0.3 s apart upstream: they must not all come at the end.
    assert arrivals[-1] - arrivals[0] > 0.6, arrivals
    assert all(b - a > 0.15 for a, b in zip(arrivals, arrivals[1:], strict=False)), arrivals


def test_round_robin(serve):
    ps = [Fake(f"P{i}") for i in range(2)]
    ds = [Fake(f"D{i}") for i in range(2)]
    proxy = proxy_for(serve, [serve(f.app).url for f in ps], [serve(f.app).url for f in ds])
    c = client(proxy)
    texts = [text_of(ask(c, i % 2 == 1, max_tokens=4), i % 2 == 1) for i in range(4)]
    assert [len(f.requests) for f in ps + ds] == [2, 2, 2, 2]
    assert texts == ["D0-answer", "D1-answer", "D0-answer", "D1-answer"]


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_unreachable_decode_fails_fast(serve, stream):
    p = Fake("P")
    proxy = proxy_for(serve, [serve(p.app).url], [dead_url()])
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as ei:
        resp = ask(client(proxy), False, max_tokens=4, stream=stream)
        list(resp)
    assert time.monotonic() - t0 < 3
    assert ei.value.status_code == 503
    assert "unreachable" in ei.value.body["message"]
    assert len(p.requests) == 1


def test_unreachable_prefill_fails_fast(serve):
    d = Fake("D")
    proxy = proxy_for(serve, [dead_url(), dead_url()], [serve(d.app).url])
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as ei:
        ask(client(proxy), True, max_tokens=4)
    assert time.monotonic() - t0 < 3
    assert ei.value.status_code == 503
    assert "no prefill instance is reachable" in ei.value.body["message"]
    assert d.requests == []


FAST_HEALTH = HealthPolicy(interval_s=0.2, min_backoff_s=0.1, max_backoff_s=0.4, timeout_s=1.0)


def stats_of(proxy_url: str) -> dict:
    return httpx.get(proxy_url + "/stats", timeout=5, trust_env=False).json()


def wait_state(proxy_url: str, role: str, url: str, up: bool, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while (stats_of(proxy_url)[role][url]["state"] == "ok") != up:
        assert time.monotonic() < deadline, stats_of(proxy_url)
        time.sleep(0.05)


def test_failover_and_recovery(serve):
    p, d0, d1 = Fake("P"), Fake("D0"), Fake("D1")
    d0_served = serve(d0.app)
    gone = serve(d1.app)
    port = gone.port
    gone.stop()  # D1 is down: every request must go to D0
    d1_url = f"http://127.0.0.1:{port}"
    proxy = proxy_for(serve, [serve(p.app).url], [d0_served.url, d1_url], ProxyConfig(health=FAST_HEALTH))
    c = client(proxy)
    for i in range(4):
        assert text_of(ask(c, False, max_tokens=4, stream=False), False) == "D0-answer"
        chunks = [ch.choices[0].text for ch in ask(c, False, max_tokens=4, stream=True)]
        assert chunks == ["D0-0 ", "D0-1 ", "D0-2 "], i
    assert stats_of(proxy)["decode"][d1_url]["state"].startswith("down")
    # D1 comes back on the same port: once its /health answers it gets its turn again.
    serve(d1.app, port=port)
    wait_state(proxy, "decode", d1_url, up=True)
    texts = {text_of(ask(c, False, max_tokens=4), False) for _ in range(4)}
    assert texts == {"D0-answer", "D1-answer"}


def test_instance_down_is_left_out_then_taken_back(serve):
    """Health checks take a failing instance out (without a request having to hit it) and back."""
    p, d0, d1 = Fake("P"), Fake("D0"), Fake("D1")
    d0_url, d1_url = serve(d0.app).url, serve(d1.app).url
    proxy = proxy_for(serve, [serve(p.app).url], [d0_url, d1_url], ProxyConfig(health=FAST_HEALTH))
    c = client(proxy)
    d1.mode = "unhealthy"  # answers requests but fails /health: it must get none
    wait_state(proxy, "decode", d1_url, up=False)
    for _ in range(4):
        assert text_of(ask(c, False, max_tokens=4), False) == "D0-answer"
    assert d1.requests == []
    d1.mode = "ok"
    wait_state(proxy, "decode", d1_url, up=True)
    assert {text_of(ask(c, False, max_tokens=4), False) for _ in range(4)} == {"D0-answer", "D1-answer"}


def test_prefill_instance_down_is_left_out_then_taken_back(serve):
    p0, p1, d = Fake("P0"), Fake("P1"), Fake("D")
    p0_url, p1_url = serve(p0.app).url, serve(p1.app).url
    proxy = proxy_for(serve, [p0_url, p1_url], [serve(d.app).url], ProxyConfig(health=FAST_HEALTH))
    c = client(proxy)
    p0.mode = "unhealthy"
    wait_state(proxy, "prefill", p0_url, up=False)
    for _ in range(4):
        assert text_of(ask(c, False, max_tokens=4), False) == "D-answer"
    assert (len(p0.requests), len(p1.requests)) == (0, 4)
    p0.mode = "ok"
    wait_state(proxy, "prefill", p0_url, up=True)
    for _ in range(4):
        ask(c, False, max_tokens=4)
    assert len(p0.requests) == 2


def test_prefill_500_gives_502(serve):
    p, d = Fake("P", mode="error500"), Fake("D")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    with pytest.raises(openai.APIStatusError) as ei:
        ask(client(proxy), False, max_tokens=4)
    assert ei.value.status_code == 502
    assert "HTTP 500" in ei.value.body["message"] and "engine exploded" in ei.value.body["message"]
    assert ei.value.body["type"] == "upstream_error"
    assert d.requests == []


def test_prefill_400_is_passed_through(serve):
    p, d = Fake("P", mode="bad_request"), Fake("D")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    with pytest.raises(openai.BadRequestError) as ei:
        ask(client(proxy), True, max_tokens=4, stream=True)
    assert ei.value.status_code == 400
    assert ei.value.body["message"] == "prompt is too long"
    assert d.requests == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_decode_500_gives_502(serve, stream):
    p, d = Fake("P"), Fake("D", mode="error500")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    with pytest.raises(openai.APIStatusError) as ei:
        list(ask(client(proxy), False, max_tokens=4, stream=True)) if stream else ask(client(proxy), False)
    assert ei.value.status_code == 502
    assert "decode instance" in ei.value.body["message"]


def test_mid_stream_drop_ends_with_error_event(serve):
    p, d = Fake("P"), Fake("D", mode="drop", chunks=5)
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    got = []
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as ei:
        for ch in ask(client(proxy), True, stream=True, max_tokens=8):
            got.append(ch.choices[0].delta.content)
    assert time.monotonic() - t0 < 5
    assert got == ["D-0 ", "D-1 "]
    assert "stream broken" in ei.value.message

    # The raw stream: whole events, then one error event, then a properly ended response.
    with httpx.Client(trust_env=False, timeout=10) as h:
        r = h.post(proxy + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) == 3
    err = json.loads(events[-1].removeprefix("data: "))["error"]
    assert err["code"] == 502 and "RemoteProtocolError" in err["message"]


def test_stalled_stream_and_slow_answer_time_out(serve):
    p, d = Fake("P"), Fake("D", mode="stall")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url], ProxyConfig(timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as ei:
        for _ in ask(client(proxy), False, stream=True, max_tokens=8):
            pass
    assert "timed out" in ei.value.message and time.monotonic() - t0 < 3

    d.mode = "slow"
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as ei:
        ask(client(proxy), False, max_tokens=8)
    assert ei.value.status_code == 504 and time.monotonic() - t0 < 3


def test_client_going_away_cancels_the_decode_request(serve):
    p, d = Fake("P"), Fake("D", mode="slow")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    with pytest.raises(openai.APITimeoutError):
        ask(client(proxy, timeout=0.5), False, max_tokens=8)
    assert d.disconnected.wait(3), "the proxy kept the decode request running after the client left"


def test_invalid_json_body(serve):
    proxy = proxy_for(serve, [dead_url()], [dead_url()])
    with httpx.Client(trust_env=False, timeout=10) as h:
        r = h.post(proxy + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# --- what clients may send ---------------------------------------------------------------------


def test_client_kv_transfer_params_never_reach_an_instance(serve):
    forged = {"lmcache_mooncake": {"stored_prompt_tokens": 10**6}}
    # The prefill answers none: decode must get none either (not the client's).
    p, d = Fake("P"), Fake("D")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    for stream in (False, True):
        resp = ask(client(proxy), False, max_tokens=4, stream=stream, extra_body={"kv_transfer_params": forged})
        list(resp) if stream else resp
    assert all("kv_transfer_params" not in b for b in p.bodies() + d.bodies())
    assert stats_of(proxy)["client_kv_transfer_params_removed"] == 2

    # The prefill answers its own: decode gets exactly that.
    kv = {"lmcache_mooncake": {"stored_prompt_tokens": 3}}
    p2, d2 = Fake("P", kv=kv), Fake("D")
    proxy = proxy_for(serve, [serve(p2.app).url], [serve(d2.app).url])
    ask(client(proxy), True, max_tokens=4, extra_body={"kv_transfer_params": forged})
    [pb], [db] = p2.bodies(), d2.bodies()
    assert "kv_transfer_params" not in pb and db["kv_transfer_params"] == kv


def test_body_over_the_limit_gets_413(serve):
    p, d = Fake("P"), Fake("D")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url],
                      ProxyConfig(limits=IntakeLimits(max_body_bytes=1000)))
    big = {"model": "m", "prompt": "x" * 2000}
    with httpx.Client(trust_env=False, timeout=10) as h:
        r = h.post(proxy + "/v1/completions", json=big)  # refused on its Content-Length
        assert r.status_code == 413, r.text
        assert "1000 bytes" in r.json()["error"]["message"] and "--max-body-bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: refused once the bytes read pass the limit
            yield json.dumps(big).encode()[:600]
            yield json.dumps(big).encode()[600:]

        r = h.post(proxy + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "request_too_large"
        ok = h.post(proxy + "/v1/completions", json={"model": "m", "prompt": "small"})
        assert ok.status_code == 200
    assert len(p.requests) == len(d.requests) == 1


def test_slow_client_gets_408(serve):
    p, d = Fake("P"), Fake("D")
    proxy_url = proxy_for(serve, [serve(p.app).url], [serve(d.app).url],
                          ProxyConfig(limits=IntakeLimits(read_timeout_s=0.5)))
    port = int(proxy_url.rsplit(":", 1)[1])
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])  # then nothing more
        t0 = time.monotonic()
        answer = sock.recv(65536).decode()
    assert time.monotonic() - t0 < 3
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "did not arrive within 0.5 s" in answer
    assert p.requests == [] and d.requests == []


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "m"}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": ["hi"]}, "messages"),
])
def test_missing_or_wrong_field_gets_400_naming_it(serve, path, body, param):
    p, d = Fake("P"), Fake("D")
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url])
    with httpx.Client(trust_env=False, timeout=10) as h:
        r = h.post(proxy + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"'{param}'" in err["message"]
    assert p.requests == [] and d.requests == []


# --- the proxy with a tokenizer and a store -----------------------------------------------------

NS = keys.namespace_for("fake-model", "float32", 2, 1, 8, chunk_size=4)


class FakeKeyer:
    """Tokens are the prompt's words' lengths; keys are the real chunk keys of those tokens."""

    def keys_for(self, path: str, body: dict) -> PromptKeys | None:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        tokens = [len(w) for w in prompt.split()]
        return PromptKeys(tokens, keys.chunk_keys(NS, tokens))

    def close(self) -> None:
        pass


class FakeCoverage:
    """The store holds whatever tokens were 'stored' (every prompt prefilled once)."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.asked = 0

    def covered_tokens(self, chunk_keys) -> int:
        self.asked += 1
        covered = 0
        for k in chunk_keys:
            if k.digest not in self.held:
                break
            covered = k.end
        return covered

    def close(self) -> None:
        pass


def test_prefix_routing_keeps_a_shared_prefix_on_one_decode_instance(serve):
    p, d0, d1 = Fake("P"), Fake("D0"), Fake("D1")
    decodes = [serve(d0.app).url, serve(d1.app).url]
    proxy = proxy_for(serve, [serve(p.app).url], decodes, ProxyConfig(health=FAST_HEALTH), keyer=FakeKeyer())
    c = client(proxy)
    systems = ["aa bbb c dddd", "eeeee f gg hhh", "i jj kkk llll", "mm n ooo pppp"]  # 4 tokens: one chunk
    owner: dict[str, set[str]] = {s: set() for s in systems}
    for i in range(24):
        system = systems[i % 4]
        resp = ask(c, False, max_tokens=2, extra_body={"prompt": f"{system} user {'q ' * (i % 5)}{i}"})
        owner[system].add(resp.choices[0].text)
    # One instance per system prompt: the one rendezvous hashing of its chunk key picks.
    names = dict(zip(decodes, ("D0-answer", "D1-answer"), strict=True))
    for system, got in owner.items():
        first_key = FakeKeyer().keys_for("", {"prompt": system}).keys[0].digest
        assert got == {names[max(decodes, key=lambda u: RendezvousPlacement.weight(first_key, u))]}, owner

    # Round-robin for the same requests splits every system prompt over both.
    rr = proxy_for(serve, [serve(Fake("P").app).url], decodes, ProxyConfig(routing="round-robin"),
                   keyer=FakeKeyer())
    seen = {ask(client(rr), False, max_tokens=2, extra_body={"prompt": f"{systems[0]} x {i}"}).choices[0].text
            for i in range(4)}
    assert seen == {"D0-answer", "D1-answer"}


def test_direct_decode_skips_prefill_only_for_what_the_store_holds(serve):
    p, d = Fake("P"), Fake("D")
    coverage = FakeCoverage()
    proxy = proxy_for(serve, [serve(p.app).url], [serve(d.app).url],
                      ProxyConfig(direct_decode_max_uncached=2), keyer=FakeKeyer(), coverage=coverage)
    c = client(proxy)
    long_prompt = "a bb ccc dddd eeeee ffffff g hh iii jjjj"  # 10 tokens: chunks of 4, 4, 2
    ask(c, False, max_tokens=2, extra_body={"prompt": long_prompt})
    assert len(p.requests) == 1  # nothing held: through prefill

    ks = FakeKeyer().keys_for("/v1/completions", {"prompt": long_prompt}).keys
    coverage.held.update(k.digest for k in ks[:2])  # 8 of 10 tokens held: 2 uncached
    ask(c, False, max_tokens=2, extra_body={"prompt": long_prompt})
    assert len(p.requests) == 1 and len(d.requests) == 2  # straight to decode
    assert "kv_transfer_params" not in d.bodies()[-1]

    coverage.held.clear()
    coverage.held.add(ks[0].digest)  # 4 of 10 held: 6 uncached, over the threshold
    ask(c, False, max_tokens=2, extra_body={"prompt": long_prompt})
    assert len(p.requests) == 2

    asked = coverage.asked
    ask(c, False, max_tokens=2, extra_body={"prompt": "x y"})  # 2 tokens: short enough, no store call
    assert len(p.requests) == 2 and coverage.asked == asked
    s = stats_of(proxy)
    assert (s["direct_decode"], s["via_prefill"]) == (2, 2)


# --- /health and /v1/models ---------------------------------------------------------------------


def test_health(serve):
    p, d = Fake("P"), Fake("D")
    p_url, d_url, gone = serve(p.app).url, serve(d.app).url, dead_url()
    with httpx.Client(trust_env=False, timeout=10) as h:
        r = h.get(proxy_for(serve, [p_url], [gone, d_url]) + "/health")
        assert r.status_code == 200
        assert r.json()["decode"][d_url] == "ok" and r.json()["down"] == [f"decode {gone}: " + r.json()["decode"][gone]]

        r = h.get(proxy_for(serve, [p_url], [gone]) + "/health")
        assert r.status_code == 503
        assert "no decode instance is healthy" in r.json()["error"]["message"]
        assert r.json()["down"][0].startswith(f"decode {gone}: down")

        p.mode = "unhealthy"
        r = h.get(proxy_for(serve, [p_url], [d_url]) + "/health")
        assert r.status_code == 503
        assert r.json()["prefill"][p_url] == "down (HTTP 503)"


def test_models(serve):
    d = Fake("D1")
    c = client(proxy_for(serve, [dead_url()], [dead_url(), serve(d.app).url]))
    models = c.models.list()
    assert [(m.id, m.owned_by) for m in models.data] == [("fake-model", "D1")]
    with pytest.raises(openai.APIStatusError) as ei:
        client(proxy_for(serve, [dead_url()], [dead_url()])).models.list()
    assert ei.value.status_code == 503


# --- URLs and the command line -------------------------------------------------------------------


def test_normalize_url():
    assert normalize_url("http://127.0.0.1:8100/") == "http://127.0.0.1:8100"
    assert normalize_url("127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert normalize_url("https://h:1/v1/") == "https://h:1"
    for bad in ("ftp://h:1", "http://", ""):
        with pytest.raises(ValueError):
            normalize_url(bad)
    with pytest.raises(ValueError):
        build_app([], ["http://127.0.0.1:1"])


def test_cli_flags(capsys):
    with pytest.raises(SystemExit) as ei:
        main_proxy(["--help"])
    assert ei.value.code == 0 and "--prefill URL [URL ...]" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ei:
        main_proxy(["--prefill", "http://127.0.0.1:1", "--port", "8000"])  # no --decode
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        main_proxy(["--prefill", "ftp://x", "--decode", "http://127.0.0.1:1", "--port", "8000"])
    assert ei.value.code == 2


def test_cli_serves_and_logs(serve):
    p, d = Fake("P"), Fake("D")
    p_url, d_url = serve(p.app).url, serve(d.app).url
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys; from lmcache_mooncake.routing.proxy import main_proxy; "
            "sys.exit(main_proxy(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--prefill", p_url, "--decode", d_url, "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "LMCACHE_MOONCAKE_LOG_LEVEL": "INFO"})
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(trust_env=False, timeout=5) as h:
            deadline = time.monotonic() + 20
            while True:
                try:
                    if h.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, "proxy did not come up"
                time.sleep(0.1)
        assert text_of(ask(client(url), False, max_tokens=4), False) == "D-answer"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert f"prefill={p_url}" in out and f"decode={d_url}" in out and "/v1/completions" in out, out
