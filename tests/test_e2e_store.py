"""The Mooncake tier end to end: real master and storage process, real vLLM processes.

Every vLLM process here has its own empty CPU tier and no disk tier, so a hit
can only come from the store.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from lmcache_mooncake.chunks import keys
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.obs.metrics_client import read_offline
from lmcache_mooncake.store.client import StoreClient
from lmcache_mooncake.store.launcher import StoreSpec, read_state, start_store, stop_store
from lmcache_mooncake.testing.offline import Instance, RunSpec, run_instance

pytestmark = pytest.mark.e2e
CHUNK = 256
TIMEOUT = 1.0  # mooncake.timeout for these tests


def rand_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 2000) for _ in range(n)] for n in lengths]


PROMPTS = rand_prompts(7, [300, 512, 700])


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory):
    extra = rand_prompts(8, [600, 530]) + rand_prompts(9, [520] * 3)
    spec = RunSpec(model=str(model), prompts=PROMPTS + extra, kv_role=None, prefix_caching=False, max_tokens=10)
    res = run_instance(spec, tmp_path_factory.mktemp("baseline"))
    return {tuple(p): r.output_ids for p, r in zip(spec.prompts, res, strict=True)}


@pytest.fixture
def store(tmp_path):
    sd = tmp_path / "store"
    start_store(StoreSpec(memory_bytes=512 << 20, state_dir=sd))
    yield sd
    stop_store(sd)


def spec_for(model: Path, store_dir: Path, run_dir: Path, **kw) -> RunSpec:
    extra = {
        "max_local_cpu_size": 0.25,
        "run_dir": str(run_dir),
        "mooncake": {"store_dir": str(store_dir), "timeout": TIMEOUT},
    }
    kw.setdefault("prompts", [])
    return RunSpec(model=str(model), extra_config=extra, prefix_caching=False, max_tokens=10, **kw)


def namespace(model: Path) -> KeyNamespace:
    return KeyNamespace(model=str(model), kv_dtype="float32", num_layers=4, num_kv_heads=2,
                        head_size=64, chunk_size=CHUNK, chunk_layout="blocks")


def object_names(model: Path, prompts: list[list[int]]) -> list[str]:
    ns = namespace(model)
    return [name for p in prompts for name in keys.object_names(ns, p)]


def wait_in_store(store_dir: Path, names: list[str], timeout_s: float = 60.0) -> None:
    client = StoreClient.from_state(store_dir, timeout_s=2.0)
    try:
        deadline = time.monotonic() + timeout_s
        while not all(client.batch_exists(names)):
            assert time.monotonic() < deadline, "chunks did not reach the store"
            time.sleep(0.2)
    finally:
        client.close()


def expect_full_hits(results, prompts):
    for p, r in zip(prompts, results, strict=True):
        assert r.cached_tokens == len(p) - 1, (len(p), r.cached_tokens)


def test_second_instance_hits_from_store_only(model, store, baseline, tmp_path):
    a = spec_for(model, store, tmp_path / "a-run")
    with Instance(a, tmp_path / "a") as inst:
        res_a = inst.run(PROMPTS)
        inst.stop()
    for p, r in zip(PROMPTS, res_a, strict=True):
        assert r.output_ids == baseline[tuple(p)] and r.cached_tokens == 0
    assert read_offline(tmp_path / "a-run").count("vllm:lmcm_chunks_written", tier="store") == len(
        object_names(model, PROMPTS))

    b = spec_for(model, store, tmp_path / "b-run")
    with Instance(b, tmp_path / "b") as inst:
        res_b = inst.run(PROMPTS)
        inst.stop()
    for p, r in zip(PROMPTS, res_b, strict=True):
        assert r.output_ids == baseline[tuple(p)]
    expect_full_hits(res_b, PROMPTS)
    stats = read_offline(tmp_path / "b-run")
    assert stats.count("vllm:lmcm_chunk_hits", tier="store") == len(object_names(model, PROMPTS))
    assert stats.count("vllm:lmcm_verify_failures") == 0


def test_chunks_survive_a_killed_writer(model, store, baseline, tmp_path):
    prompts = rand_prompts(8, [600, 530])
    writer = Instance(spec_for(model, store, tmp_path / "w-run"), tmp_path / "w")
    try:
        writer.run(prompts)
        wait_in_store(store, object_names(model, prompts))
    finally:
        writer.kill()  # SIGKILL: no shutdown, no drain
    assert writer.proc.returncode == -signal.SIGKILL

    res = run_instance(spec_for(model, store, tmp_path / "r-run", prompts=prompts), tmp_path / "r")
    for p, r in zip(prompts, res, strict=True):
        assert r.output_ids == baseline[tuple(p)]
    expect_full_hits(res, prompts)


def test_store_down_recomputes_then_resumes_without_restart(model, store, baseline, tmp_path):
    down, after = rand_prompts(9, [520] * 3)[:2], rand_prompts(9, [520] * 3)[2:]
    inst = Instance(spec_for(model, store, tmp_path / "c-run"), tmp_path / "c")
    try:
        inst.run(rand_prompts(11, [40]))  # warm up: engine started and connected
        state = read_state(store)
        os.kill(state.master_pid, signal.SIGKILL)
        t0 = time.monotonic()
        res = inst.run(down)
        elapsed = time.monotonic() - t0
        for p, r in zip(down, res, strict=True):
            assert r.output_ids == baseline[tuple(p)]
            assert r.cached_tokens == 0
            # Each request waits at most one store timeout (lookup) plus compute.
            assert r.ttft_s < TIMEOUT + 3.0, r.ttft_s
        assert elapsed < 2 * (TIMEOUT + 3.0)

        time.sleep(0.6)  # counters are written at most every 0.5 s, at a step
        inst.run(rand_prompts(12, [40]))
        before = read_offline(tmp_path / "c-run").count("vllm:lmcm_store_reconnects")
        stop_store(store)
        # Same ports: the vLLM process keeps the addresses it started with.
        start_store(StoreSpec(memory_bytes=512 << 20, state_dir=store, master_port=state.master_port,
                              metadata_port=state.metadata_port, metrics_port=state.metrics_port,
                              client_port=state.client_port))
        # The client reconnects on its own (with back-off); small requests
        # give it the chance, and the counters show when it has.
        deadline = time.monotonic() + 60
        seed = 100
        while read_offline(tmp_path / "c-run").count("vllm:lmcm_store_reconnects") <= before:
            assert time.monotonic() < deadline, "the store client did not reconnect"
            seed += 1
            inst.run(rand_prompts(seed, [40]))
            time.sleep(0.5)
        # The same vLLM process, never restarted, saves new prompts to the store again.
        res = inst.run(after)
        for p, r in zip(after, res, strict=True):
            assert r.output_ids == baseline[tuple(p)]
        wait_in_store(store, object_names(model, after), timeout_s=30)
        inst.stop()
    finally:
        if inst.proc.poll() is None:
            inst.kill()
    stats = read_offline(tmp_path / "c-run")
    # the outage was counted
    assert stats.count("vllm:lmcm_store_errors", kind="timeout") + stats.count("vllm:lmcm_store_errors",
                                                                             kind="unavailable") > 0

    res = run_instance(spec_for(model, store, tmp_path / "d-run", prompts=after), tmp_path / "d")
    expect_full_hits(res, after)


def test_store_smaller_than_working_set_evicts_and_stays_correct(model, tmp_path, baseline):
    sd = tmp_path / "small-store"
    start_store(StoreSpec(memory_bytes=24 << 20, state_dir=sd))  # about 20 chunks of 1 MiB
    try:
        prompts = rand_prompts(12, [2048] * 8)  # 64 chunks
        spec = spec_for(model, sd, tmp_path / "f-run", prompts=prompts)
        res_write = run_instance(spec, tmp_path / "f")
        # A consumer only loads, so what it finds is what the writer left.
        reader = spec_for(model, sd, tmp_path / "g-run", prompts=prompts, kv_role="kv_consumer")
        res_read = run_instance(reader, tmp_path / "g")
        ref = run_instance(RunSpec(model=str(model), prompts=prompts, kv_role=None, prefix_caching=False,
                                   max_tokens=10), tmp_path / "ref")
        for w, r, b in zip(res_write, res_read, ref, strict=True):
            assert w.output_ids == b.output_ids and r.output_ids == b.output_ids
        stats = read_offline(tmp_path / "f-run")
        assert stats.count("vllm:lmcm_chunks_written", tier="store") + stats.count("vllm:lmcm_write_errors",
                                                                                  tier="store") == 64
        hits = sum(r.cached_tokens for r in res_read)
        assert 0 < hits < sum(len(p) - 1 for p in prompts)  # some, not all: the store evicted
    finally:
        stop_store(sd)


def test_producer_then_consumer_roles(model, store, baseline, tmp_path):
    prompts = PROMPTS
    # vLLM's three-process layout: its engine process steps on after an answer, which is when a
    # held request is seen durable; in one process nothing steps between batches.
    prod = spec_for(model, store, tmp_path / "p-run", kv_role="kv_producer", in_process=False)
    with Instance(prod, tmp_path / "p") as inst:
        res_p = inst.run(prompts)
        inst.stop()
    promises = [r.kv_transfer_params for r in res_p]
    for p, promise in zip(prompts, promises, strict=True):
        assert promise == {"lmcache_mooncake": {"stored_prompt_tokens": len(p)}}
    # The producer held each request until its chunks were in the store.
    assert read_offline(tmp_path / "p-run").count("vllm:lmcm_producer_requests_durable") == len(prompts)

    cons = spec_for(model, store, tmp_path / "c-run", kv_role="kv_consumer")
    cons.extra_config["load_wait_timeout"] = 2.0
    never_stored = rand_prompts(8, [600])  # in the baseline, never written by anyone
    with Instance(cons, tmp_path / "c") as inst:
        res_c = inst.run(prompts, kv_transfer_params=promises)
        # A promise nobody kept: the consumer waits up to load_wait_timeout, then computes.
        fake = [{"lmcache_mooncake": {"stored_prompt_tokens": 600}}]
        res_fake = inst.run(never_stored, kv_transfer_params=fake)
        inst.stop()
    for p, r in zip(prompts, res_c, strict=True):
        assert r.output_ids == baseline[tuple(p)]
    expect_full_hits(res_c, prompts)
    assert res_fake[0].output_ids == baseline[tuple(never_stored[0])]
    assert res_fake[0].cached_tokens == 0
    assert res_fake[0].ttft_s >= 2.0
    stats = read_offline(tmp_path / "c-run")
    assert stats.count("vllm:lmcm_consumer_requests") == len(prompts) + 1
    assert stats.count("vllm:lmcm_consumer_short_hits") == 1
    assert stats.count("vllm:lmcm_chunks_written", tier="store") == 0  # a consumer saves nothing
