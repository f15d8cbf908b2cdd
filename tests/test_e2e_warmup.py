"""Warm-up end to end: a real store, a real vLLM producer, then a decode instance (vLLM's OpenAI
server, kv_consumer, store only) that serves the warmed prompts from the store.

Three vLLM processes start together (the warm-up's producer, the decode server and a plain vLLM
for the reference outputs), so their start-ups overlap.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import pytest
from servers import Server

from lmcache_mooncake.chunks import keys
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.commands.serve import vllm_command
from lmcache_mooncake.obs.metrics_client import fetch
from lmcache_mooncake.runtime.procs import free_port
from lmcache_mooncake.store.client import StoreClient
from lmcache_mooncake.store.launcher import store_status
from lmcache_mooncake.testing.offline import Instance, RunSpec, vllm_env
from lmcache_mooncake.warmup import main_warmup, warmup

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent
CHUNK = 256
MAX_TOKENS = 8
WORDS = "the quick brown fox jumps over the lazy dog while the cache keeps every chunk warm".split()


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 2000) for _ in range(n)]


SYSTEM = "You answer questions about caches. " + words(1, 320)
INPUTS = [
    {"id": "text-long", "prompt": "Document: " + words(2, 500)},
    {"id": "text-short", "prompt": words(3, 40)},
    {"id": "ids", "prompt_token_ids": ids(4, 700)},
    {"id": "ids-salted", "prompt_token_ids": ids(5, 300), "cache_salt": "tenant-a"},
    {"id": "chat-1", "messages": [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "What is kept? " + words(6, 30)}]},
    {"id": "chat-2", "messages": [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Who writes it?"},
                                  {"role": "assistant", "content": words(7, 20)},
                                  {"role": "user", "content": "And who reads it? " + words(8, 60)}]},
]
DOC = "A document given as a .txt file. " + words(9, 350)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("warmup-e2e")


@pytest.fixture(scope="module")
def input_files(work) -> list[Path]:
    f = work / "inputs.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in INPUTS))
    docs = work / "docs"
    docs.mkdir()
    (docs / "doc.txt").write_text(DOC)
    return [f, docs]


@pytest.fixture(scope="module")
def warmed(model, work, store, input_files):
    """Warm up the inputs while the decode server and the reference vLLM start."""
    port = free_port()
    decode = Server(
        "decode",
        vllm_command("decode", str(model), "127.0.0.1", port, None,
                     ["--enforce-eager", "--dtype", "float32", "--enable-prompt-tokens-details"],
                     overrides={"run_dir": str(work / "decode-run"), "mooncake": {"store_dir": str(store)}}),
        vllm_env(work / "decode"), port, work / "decode.log",
    )
    reference = Instance(RunSpec(model=str(model), prompts=[], kv_role=None, prefix_caching=False,
                                 max_tokens=MAX_TOKENS), work / "reference")
    try:
        decode.start()  # waited for after the warm-up
        # Pinned (`warmup --pin soft`), so eviction spares the chunks: see the last test.
        summary = warmup(str(model), REPO / "configs/prefill.yaml", input_files, dtype="float32",
                         overrides={"mooncake": {"store_dir": str(store), "pin": "soft"}}, batch_size=3,
                         work_dir=work / "warmup-1", progress=False)
        reference_out = reference.run([i.token_ids for i in summary.inputs])
        reference.stop()
        decode.wait_ready()
        yield summary, decode, reference_out
    finally:
        decode.kill()
        if reference.proc.poll() is None:
            reference.kill()


def expected_names(model: Path, summary) -> list[str]:
    """Object names computed here, independently of the warmup package, as the worker of a vLLM
    serving --model MODEL --dtype float32 names them."""
    ns = KeyNamespace(model=str(model), kv_dtype="float32", num_layers=4, num_kv_heads=2, head_size=64,
                      chunk_size=CHUNK, chunk_layout="blocks")
    names = []
    for i in summary.inputs:
        names += keys.object_names(ns, i.token_ids, i.cache_salt)
    return list(dict.fromkeys(names))


def test_warmup_writes_every_chunk_under_the_workers_names(model, store, warmed):
    summary, _, _ = warmed
    assert summary.ok, summary.format()
    assert summary.inputs_total == len(INPUTS) + 1 and summary.inputs_done == len(INPUTS) + 1
    assert summary.inputs_failed == summary.inputs_bad == summary.chunks_missing_after == 0
    names = expected_names(model, summary)
    assert sorted(names) == sorted({n for i in summary.inputs for n in i.names})
    # Shared system-prompt chunks are written once: puts == distinct chunks.
    assert summary.chunks_written == len(names) == summary.chunks_to_write
    assert summary.bytes_written > len(names) * 2 * 4 * 128 * 4  # more than the partial chunks' payload alone
    client = StoreClient.from_state(store, timeout_s=2.0)
    try:
        assert all(client.batch_exists(names))
    finally:
        client.close()
    assert store_status(store)["soft_pinned_objects"] >= len(names)
    assert summary.prompt_tokens == sum(len(i.token_ids) for i in summary.inputs)
    assert summary.prompt_tokens_per_s > 0 and summary.work_dir is not None  # we gave the work folder


def test_decode_instance_serves_warmed_prompts_from_the_store(model, work, warmed):
    summary, decode, reference_out = warmed
    by_id = {i.id: i for i in summary.inputs}
    doc = next(i for i in summary.inputs if i.kind == "document")
    requests = [(x, by_id[x["id"]]) for x in INPUTS] + [({"prompt": DOC}, doc)]
    with httpx.Client(base_url=decode.url, timeout=300) as http:
        for (x, item), ref in zip(requests, reference_out, strict=True):
            body = {"model": str(model), "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
            if "cache_salt" in x:
                body["cache_salt"] = x["cache_salt"]
            if "messages" in x:
                r = http.post("/v1/chat/completions", json={**body, "messages": x["messages"]})
            else:
                r = http.post("/v1/completions", json={**body, "prompt": x.get("prompt", x.get("prompt_token_ids"))})
            assert r.status_code == 200, r.text
            data = r.json()
            choice, usage = data["choices"][0], data["usage"]
            # The server rendered the request to exactly the tokens warm-up stored ...
            assert (data.get("prompt_token_ids") or choice.get("prompt_token_ids")) == item.token_ids, item.where
            assert usage["prompt_tokens"] == len(item.token_ids)
            # ... loaded every chunk (the partial last one too) from the store ...
            assert usage["prompt_tokens_details"]["cached_tokens"] == len(item.token_ids) - 1, item.where
            # ... and generated what a plain vLLM computes.
            assert choice["token_ids"] == ref.output_ids, item.where
    time.sleep(0.5)  # the last step's stats reach /metrics just after the answer
    stats = fetch(decode.url)
    # Its CPU tier started empty and it has no disk tier: the hits came from the store.
    assert 0 < stats.count("vllm:lmcm_chunk_hits", tier="store") <= len(expected_names(model, summary))
    assert stats.count("vllm:lmcm_chunks_written", tier="store") == 0 and stats.count("vllm:lmcm_verify_failures") == 0


def test_second_warmup_writes_nothing_and_says_so(model, work, store, input_files, warmed, capsys):
    t0 = time.monotonic()
    out_json = work / "second.json"
    rc = main_warmup(["--model", str(model), "--config", str(REPO / "configs/prefill.yaml"), "--dtype", "float32",
                      *[a for f in input_files for a in ("--input", str(f))], "--no-progress",
                      "--set", f"mooncake.store_dir={store}", "--summary-json", str(out_json),
                      "--work-dir", str(work / "warmup-2")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "nothing to write" in out and "wrote 0 chunks" in out
    s = json.loads(out_json.read_text())
    assert s["inputs_skipped"] == len(INPUTS) + 1 and s["inputs_done"] == 0 and s["chunks_written"] == 0
    assert not (work / "warmup-2" / "vllm").exists()  # no vLLM was started
    assert time.monotonic() - t0 < 60


def test_pinned_warmup_chunks_survive_unpinned_traffic_past_capacity(model, store, warmed):
    summary, _, _ = warmed
    names = expected_names(model, summary)
    client = StoreClient.from_state(store, timeout_s=5.0, local_buffer_bytes=64 << 20)
    try:
        blob = bytes(8 << 20)
        for i in range(64):  # 512 MiB of unpinned 8 MiB objects into a 256 MiB store
            client.batch_put([f"unpinned-{i}"], [blob])
        status = store_status(store)
        assert status["evicted_keys"] > 0, status  # the store really was full
        assert all(client.batch_exists(names)), "a pinned warm-up chunk was evicted"
    finally:
        client.close()
