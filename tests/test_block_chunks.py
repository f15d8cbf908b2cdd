"""Chunks in the backend's own block layout (``block_chunks``): what they hold, and that their
copies write exactly what the token-major copies (checked against vLLM in test_layouts) write."""

from __future__ import annotations

import pytest
import torch
from test_layouts import same_bits, same_view, storage_bytes, vllm_kv_caches, whole_block_slots

from lmcache_mooncake.kv import block_chunks, paged_copy
from lmcache_mooncake.kv.layouts import CpuAttnLayout, GpuPagedLayout
from lmcache_mooncake.kv.paged_copy import gather_chunk, scatter_chunk

L, BLOCKS, H, N, D = 3, 10, 2, 16, 8


def caches(seed: int, apart: bool = False, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """CPU_ATTN caches as vLLM allocates them (one allocation), or each layer on its own."""
    gen = torch.Generator().manual_seed(seed)
    kv = vllm_kv_caches("LBHNC", layers=L, blocks=BLOCKS, heads=H, block_size=N, head_size=D, dtype=dtype, gen=gen)
    return [t.clone() for t in kv] if apart else kv


def test_a_blocks_chunk_holds_each_whole_block_as_the_cache_stores_it_then_a_token_major_tail():
    layout = CpuAttnLayout("vec")
    kv = caches(1)
    paged = paged_copy.PagedKV(layout, kv)
    slots = whole_block_slots([4, 1, 7], N, 0, 5)  # two whole blocks and 5 tokens of a third
    buf = torch.empty(2, L, slots.numel(), H * D)
    block_chunks.gather(paged, slots, buf)
    flat = buf.view(-1)
    whole = flat[: L * 2 * paged.block_numel].view(L, 2, H, N, 2 * D)
    for layer in range(L):
        assert same_bits(whole[layer, 0], kv[layer][4]) and same_bits(whole[layer, 1], kv[layer][1])
    tail = flat[L * 2 * paged.block_numel :].view(2, L, 5, H * D)
    expected = torch.empty(2, L, 5, H * D)
    gather_chunk(layout, kv, slots[2 * N :], expected)
    assert same_bits(tail, expected)


CASES = [
    # (paged blocks of the chunk, tokens in its partial last block, lo, hi); None: the chunk's end
    ([3, 4, 5, 0], 0, 0, None),      # a run of three consecutive blocks, then one more
    ([3, 4, 5, 0], 0, 0, 4 * N - 1),  # a load that ends one token before the chunk does
    ([3, 4, 5, 0], 0, N, 2 * N + 5),  # starts after vLLM's own first block, ends inside the third
    ([6, 2], 9, 0, None),             # a partial last block (a prompt's last chunk)
    ([6, 2], 9, 0, N - 3),            # ... cut inside the whole block
    ([6, 2], 9, 3, N + 5),            # ... from inside the whole block to inside the tail
    ([8], 0, 0, 0),                   # nothing to write
]


@pytest.mark.parametrize(("apart"), [False, True], ids=["one-allocation", "layers-apart"])
@pytest.mark.parametrize(("order", "tail", "lo", "hi"), CASES)
def test_blocks_chunks_copy_what_token_major_chunks_copy(order, tail, lo, hi, apart):
    """Gather from one cache at vLLM-shaped slots, scatter tokens [lo, hi) into another at other
    slots: the second cache's bytes are those the token-major copies give, and nothing else moved."""
    layout = CpuAttnLayout("vec")
    src_kv, dst_kv = caches(2, apart), caches(3, apart)
    slots = whole_block_slots(order, N, 0, tail)
    t = slots.numel()
    hi = t if hi is None else hi
    buf = torch.empty(2, L, t, H * D)
    block_chunks.gather(paged_copy.PagedKV(layout, src_kv), slots, buf)
    tokens = torch.empty(2, L, t, H * D)
    gather_chunk(layout, src_kv, slots, tokens)

    dst_slots = whole_block_slots([9, 1, 2, 7][: len(order)], N, 0, tail)
    # The expected bytes of each storage (one for all layers, or one per layer).
    expected = {kv.untyped_storage().data_ptr(): storage_bytes(kv).clone() for kv in dst_kv}
    if hi > lo:
        scatter_chunk(layout, [same_view(kv, expected[kv.untyped_storage().data_ptr()]) for kv in dst_kv],
                      dst_slots[lo:hi], tokens[:, :, lo:hi])
    block_chunks.scatter(paged_copy.PagedKV(layout, dst_kv), dst_slots, buf, lo, hi)
    for kv in dst_kv:
        assert torch.equal(storage_bytes(kv), expected[kv.untyped_storage().data_ptr()]), \
            "a blocks-chunk copy wrote other bytes than the token-major one"


def test_slots_that_are_not_whole_blocks_still_copy_right():
    """No run of whole blocks (random slots): every token goes through the K/V views."""
    layout = CpuAttnLayout("vec")
    kv = caches(4)
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(BLOCKS * N, generator=gen)[: 2 * N + 3]
    buf = torch.empty(2, L, slots.numel(), H * D)
    paged = paged_copy.PagedKV(layout, kv)
    block_chunks.gather(paged, slots, buf)
    other = caches(6)
    expected = storage_bytes(other[0]).clone()
    tokens = torch.empty_like(buf)
    gather_chunk(layout, kv, slots, tokens)
    scatter_chunk(layout, [same_view(t, expected) for t in other], slots, tokens)
    block_chunks.scatter(paged_copy.PagedKV(layout, other), slots, buf, 0, slots.numel())
    assert torch.equal(storage_bytes(other[0]), expected)
    back = torch.empty_like(buf)
    block_chunks.gather(paged_copy.PagedKV(layout, other), slots, back)
    assert same_bits(back, buf)


def test_bad_arguments_raise():
    paged = paged_copy.PagedKV(CpuAttnLayout("vec"), caches(7))
    slots = whole_block_slots([1, 2], N)
    with pytest.raises(ValueError, match="contiguous"):
        block_chunks.gather(paged, slots, torch.empty(2, L, H * D, 2 * N).transpose(2, 3))
    with pytest.raises(ValueError, match=r"\[2, 3, T, 16\]"):
        block_chunks.gather(paged, slots, torch.empty(2, L, 2 * N, H * D + 1))
    with pytest.raises(ValueError, match="need 32 slots"):
        block_chunks.scatter(paged, slots[:-1], torch.empty(2, L, 2 * N, H * D), 0, 2 * N)


def test_which_layouts_keep_chunks_as_blocks():
    cpu = torch.empty(4, H, 128, 2 * 64)
    assert CpuAttnLayout("vec").chunk_layout(cpu, 256) == "blocks"
    assert CpuAttnLayout("vec16").chunk_layout(cpu, 128) == "blocks"
    assert CpuAttnLayout("vec").chunk_layout(cpu, 200) == "tokens"  # chunks not whole blocks
    assert CpuAttnLayout("amx").chunk_layout(cpu.bfloat16(), 256) == "tokens"  # tiles
    assert GpuPagedLayout().chunk_layout(torch.empty(4, H, 16, 2 * 64), 256) == "tokens"


@pytest.mark.parametrize(("order", "tail", "lo", "hi"), CASES)
def test_a_payload_read_into_its_targets_then_the_rest_scattered_writes_what_scatter_writes(order, tail, lo, hi):
    """read_targets puts the runs of whole blocks straight into paged KV and the rest into the
    buffer; with scatter(runs=False) after it, the cache holds what scatter of the chunk gives."""
    layout = CpuAttnLayout("vec")
    src_kv, dst_kv, want_kv = caches(2), caches(3), caches(3)
    slots = whole_block_slots(order, N, 0, tail)
    t = slots.numel()
    hi = t if hi is None else hi
    chunk = torch.empty(2, L, t, H * D)
    block_chunks.gather(paged_copy.PagedKV(layout, src_kv), slots, chunk)
    payload = bytes(chunk.view(-1).view(torch.uint8).numpy())
    dst_slots = whole_block_slots([9, 1, 2, 7][: len(order)], N, 0, tail)
    block_chunks.scatter(paged_copy.PagedKV(layout, want_kv), dst_slots, chunk, lo, hi)

    paged = paged_copy.PagedKV(layout, dst_kv)
    scratch = torch.full_like(chunk, float("nan"))
    views, rest = block_chunks.read_targets(paged, dst_slots.tolist(), t, _bytes(scratch), lo, hi)
    assert sum(len(v) for v in views) == len(payload)
    direct = sum(len(v) for v in views if v.obj is not None and v.nbytes and _in(v, dst_kv))
    whole = sum(1 for j, b, c in block_chunks._runs(dst_slots.tolist(), lo, min(hi, (t // N) * N), N) for _ in range(c))
    assert direct == whole * L * paged.block_numel * 4  # every whole block of [lo, hi) read in place
    pos = 0
    for v in views:
        v[:] = payload[pos : pos + len(v)]
        pos += len(v)
    if rest:
        block_chunks.scatter(paged, dst_slots, scratch, lo, hi, runs=False)
    assert torch.equal(storage_bytes(dst_kv[0]), storage_bytes(want_kv[0]))
    # Every whole block of [lo, hi) is read in place here; the rest is any other token of it.
    inside = {j for j in range(t // N) if lo <= j * N and (j + 1) * N <= hi}
    assert rest == any(tok // N not in inside for tok in range(lo, hi))


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _in(view: memoryview, kv: list[torch.Tensor]) -> bool:
    """Whether ``view`` lies in the paged tensors' memory."""
    import ctypes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    base = kv[0].untyped_storage().data_ptr()
    return base <= addr < base + kv[0].untyped_storage().nbytes()


def test_read_targets_refuses_paged_kv_it_cannot_read_into():
    """Layers whose blocks are not one contiguous array (every other block of a bigger one)."""
    kv = [torch.cat([t, t]).view(2, *t.shape).transpose(0, 1).reshape(2 * BLOCKS, *t.shape[1:])[::2]
          for t in caches(8, apart=True)]
    assert not kv[0].is_contiguous()
    paged = paged_copy.PagedKV(CpuAttnLayout("vec"), kv)
    slots = whole_block_slots([1, 2], N)
    assert paged.layer_bytes() is None
    assert block_chunks.read_targets(paged, slots.tolist(), 2 * N, _bytes(torch.empty(2, L, 2 * N, H * D)),
                                     0, 2 * N) is None


def test_read_targets_refuses_slots_outside_paged_kv():
    paged = paged_copy.PagedKV(CpuAttnLayout("vec"), caches(9))
    slots = whole_block_slots([BLOCKS - 1, BLOCKS], N)  # the second block is past the end
    with pytest.raises(ValueError, match="paged KV has 10"):
        block_chunks.read_targets(paged, slots.tolist(), 2 * N, _bytes(torch.empty(2, L, 2 * N, H * D)), 0, 2 * N)
