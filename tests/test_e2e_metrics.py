"""Our counters on a real vLLM server's /metrics and log line, our chunks as its KV events,
``lmcache-mooncake stats`` against it, and the namespace line in its log.

One kv_both server (vLLM's own prefix cache off, so a repeat is served by our
tiers) with a real store and vLLM's ZMQ KV-event publisher on loopback, a CPU
tier that holds one prompt, and a ``run_dir`` deeper than a Unix socket path may be.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from servers import Server

from lmcache_mooncake.chunks import keys
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.commands.serve import vllm_command
from lmcache_mooncake.obs.metric_names import FAMILIES
from lmcache_mooncake.obs.metrics_client import fetch
from lmcache_mooncake.runtime.procs import free_port
from lmcache_mooncake.testing.offline import vllm_env

pytestmark = pytest.mark.e2e
CHUNK = 256
PROMPT = [random.Random(3).randrange(16, 2000) for _ in range(700)]  # 2 full chunks and a partial one
OTHER = [random.Random(4).randrange(16, 2000) for _ in range(700)]
#: The CPU tier holds one prompt's chunks (1 MiB a full chunk here): OTHER evicts PROMPT's.
CPU_CAP = 3 << 20


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("metrics")


class Subscriber:
    """vLLM's KV-event stream (ZMQ SUB), decoded into KVEventBatch objects on a thread.

    vLLM binds its PUB socket only to a wildcard endpoint (``tcp://*:port``) and
    connects it to any other; so to stay on loopback the subscriber binds."""

    def __init__(self, endpoint: str):
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.bind(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(self.decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def server(model, work, store):
    port, events_port = free_port(), free_port()
    # A run_dir too deep for a Unix socket path (107 bytes): the lookup socket must not live in it.
    run_dir = work / "a-run-folder-deeper-than-a-unix-socket-path" / "may-be-long-for-the-lookup-socket-in-it"
    assert len(str(run_dir / "lookup-0123456789ab.sock").encode()) > 107
    overrides = {"run_dir": str(run_dir), "local_disk": str(work / "disk"), "max_local_cpu_size": CPU_CAP / 2**30,
                 "mooncake": {"store_dir": str(store), "timeout": 2.0}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}"}
    args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096", "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events)]
    srv = Server("both", vllm_command("both", str(model), "127.0.0.1", port, None, args, overrides),
                 vllm_env(work / "both"), port, work / "both.log")
    sub = Subscriber(f"tcp://127.0.0.1:{events_port}")
    try:
        srv.start().wait_ready()
        yield srv, sub
    finally:
        srv.kill()
        sub.close()


def complete(url: str, model: Path, prompt: list[int]) -> tuple[list[str], int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   json={"model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0.0})
    r.raise_for_status()
    body = r.json()
    time.sleep(0.5)  # vLLM's API process records a step's stats just after answering
    return body["choices"][0]["text"], int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                                           or 0)


def namespace(model: Path) -> KeyNamespace:
    return KeyNamespace(model=str(model), kv_dtype="float32", num_layers=4, num_kv_heads=2, head_size=64,
                        chunk_size=CHUNK, chunk_layout="blocks")


@pytest.fixture(scope="module")
def two_requests(server, model):
    """The prompt once (computed and saved), then again (loaded); /metrics read before, between, after."""
    srv, _ = server
    before = fetch(srv.url)
    first = complete(srv.url, model, PROMPT)
    between = fetch(srv.url)
    second = complete(srv.url, model, PROMPT)
    after = fetch(srv.url)
    return before, first, between, second, after


def test_metrics_endpoint_counts_a_cached_request(two_requests):
    before, (text1, cached1), between, (text2, cached2), after = two_requests
    # Every metric we register is on /metrics from the start.
    for fam in FAMILIES:
        suffix = "_total" if fam.kind == "counter" else "_count"
        assert fam.name + suffix in before.names(), fam.name
    assert before.count("vllm:lmcm_loaded_tokens") == 0
    # First request: looked up (nothing found), computed, saved; nothing loaded.
    assert cached1 == 0 and between.count("vllm:lmcm_lookups") >= 1
    assert between.count("vllm:lmcm_lookup_hit_tokens") == 0 and between.count("vllm:lmcm_loaded_tokens") == 0
    assert between.count("vllm:lmcm_saved_tokens") == len(PROMPT)
    # Second: the same answer, every prompt token but the last loaded from our tiers.
    assert text2 == text1 and cached2 == len(PROMPT) - 1
    assert after.count("vllm:lmcm_loaded_tokens") == len(PROMPT) - 1
    assert after.count("vllm:lmcm_lookup_hit_tokens") >= len(PROMPT)
    assert after.count("vllm:lmcm_load_seconds_count") == 1 and after.value("vllm:lmcm_load_seconds_sum") > 0
    # The first request's writes (done behind it) were counted by the second's steps.
    assert after.count("vllm:lmcm_chunks_written", tier="store") == 3
    assert after.count("vllm:lmcm_chunks_written", tier="disk") == 3
    assert after.count("vllm:lmcm_written_bytes", tier="store") > 3 * 2 * 4 * 2 * 64 * 4  # > the KV of 3 tokens
    assert after.count("vllm:lmcm_verify_failures") == 0 and after.count("vllm:lmcm_store_errors") == 0


def test_vllm_counts_the_loaded_tokens_under_the_tier_that_served_them(two_requests):
    _, _, between, _, after = two_requests

    def by_source(m):
        return m.labels("vllm:prompt_tokens_cached_by_source", "source")

    grew = {k: int(v - between.value("vllm:prompt_tokens_cached_by_source", source=k))
            for k, v in by_source(after).items()}
    # The repeat was served from the CPU tier: vLLM counts it as "host". Without our
    # get_external_cache_hit_sources vLLM files it all under "external_unspecified".
    assert grew == {"device": 0, "host": len(PROMPT) - 1, "p2p": 0, "disk": 0, "external_unspecified": 0}
    assert sum(grew.values()) == after.count("vllm:external_prefix_cache_hits") == len(PROMPT) - 1


def test_kv_events_name_the_stored_chunks(server, two_requests, model):
    _, sub = server
    want = [k.digest for k in keys.chunk_keys(namespace(model), PROMPT)]
    deadline = time.monotonic() + 10
    while True:
        stored = [e for e in sub.events if type(e).__name__ == "BlockStored" and e.medium == "lmcm"]
        if stored or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # One event for the one save: our chunk keys, in order, with the prompt's tokens.
    assert len(stored) == 1, sub.events
    ev = stored[0]
    assert [bytes(h) for h in ev.block_hashes] == want
    assert ev.parent_block_hash is None and ev.block_size == CHUNK and ev.token_ids == PROMPT


def test_stats_command_reads_the_instance_and_the_store(server, two_requests, store):
    srv, _ = server
    out = subprocess.run([sys.executable, "-m", "lmcache_mooncake.cli", "stats", "--url", srv.url, "--json",
                          "--state-dir", str(store)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    (inst,) = rep["instances"].values()
    assert inst["loaded_tokens"] == len(PROMPT) - 1 and inst["tiers"]["store"]["chunks_written"] == 3
    assert inst["cached_tokens_by_source"] == {"host": len(PROMPT) - 1}
    assert rep["store"]["keys"] >= 3 and 0 < rep["store"]["used_bytes"] <= rep["store"]["capacity_bytes"]
    table = subprocess.run([sys.executable, "-m", "lmcache_mooncake.cli", "stats", "--url", srv.url, "--no-store"],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and srv.url.removeprefix("http://") in table.stdout, table.stderr
    down = subprocess.run([sys.executable, "-m", "lmcache_mooncake.cli", "stats", "--url", "http://127.0.0.1:9",
                           "--no-store"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "could not read metrics from http://127.0.0.1:9/metrics" in down.stdout


def test_log_has_namespace_and_transfer_metrics(server, two_requests, model):
    srv, _ = server
    ns = namespace(model)
    # vLLM logs its stats every 10 s; our counters are in its "KV Transfer metrics" line.
    deadline = time.monotonic() + 15
    while "KV Transfer metrics" not in srv.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    log = srv.log.read_text()
    assert f"key namespace {ns.hex()} = model {str(model)!r}, KV dtype float32, 4 layers, 2 KV heads" in log
    line = next(x for x in log.splitlines() if "KV Transfer metrics" in x)
    assert "loaded_tokens=" in line or "saved_tokens=" in line, line


# Last in the file: it changes the counters the tests above read.
def test_a_repeat_evicted_from_the_cpu_tier_counts_as_disk(server, model, two_requests):
    srv, _ = server
    _, (text1, _), _, _, _ = two_requests
    complete(srv.url, model, OTHER)  # computed and saved; PROMPT's chunks leave the CPU tier
    before = fetch(srv.url)
    text, cached = complete(srv.url, model, PROMPT)
    after = fetch(srv.url)
    grew = {k: int(v - before.value("vllm:prompt_tokens_cached_by_source", source=k))
            for k, v in after.labels("vllm:prompt_tokens_cached_by_source", "source").items()}
    # Found on disk (not in the CPU tier, and the disk is asked before the store), loaded, same answer.
    assert after.count("vllm:lmcm_chunk_hits", tier="disk") - before.count("vllm:lmcm_chunk_hits", tier="disk") == 3
    assert text == text1 and cached == len(PROMPT) - 1
    assert grew == {"device": 0, "host": 0, "p2p": 0, "disk": len(PROMPT) - 1, "external_unspecified": 0}
