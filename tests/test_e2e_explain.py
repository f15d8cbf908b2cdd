"""``explain`` against a real store that a real warm-up filled: the silent 0% hit rate of a
warm-up at ``--dtype auto`` (bfloat16 for this float32 model on the CPU build) read by an
instance serving ``--dtype float32`` is named as a kv dtype difference; at the warm-up's dtype
every chunk is reported held.

One vLLM process (the warm-up's producer) and one store; explain itself starts no vLLM.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lmcache_mooncake.chunks import namespaces
from lmcache_mooncake.cli import main
from lmcache_mooncake.kv.layouts import chunk_layout_for
from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
from lmcache_mooncake.warmup import warmup

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent
rng = random.Random(11)
TOKENS = [rng.randrange(16, 2000) for _ in range(600)]  # 3 chunks of 256, the last partial


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    sd = tmp_path_factory.mktemp("explain-e2e") / "store"
    start_store(StoreSpec(memory_bytes=128 << 20, state_dir=sd))
    yield sd
    stop_store(sd)


@pytest.fixture(scope="module")
def warmed(model, store, tmp_path_factory):
    """A warm-up as a new user runs it: the default --dtype auto."""
    summary = warmup(str(model), REPO / "configs/prefill.yaml", [{"prompt_token_ids": TOKENS}],
                     overrides={"mooncake": {"store_dir": str(store)}},
                     work_dir=tmp_path_factory.mktemp("explain-warmup"), progress=False)
    assert summary.ok, summary.format()
    return summary


def explain_json(capsys, model, store, dtype):
    rc = main(["explain", "--model", str(model), "--config", str(REPO / "configs/decode.yaml"),
               "--set", f"mooncake.store_dir={store}", "--dtype", dtype,
               "--token-ids", json.dumps(TOKENS), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_warmup_at_auto_dtype_wrote_bfloat16_chunks_and_their_manifest(warmed, store):
    from lmcache_mooncake.store.client import StoreClient

    # The trap itself: auto resolves to bfloat16 on the CPU build for a float32 model.
    assert warmed.kv_dtype == "bfloat16" and warmed.chunks_written == 3
    with StoreClient.from_state(store, timeout_s=5.0, local_buffer_bytes=1 << 20) as client:
        assert client.batch_exists([namespaces.store_manifest_name(warmed.namespace)]) == [True]


def test_explain_names_kv_dtype_for_a_float32_reader(warmed, model, store, capsys):
    rc, report = explain_json(capsys, model, store, "float32")
    assert rc == 1
    assert report["namespace"]["kv_dtype"] == "float32" and report["held_chunks"] == 0
    assert [c["held"] for c in report["chunks"]] == [{"store": False}] * 3
    best = report["elsewhere"][0]
    assert (best["tier"], best["namespace"], best["chunks_held"]) == ("store", warmed.namespace, 3)
    # bfloat16 chunks are token-major where vLLM picks its AMX kernel for bfloat16 (layouts.py).
    bf16_layout = chunk_layout_for("CPU_ATTN", "bfloat16", 128, report["namespace"]["head_size"], 256)
    assert [(d["field"], d["stored"], d["wanted"]) for d in best["differences"]] == [
        ("kv_dtype", "bfloat16", "float32")] + (
        [("chunk_layout", bf16_layout, "blocks")] if bf16_layout != "blocks" else [])
    assert "stored with kv dtype bfloat16, this instance uses float32" in report["verdict"]


def test_explain_reports_every_chunk_held_at_the_warmup_dtype(warmed, model, store, capsys):
    rc, report = explain_json(capsys, model, store, "bfloat16")
    assert rc == 0
    assert report["namespace_digest"] == warmed.namespace
    assert [c["held"] for c in report["chunks"]] == [{"store": True}] * 3
    assert report["elsewhere"] == [] and report["verdict"].startswith("held: all 3 chunks")
