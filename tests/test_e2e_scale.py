"""One proxy in front of 1 prefill and 2 decode vLLMs (real store, real vLLM, the proxy with the
model's tokenizer): a decode instance killed mid-run and restarted, and a repeated prompt that
skips prefill. References come from the prefill instance itself with a fresh ``cache_salt``, so
they are computed from scratch by a single instance."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from servers import Server

from lmcache_mooncake.commands.serve import vllm_command
from lmcache_mooncake.runtime.procs import free_port
from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
from lmcache_mooncake.testing.offline import vllm_env

pytestmark = pytest.mark.e2e
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096", "--enable-prompt-tokens-details"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("scale")
    sd = work / "store"
    start_store(StoreSpec(memory_bytes=512 << 20, state_dir=sd))
    started: list[Server] = []
    try:
        out: dict[str, Server] = {}
        for i, (name, role) in enumerate((("prefill", "prefill"), ("decode0", "decode"), ("decode1", "decode"))):
            port = free_port()
            overrides = {"run_dir": str(work / f"{name}-run"), "load_wait_timeout": 10.0,
                         "mooncake": {"store_dir": str(sd), "timeout": 2.0}}
            env = vllm_env(work / name, {"VLLM_CPU_OMP_THREADS_BIND": str(i % 2)})
            srv = Server(name, vllm_command(role, str(model), "127.0.0.1", port, None, VLLM_ARGS, overrides),
                         env, port, work / f"{name}.log")
            started.append(srv)
            out[name] = srv.start()
        for srv in out.values():
            srv.wait_ready()
        port = free_port()
        proxy = Server("proxy", [sys.executable, "-m", "lmcache_mooncake.cli", "proxy", "--port", str(port),
                                 "--prefill", out["prefill"].url,
                                 "--decode", out["decode0"].url, out["decode1"].url,
                                 "--model", str(model), "--dtype", "float32", "--store-dir", str(sd)],
                       dict(os.environ), port, work / "proxy.log")
        started.append(proxy)
        out["proxy"] = proxy.start().wait_ready(120)
        yield out
    finally:
        for srv in reversed(started):
            srv.kill()
        stop_store(sd)


def complete(url: str, model: Path, prompt, **extra) -> tuple[str, httpx.Headers]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers


def reference(stack, model: Path, prompt) -> str:
    """The prompt computed from scratch by one instance (a new salt shares no cached block)."""
    return complete(stack["prefill"].url, model, prompt, cache_salt=f"ref-{uuid.uuid4().hex}")[0]


def proxy_stats(stack) -> dict:
    return httpx.get(stack["proxy"].url + "/stats", timeout=10, trust_env=False).json()


def finished_requests(srv: Server) -> float:
    """vLLM's own count of requests it finished (its /metrics)."""
    text = httpx.get(srv.url + "/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_repeated_prompt_skips_prefill_with_the_same_tokens(stack, model):
    words = "the quick brown fox jumps over the lazy dog while the cache keeps every chunk".split()
    rng = random.Random(3)
    prompt = " ".join(rng.choice(words) for _ in range(500))  # text: tokenized by the proxy too
    want = reference(stack, model, prompt)
    before = finished_requests(stack["prefill"])

    first, h1 = complete(stack["proxy"].url, model, prompt)
    assert h1["x-prefill-instance"] == stack["prefill"].url  # new to the store: through prefill
    assert finished_requests(stack["prefill"]) == before + 1  # the control: prefill did count it
    second, h2 = complete(stack["proxy"].url, model, prompt)
    assert h2["x-prefill-instance"] == "skipped"
    assert finished_requests(stack["prefill"]) == before + 1  # prefill never saw the repeat
    assert first == second == want
    assert proxy_stats(stack)["direct_decode"] >= 1


def test_decode_killed_mid_run_then_restarted(stack, model):
    rng = random.Random(9)
    prompts = [[rng.randrange(16, 2000) for _ in range(rng.randrange(300, 700))] for _ in range(12)]
    want = [reference(stack, model, p) for p in prompts]
    # With 12 prompts, the chance that prefix routing puts none on decode1 is 1 in 4096.
    d1 = stack["decode1"]
    results: list[tuple[int, str, str]] = []
    errors: list[str] = []
    stop = threading.Event()

    def send() -> None:
        i = 0
        while not stop.is_set():
            k = i % len(prompts)
            try:
                got, headers = complete(stack["proxy"].url, model, prompts[k])
                results.append((k, got, headers["x-decode-instance"]))
            except (AssertionError, httpx.HTTPError) as e:
                errors.append(f"request {i}: {e}")
            i += 1

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 120
        while not any(url == d1.url for _, _, url in results):
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.05)
        d1.kill()  # mid-run: the sender keeps going
        n_killed = len(results)
        deadline = time.monotonic() + 120
        while len(results) < n_killed + 2 * len(prompts):
            assert time.monotonic() < deadline and sender.is_alive(), errors
            time.sleep(0.1)
    finally:
        stop.set()
        sender.join(300)
    assert not errors, errors
    assert all(got == want[k] for k, got, _ in results), [(k, got, want[k]) for k, got, _ in results
                                                          if got != want[k]][:3]
    # After the first few, requests went to decode0 only; decode1's own prompts among them.
    assert {url for _, _, url in results[n_killed + 2:]} == {stack["decode0"].url}
    assert proxy_stats(stack)["decode"][d1.url]["state"].startswith("down")

    d1.start().wait_ready()
    deadline = time.monotonic() + 60
    while proxy_stats(stack)["decode"][d1.url]["state"] != "ok":
        assert time.monotonic() < deadline, proxy_stats(stack)
        time.sleep(0.2)
    served = {}
    for k, p in enumerate(prompts):
        got, headers = complete(stack["proxy"].url, model, p)
        assert got == want[k]
        served[k] = headers["x-decode-instance"]
    assert d1.url in served.values()  # taken back
