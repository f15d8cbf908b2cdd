"""The layer-wise pipeline's copies (connector/layerwise.py) on CPU tensors, for the CPU
layout and vLLM's GPU layout: what a layer-wise save stages is what a whole-step save
gathers, a layer-wise load writes the loaded tokens and no other, and a layer whose hook
never came is reported. The worker and LMCache's engine around it: engine_checks.py
(``layerwise_*``); real vLLM: test_e2e_vllm.py."""

from __future__ import annotations

import pytest
import torch

from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.connector import layerwise
from lmcache_mooncake.connector.scheduler import SchedulerSide
from lmcache_mooncake.kv import layouts

L, B, H, N, D = 3, 24, 2, 16, 8


def _kv(layout_name: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(L, B, H, N, 2 * D, generator=g)
    if layout_name != "CPU_ATTN":  # vLLM's GPU layout may have any strides (HND physical order)
        kv = kv.transpose(2, 3).contiguous().transpose(2, 3)
    return list(kv.unbind(0))


def _gather(layout, kv_layer, slots):
    out = torch.empty(2, len(slots), H * D)
    layout.gather(kv_layer, slots, out)
    return out


def _slots(blocks: list[int], n: int) -> list[int]:
    return [blocks[t // N] * N + t % N for t in range(n)]


LAYOUTS = ["CPU_ATTN", "FLASH_ATTN"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layerwise_save_stages_what_a_whole_step_save_gathers(name):
    layout = _layout(name)
    kv = _kv(name)
    # Two prompts in one step; they share their first block (vLLM's prefix cache).
    a, b = _slots([5, 9, 2, 17], 60), _slots([5, 11, 3], 40)
    saver = layerwise.LayerwiseSaver(kv, N)
    saver.begin([a, b], [0, 16])
    for i, layer in enumerate(kv):
        saver.layer(i, layer)
    staged = saver.finish()
    assert len(staged) == 2 and all(s.kv_caches is not None for s in staged)
    for slots, skip, s in zip([a, b], [0, 16], staged, strict=True):
        for i in range(L):
            want = _gather(layout, kv[i], torch.tensor(slots[skip:]))
            got = _gather(layout, s.kv_caches[i], s.slots[skip:])
            assert torch.equal(got, want), (i, skip)
    # Only the blocks of saved tokens were staged: 5, 9, 2, 17 of a; 11, 3 of b (its block 5 is skipped).
    assert s.kv_caches[0].shape[0] == 6


def test_a_save_whose_layers_did_not_all_come_falls_back_to_paged_kv():
    kv = _kv("CPU_ATTN")
    saver = layerwise.LayerwiseSaver(kv, N)
    saver.begin([_slots([1, 2], 20)], [0])
    saver.layer(0, kv[0])
    (staged,) = saver.finish()
    assert staged.kv_caches is None and staged.slots is None
    assert not saver.active and saver.finish() == []


def _layout(name: str):
    return layouts.layout_for_backend(name, cpu_isa="vec") if name == "CPU_ATTN" else layouts.layout_for_backend(name)


def _load_once(name: str, first: int, start: int, end: int, whole_blocks: bool = False):
    """One layer-wise load of tokens [start, end) (chunks read from ``first``), with vLLM's KV
    update of the step's new tokens (those from ``end`` on in the last block) landing in paged
    KV after ``begin`` and before each layer's wait, as it does in vLLM."""
    layout = _layout(name)
    paged = _kv(name, seed=1)
    cached = _kv(name, seed=2)  # what the tiers hold for this prompt
    new = _kv(name, seed=3)  # the step's own new tokens, written by vLLM's KV update
    slots = _slots([7, 3, 20, 14, 9], 80)
    tail = torch.tensor(slots[end:])
    loader = layerwise.LayerwiseLoader(paged, N, layout)
    (into,) = loader.begin([(slots[:end], first, start)])
    if whole_blocks:  # the control: every staged block written back whole
        bmap = loader._step.map
        loader._plan = layerwise._Back(bmap.blocks, torch.arange(len(bmap.blocks)), True,
                                       torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    # What the worker's load does: write tokens [start, end) of the staging copy (at its slots).
    src = torch.tensor(slots[start:end])
    for i in range(L):
        layout.scatter(into.kv_caches[i], torch.tensor(into.slots[start:end]), _gather(layout, cached[i], src))
    loader.start()
    for i in range(L):
        layout.scatter(paged[i], tail, _gather(layout, new[i], tail))  # vLLM's KV update of layer i
        loader.wait_layer(i)
    assert loader.finish() == []
    loader.finish_all()
    before = _kv(name, seed=1)
    for i in range(L):
        layout.scatter(before[i], tail, _gather(layout, new[i], tail))
    return layout, paged, before, cached, slots[:end]


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layerwise_load_writes_the_loaded_tokens_and_no_other(name):
    # start (40) inside a block; end (70) inside the last block, whose tokens from 70 on are
    # the step's new ones, written by vLLM before the layer's wait: all must stay as they are.
    first, start, end = 32, 40, 70
    layout, paged, before, cached, slots = _load_once(name, first, start, end)
    loaded = torch.tensor(slots[start:end])
    others = torch.tensor(sorted(set(range(B * N)) - set(slots[start:end])))
    for i in range(L):
        assert torch.equal(_gather(layout, paged[i], loaded), _gather(layout, cached[i], loaded)), i
        assert torch.equal(_gather(layout, paged[i], others), _gather(layout, before[i], others)), i


def test_the_control_writing_whole_blocks_back_undoes_the_steps_new_tokens():
    """The check above can fail: a whole-block write-back of the last, partly loaded block
    overwrites the step's new tokens that vLLM's KV update had just written (the wrong greedy
    tokens seen on real vLLM before the write-back went token by token)."""
    layout, paged, before, _, slots = _load_once("CPU_ATTN", 32, 40, 70, whole_blocks=True)
    new_tokens = torch.tensor(_slots([7, 3, 20, 14, 9], 80)[70:])
    assert not torch.equal(_gather(layout, paged[0], new_tokens), _gather(layout, before[0], new_tokens))


def test_a_layer_vllm_never_waited_for_is_reported():
    kv = _kv("CPU_ATTN")
    loader = layerwise.LayerwiseLoader(kv, N, _layout("CPU_ATTN"))
    loader.begin([(_slots([1, 2], 32), 0, 0)])
    loader.start()
    loader.wait_layer(0)
    loader.wait_layer(2)
    assert loader.finish() == [1]


def test_block_map_refuses_a_slot_outside_its_blocks():
    bmap = layerwise.BlockMap.of([torch.tensor([16, 17, 48])], N)
    assert bmap.blocks.tolist() == [1, 3]
    assert bmap.remap(torch.tensor([17, 48, 49])).tolist() == [1, 16, 17]
    with pytest.raises(ValueError, match="outside"):
        bmap.remap(torch.tensor([32]))


@pytest.mark.parametrize(("layerwise_on", "async_loading", "expected"),
                         [(False, True, True), (True, True, False), (False, False, False)])
def test_layerwise_loads_run_in_the_step(tmp_path, layerwise_on, async_loading, expected):
    cfg = CacheConfig(layerwise=layerwise_on, async_loading=async_loading)
    sched = SchedulerSide(cfg, 16, lookup=None, save=True, load=True,  # type: ignore[arg-type]
                          stats_path=tmp_path / "s.json")
    assert sched._load_async is expected


def test_layerwise_asks_vllm_for_piecewise_cuda_graphs():
    from lmcache_mooncake.connector import LMCacheMooncakeConnector

    assert LMCacheMooncakeConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
    assert LMCacheMooncakeConnector.requires_piecewise_for_cudagraph({}) is False
