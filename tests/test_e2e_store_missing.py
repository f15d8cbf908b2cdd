"""vLLM started while its Mooncake store is missing: it serves, then attaches when the store appears.

Both ways of naming the store behave alike: ``master_address: auto`` with no
store recorded by ``lmcache-mooncake store up``, and explicit addresses where
nothing listens. The instance starts, answers with the tokens a recompute
gives, logs one warning saying what to do, and once a store is started, a
later request's chunks reach it (control: the store held none of them before
and the counters show no put before).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from lmcache_mooncake.chunks import keys
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.obs.stats import read_dumps
from lmcache_mooncake.store.client import StoreClient
from lmcache_mooncake.store.launcher import StoreSpec, free_port, start_store, stop_store
from lmcache_mooncake.testing.offline import Instance, RunSpec, run_instance

pytestmark = pytest.mark.e2e
CHUNK = 256
TIMEOUT = 1.0
WARNING = "Until then chunks are neither loaded from nor saved to the store"


def rand_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 2000) for _ in range(n)] for n in lengths]


BEFORE = rand_prompts(21, [520, 300])
AFTER = rand_prompts(22, [600])



@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory):
    spec = RunSpec(model=str(model), prompts=BEFORE + AFTER, kv_role=None, prefix_caching=False, max_tokens=10)
    res = run_instance(spec, tmp_path_factory.mktemp("baseline"))
    return {tuple(p): r.output_ids for p, r in zip(spec.prompts, res, strict=True)}


def object_names(model: Path, prompts: list[list[int]]) -> list[str]:
    ns = KeyNamespace(model=str(model), kv_dtype="float32", num_layers=4, num_kv_heads=2, head_size=64,
                      chunk_size=CHUNK, chunk_layout="blocks")
    return [name for p in prompts for name in keys.object_names(ns, p)]


def stored(store_dir: Path, names: list[str]) -> list[bool]:
    with StoreClient.from_state(store_dir, timeout_s=2.0, local_buffer_bytes=1 << 20) as client:
        return client.batch_exists(names)


def serve_without_then_with_store(model, baseline, tmp_path: Path, mooncake: dict, start) -> None:
    run_dir = tmp_path / "run"
    spec = RunSpec(model=str(model), prompts=[], prefix_caching=False, max_tokens=10,
                   extra_config={"max_local_cpu_size": 0.25, "run_dir": str(run_dir),
                                 "mooncake": {"timeout": TIMEOUT, **mooncake}})
    # Short folder names: vLLM's IPC sockets live under it, and a socket path has at most 107 bytes.
    with Instance(spec, tmp_path / "i") as inst:
        res = inst.run(BEFORE)
        for p, r in zip(BEFORE, res, strict=True):
            assert r.output_ids == baseline[tuple(p)]
            assert r.cached_tokens == 0
            assert r.ttft_s < TIMEOUT + 3.0, r.ttft_s  # no store call waited past its timeout
        time.sleep(0.6)  # counters are written at most every 0.5 s, at a step
        inst.run(rand_prompts(30, [40]))
        before = read_dumps(run_dir)
        assert before.get("store_puts", 0) == 0
        store_dir = start()
        try:
            assert not any(stored(store_dir, object_names(model, AFTER)))
            # The tier attaches by itself (with back-off); small requests give it steps.
            deadline, seed = time.monotonic() + 60, 31
            while True:
                c = read_dumps(run_dir)
                if c.get("store_client_attached") and c.get("store_client_reconnects", 0) > 0:
                    break
                assert time.monotonic() < deadline, f"the tier did not attach: {c}"
                seed += 1
                inst.run(rand_prompts(seed, [40]))
                time.sleep(0.5)
            res = inst.run(AFTER)
            assert res[0].output_ids == baseline[tuple(AFTER[0])]
            names = object_names(model, AFTER)
            deadline = time.monotonic() + 30
            while not all(stored(store_dir, names)):
                assert time.monotonic() < deadline, "the later request's chunks did not reach the store"
                time.sleep(0.3)
            inst.stop()
        finally:
            stop_store(store_dir)
    after = read_dumps(run_dir)
    assert after["store_puts"] >= len(names)
    log = inst.log_path.read_text()
    assert log.count(WARNING) == 1, "expected exactly one 'store missing' warning"


def test_auto_missing_store_serves_then_attaches(model, baseline, tmp_path):
    store_dir = tmp_path / "store"  # nothing recorded here yet

    def start() -> Path:
        start_store(StoreSpec(memory_bytes=128 << 20, state_dir=store_dir))
        return store_dir

    serve_without_then_with_store(model, baseline, tmp_path, {"store_dir": str(store_dir)}, start)


def test_explicit_missing_store_serves_then_attaches(model, baseline, tmp_path):
    ports = dict(master_port=free_port(), metadata_port=free_port(), metrics_port=free_port(),
                 client_port=free_port())
    mooncake = {"master_address": f"127.0.0.1:{ports['master_port']}",
                "metadata_server": f"http://127.0.0.1:{ports['metadata_port']}/metadata"}

    def start() -> Path:
        store_dir = tmp_path / "store"
        start_store(StoreSpec(memory_bytes=128 << 20, state_dir=store_dir, **ports))
        return store_dir

    serve_without_then_with_store(model, baseline, tmp_path, mooncake, start)
