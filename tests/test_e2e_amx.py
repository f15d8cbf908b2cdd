"""End to end on a CPU with AMX tiles: bfloat16 KV in vLLM's ``amx`` kernel layout.

On such CPUs vLLM's CPU build serves bfloat16 (its default for this model) with
the ``amx`` attention kernel, which packs each (block, head) of the paged KV in
tiles (``layouts.CpuAttnLayout``). Three fresh vLLM processes at ``--dtype
bfloat16`` share one disk folder:

- ``baseline``: no connector; the tokens a recompute gives.
- ``A``: the connector saves every prompt (gathered out of the tiles).
- ``B``: a new process loads them (scattered into the tiles): greedy tokens
  equal the baseline's, every whole block is cached (vLLM's AMX kernel dies
  when computing starts inside a block: ``cpu_isa.load_granularity``).
- ``C``, the control: the same, after one stored chunk's KV was replaced by
  noise and sealed again (a valid chunk with wrong KV): its prompt's tokens
  change, so B's equality shows loaded KV is used where vLLM reads it.

Skipped where the CPU has no AMX tiles (then vLLM uses the ``vec`` kernels,
which ``test_e2e_vllm.py`` covers).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from lmcache_mooncake.chunks import chunk_format, keys
from lmcache_mooncake.chunks.keys import KeyNamespace, chunk_keys
from lmcache_mooncake.testing.offline import RunSpec, run_instance

CHUNK = 256
BLOCK = 128  # vLLM's CPU block size
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)(),
                       reason="no AMX tiles on this CPU: vLLM uses the vec kernels here"),
]

_rng = random.Random(4321)
# "plus": 2 whole chunks and 18 tokens (a partial block); "long": 3 chunks and 232 tokens.
PROMPTS = {name: [_rng.randrange(16, 2000) for _ in range(n)] for name, n in (("plus", 2 * CHUNK + 18),
                                                                               ("long", 3 * CHUNK + 232))}
NAMES = sorted(PROMPTS)


def _run(model: Path, work: Path, name: str, disk: Path | None) -> dict[str, object]:
    extra = {"max_local_cpu_size": 0.5, "run_dir": str(work / name / "run")}
    if disk is not None:
        extra["local_disk"] = str(disk)
    spec = RunSpec(model=str(model), prompts=[PROMPTS[n] for n in NAMES], kv_role="kv_both" if disk else None,
                   extra_config=extra if disk else {}, dtype="bfloat16", prefix_caching=False, max_tokens=12)
    return dict(zip(NAMES, run_instance(spec, work / name), strict=True))


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("amx")
    disk = work / "disk"
    baseline = _run(model, work, "baseline", None)
    a = _run(model, work, "A", disk)
    b = _run(model, work, "B", disk)
    # The control: chunk 1 of "plus" holds noise, sealed as a valid chunk.
    noisy = work / "disk-noise"
    shutil.copytree(disk, noisy)
    ns = KeyNamespace(model=str(model), kv_dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64,
                      chunk_size=CHUNK)
    second = chunk_keys(ns, PROMPTS["plus"])[1]
    victim = noisy / keys.file_name(ns, second)
    from lmcache.utils import CacheEngineKey

    key = CacheEngineKey(ns.hex(), 1, 0, second.as_int, torch.bfloat16).to_string()  # what its header names
    kv = chunk_format.decode(victim.read_bytes(), key)
    noise = torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)).to(kv.dtype) * 4
    victim.write_bytes(chunk_format.encode(key, noise))
    c = _run(model, work, "C", noisy)
    return baseline, a, b, c


def test_bfloat16_kv_loaded_into_amx_tiles_gives_the_recomputed_tokens(runs):
    baseline, a, b, _ = runs
    assert baseline["plus"].output_ids != baseline["long"].output_ids  # the model reads its prompt
    for name in NAMES:
        assert a[name].output_ids == baseline[name].output_ids, name
        assert a[name].cached_tokens == 0, name
        assert b[name].output_ids == baseline[name].output_ids, name
        assert b[name].cached_tokens == len(PROMPTS[name]) // BLOCK * BLOCK, name  # whole blocks loaded


def test_control_noise_in_a_valid_chunk_changes_the_tokens(runs):
    baseline, _, _, c = runs
    assert c["plus"].cached_tokens == len(PROMPTS["plus"]) // BLOCK * BLOCK  # the noisy chunk was loaded
    assert c["plus"].output_ids != baseline["plus"].output_ids
    assert c["long"].output_ids == baseline["long"].output_ids
