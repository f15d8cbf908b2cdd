"""Paged KV layouts: vectorised gather/scatter agree with per-token references written from vLLM 0.32's code.

Per-layer tensors are built the way vLLM 0.32's model runner builds them
(``vllm.v1.kv_cache_interface.create_kv_cache_views`` over one flat int8
allocation, in each ``KVCacheLayout``), so they carry vLLM's real strides:
NHD or HND, other layers' pages interleaved between blocks, padded pages,
kernel-block splitting. The references loop over tokens in Python:

* GPU backends (FLASH_ATTN, FLASHINFER, TRITON_ATTN): reads use the backends'
  own split, ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``
  (``vllm/v1/attention/backends/flash_attn.py``, ``flashinfer.py``,
  ``triton_attn.py``); writes port the address arithmetic of
  ``reshape_and_cache_kernel_flash`` (``vllm/v1/attention/ops/
  triton_reshape_and_cache_flash.py``) onto the tensor's raw storage.
* CPU_ATTN: from the layout's definition, and checked against vLLM's own
  cache-write kernel.

Importing vLLM's KV cache module costs a few seconds, once.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import platform

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mooncake.kv import cpu_isa
from lmcache_mooncake.kv.layouts import (
    GPU_BACKENDS,
    SUPPORTED_BACKENDS,
    CpuAttnLayout,
    GpuPagedLayout,
    PagedLayout,
    layout_for_backend,
)
from lmcache_mooncake.kv.paged_copy import PagedKV, gather_chunk, scatter_chunk
from lmcache_mooncake.kv.shape import KVShape, infer_kv_shape

KINDS = ("CPU_ATTN", "FLASH_ATTN")  # FLASHINFER and TRITON_ATTN are the same layout object
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# vLLM 0.32's KVCacheLayout members (checked against vLLM below).
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
BLOCK_COMPACT = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")  # the ones vLLM can pad pages in
# The layout vLLM resolves for each backend when nothing else asks: CPU_ATTN
# only supports LBHNC (cpu_attn.py); GPU backends take the default LBNHC (NHD).
DEFAULT_LAYOUT = {"CPU_ATTN": "LBHNC", "FLASH_ATTN": "LBNHC"}


def make_layout(kind: str) -> PagedLayout:
    # Pin the CPU kernel: the auto default would (correctly) refuse bf16 on AMX machines.
    return CpuAttnLayout("vec") if kind == "CPU_ATTN" else layout_for_backend(kind)


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so comparisons are bit-exact (-0.0 != 0.0, NaN == same NaN)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All of ``t``'s storage (every layer of an allocation) as bytes, sharing it."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def same_view(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The view ``t`` is of its storage, applied to ``other``'s storage."""
    return torch.empty(0, dtype=t.dtype).set_(
        other.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


# -- building KV caches the way vLLM 0.32 does -------------------------------------------


@functools.cache
def _vllm_kv_modules():
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    kvl = pytest.importorskip("vllm.v1.kv_cache_layout")
    return kvi, kvl.KVCacheLayout


def vllm_kv_caches(
    layout_name: str,
    *,
    layers: int,
    blocks: int,
    heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    page_pad: int = 0,
    kernel_block_size: int | None = None,
) -> list[torch.Tensor]:
    """One KV cache group of ``layers`` full-attention layers, as vLLM 0.32's model runner allocates it.

    The strides of the group's ``KVCacheTensor`` are those of
    ``get_kv_cache_config_from_groups`` (``vllm/v1/core/kv_cache_utils.py``);
    the buffer and the per-layer views are ``allocate_kv_cache``'s
    (``vllm/v1/worker/utils.py``): one flat int8 tensor viewed per layer with
    vLLM's own ``create_kv_cache_views``. ``page_pad`` pads every page by that
    many elements (``page_size_padded``). The buffer is random, not zeros, so
    stray writes show.
    """
    kvi, kv_cache_layout = _vllm_kv_modules()
    layout = kv_cache_layout[layout_name]
    spec = kvi.FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    if page_pad:
        padded = spec.page_size_bytes + page_pad * dtype.itemsize
        spec = kvi.FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=dtype,
            page_size_padded=padded,
        )
    bytes_per_block = layers * spec.page_size_bytes
    interleaved_block_stride = bytes_per_block if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = kvi.compute_layout_strides(
        spec, blocks, layers, layout, fixed_strides=(None, interleaved_block_stride, None, None, None)
    )
    size = bytes_per_block * blocks
    raw = rand((size // dtype.itemsize,), dtype, gen).view(torch.int8)
    tensor = kvi.KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    return kvi.create_kv_cache_views(raw, spec, blocks, layout, tensor, kernel_block_size=kernel_block_size)


def default_caches(kind: str, **kw) -> list[torch.Tensor]:
    return vllm_kv_caches(DEFAULT_LAYOUT[kind], **kw)


# -- per-token references, from vLLM's code -------------------------------------------------


def ref_read(kind: str, kv: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([H, D] each) of the token at ``slot``."""
    _, heads, n, width = kv.shape
    d = width // 2
    blk, off = divmod(slot, n)
    if kind == "CPU_ATTN":
        ks, vs = [], []
        for h in range(heads):
            flat = kv[blk, h].reshape(-1)  # the (block, head)'s N*2D elements
            ks.append(flat[torch.arange(d) * n + off])  # K is [D, N]: element d at d*N + o
            vs.append(flat[n * d + off * d : n * d + (off + 1) * d])  # V is [N, D] after K
        return torch.stack(ks), torch.stack(vs)
    # flash_attn.py / flashinfer.py / triton_attn.py: (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D))
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
    return key_cache[blk, off].clone(), value_cache[blk, off].clone()


def ref_write(kind: str, kv: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    _, heads, n, width = kv.shape
    d = width // 2
    blk, off = divmod(slot, n)
    if kind == "CPU_ATTN":
        for h in range(heads):
            flat = kv[blk, h].view(-1)
            flat[torch.arange(d) * n + off] = k[h]
            flat[n * d + off * d : n * d + (off + 1) * d] = v[h]
        return
    # reshape_and_cache_kernel_flash (not head-major), element addresses from the
    # split caches' pointers and strides, written into the raw storage:
    #   tgt = block_idx * block_stride + block_offset * page_stride + head * head_stride + dim
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
    block_stride, page_stride, head_stride, _ = key_cache.stride()
    storage = torch.empty(0, dtype=kv.dtype).set_(kv.untyped_storage())
    for h in range(heads):
        tgt = blk * block_stride + off * page_stride + h * head_stride + torch.arange(d)
        storage[key_cache.storage_offset() + tgt] = k[h]
        storage[value_cache.storage_offset() + tgt] = v[h]


def ref_gather(kind: str, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = [ref_read(kind, kv, int(s)) for s in slots]
    k = torch.stack([r[0].reshape(-1) for r in rows])
    v = torch.stack([r[1].reshape(-1) for r in rows])
    return torch.stack([k, v])  # [2, T, H*D]


def ref_scatter(kind: str, kv: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    heads = kv.shape[1]
    for i, s in enumerate(slots.tolist()):
        ref_write(kind, kv, s, src[0, i].view(heads, -1), src[1, i].view(heads, -1))


def test_vllm_layouts_are_the_ones_tested():
    _, kv_cache_layout = _vllm_kv_modules()
    assert sorted(m.name for m in kv_cache_layout) == sorted(VLLM_LAYOUTS)
    assert sorted(m.name for m in kv_cache_layout if m.is_block_compact) == sorted(BLOCK_COMPACT)


def test_gpu_references_agree():
    """The read reference (the backends' split) sees what the write reference (the Triton kernel) wrote."""
    gen = torch.Generator().manual_seed(1)
    for name in VLLM_LAYOUTS:
        kv = vllm_kv_caches(
            name, layers=2, blocks=3, heads=2, block_size=4, head_size=3, dtype=torch.float32, gen=gen
        )[1]
        for slot in (0, 5, 11):
            k, v = rand((2, 3), torch.float32, gen), rand((2, 3), torch.float32, gen)
            ref_write("FLASH_ATTN", kv, slot, k, v)
            got_k, got_v = ref_read("FLASH_ATTN", kv, slot)
            assert same_bits(got_k, k) and same_bits(got_v, v), name


# -- core properties ---------------------------------------------------------------


def check_layer(kind: str, kv: torch.Tensor, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Gather matches the reference, round trip is bit-exact, and nothing but the slots changes.

    ``kv`` is one layer's view; "nothing else" covers its whole allocation
    (other layers, padding).
    """
    layout = make_layout(kind)
    _, heads, _, width = kv.shape
    t, hidden = slots.numel(), heads * (width // 2)
    mem = storage_bytes(kv)
    before = mem.clone()

    out = torch.empty(2, t, hidden, dtype=kv.dtype)
    layout.gather(kv, slots, out)
    assert same_bits(out, ref_gather(kind, kv, slots)), "gather differs from the per-token reference"
    assert torch.equal(mem, before), "gather modified the paged tensor"

    src = rand((2, t, hidden), kv.dtype, gen)
    layout.scatter(kv, slots, src)
    back = torch.empty_like(out)
    layout.gather(kv, slots, back)
    assert same_bits(back, src), "scatter-then-gather did not round-trip"

    expected = before.clone()
    ref_scatter(kind, same_view(kv, expected), slots, src)
    assert torch.equal(mem, expected), "scatter wrote outside its slots or differs from the reference"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 128, 256])
def test_layer_properties(kind, block_size, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + block_size)
    blocks = -(-num_tokens // block_size) + 3  # slots are a strict random subset
    kv = default_caches(
        kind,
        layers=2,
        blocks=blocks,
        heads=2,
        block_size=block_size,
        head_size=8,
        dtype=torch.bfloat16,
        gen=gen,
    )[1]
    slots = torch.randperm(blocks * block_size, generator=gen)[:num_tokens]
    check_layer(kind, kv, slots, gen)


@pytest.mark.parametrize(
    ("name", "page_pad"), [(name, 0) for name in VLLM_LAYOUTS] + [(name, 3) for name in BLOCK_COMPACT]
)
def test_every_vllm_layout(name, page_pad):
    gen = torch.Generator().manual_seed(VLLM_LAYOUTS.index(name) + 10 * page_pad)
    caches = vllm_kv_caches(
        name,
        layers=3,
        blocks=5,
        heads=3,
        block_size=16,
        head_size=8,
        dtype=torch.float16,
        gen=gen,
        page_pad=page_pad,
    )
    for kv in caches:
        slots = torch.randperm(5 * 16, generator=gen)[:37]
        check_layer("FLASH_ATTN", kv, slots, gen)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    name=st.sampled_from(VLLM_LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    layers=st.integers(1, 3),
    blocks=st.integers(1, 5),
    heads=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 3, 16]),
    head_size=st.sampled_from([1, 2, 8, 16]),
    page_pad=st.sampled_from([0, 0, 1, 5]),
    data=st.data(),
)
def test_layer_properties_random(
    kind, name, dtype, layers, blocks, heads, block_size, head_size, page_pad, data
):
    if kind == "CPU_ATTN":
        name = "LBHNC"  # the only layout the CPU backend supports
    if name not in BLOCK_COMPACT:
        page_pad = 0
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    caches = vllm_kv_caches(
        name,
        layers=layers,
        blocks=blocks,
        heads=heads,
        block_size=block_size,
        head_size=head_size,
        dtype=dtype,
        gen=gen,
        page_pad=page_pad,
    )
    kv = caches[data.draw(st.integers(0, layers - 1), label="layer")]
    slots = data.draw(
        st.lists(
            st.integers(0, blocks * block_size - 1), min_size=1, max_size=blocks * block_size, unique=True
        ),
        label="slots",
    )
    check_layer(kind, kv, torch.tensor(slots), gen)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_block_split(kind):
    """vLLM splits scheduler blocks of 64 tokens into kernel blocks of 16; scheduler slots still work."""
    kvi, _ = _vllm_kv_modules()
    gen = torch.Generator().manual_seed(2)
    blocks, m, n, heads, d = 3, 64, 16, 2, 8
    caches = default_caches(
        kind,
        layers=2,
        blocks=blocks,
        heads=heads,
        block_size=m,
        head_size=d,
        dtype=torch.bfloat16,
        gen=gen,
        kernel_block_size=n,
    )
    layout = make_layout(kind)
    assert layout.kv_shape(caches[0], m) == (blocks * m // n, heads, n, d)
    assert infer_kv_shape(layout, caches, m).block_size == n
    # vLLM's slot mapping (block_table.py) uses the scheduler block size: block_id * 64 + pos % 64.
    block_table, positions = torch.tensor([2, 0]), torch.arange(100)
    manager_blocks = block_table[positions // m]
    slots = manager_blocks * m + positions % m
    out = torch.empty(2, 2, 100, heads * d, dtype=torch.bfloat16)
    gather_chunk(layout, caches, slots, out)
    for layer, kv in enumerate(caches):
        # vLLM's own regrouping of kernel blocks under scheduler blocks: [3, 4, H, 16, 2D].
        grouped = kvi.group_kernel_blocks(kv, blocks)
        for i, (blk, pos) in enumerate(zip(manager_blocks.tolist(), positions.tolist(), strict=True)):
            kernel_kv = grouped[blk, (pos % m) // n]  # one kernel block [H, 16, 2D]
            k, v = ref_read(kind, kernel_kv[None], pos % n)
            assert same_bits(out[0, layer, i], k.reshape(-1)) and same_bits(out[1, layer, i], v.reshape(-1))
        check_layer(kind, kv, slots, gen)


# -- whole chunks ----------------------------------------------------------------------


CHUNK_CASES = [
    ("CPU_ATTN", "LBHNC"),
    ("FLASH_ATTN", "LBNHC"),
    ("FLASH_ATTN", "LBHNC"),
    ("FLASH_ATTN", "BLNHC"),
]


@pytest.mark.parametrize(("kind", "name"), CHUNK_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_gather_scatter(kind, name, dtype):
    gen = torch.Generator().manual_seed(7)
    layers, blocks, heads, n, d, t = 3, 6, 2, 16, 8, 40
    layout = make_layout(kind)
    caches = vllm_kv_caches(
        name, layers=layers, blocks=blocks, heads=heads, block_size=n, head_size=d, dtype=dtype, gen=gen
    )
    slots = torch.randperm(blocks * n, generator=gen)[:t]

    out = torch.empty(2, layers, t, heads * d, dtype=dtype)
    gather_chunk(layout, caches, slots, out)
    for i, kv in enumerate(caches):
        assert same_bits(out[:, i], ref_gather(kind, kv, slots))

    # A strided output buffer (e.g. tokens 5.. of a bigger chunk) gets the same bytes.
    big = torch.zeros(2, layers, t + 5, heads * d, dtype=dtype)
    gather_chunk(layout, caches, slots, big[:, :, 5:])
    assert same_bits(big[:, :, 5:], out) and not bits(big[:, :, :5]).any()

    # A buffer whose token rows aren't contiguous takes the temporary-copy path.
    wide = torch.zeros(2, layers, t, heads * d + 3, dtype=dtype)
    gather_chunk(layout, caches, slots, wide[..., : heads * d])
    assert same_bits(wide[..., : heads * d], out) and not bits(wide[..., heads * d :]).any()

    # Scatter a token range sliced out of a chunk, as the engine does on retrieve.
    mem = storage_bytes(caches[0])  # all layers share one allocation, as in vLLM
    expected = mem.clone()
    src_full = rand((2, layers, t + 9, heads * d), dtype, gen)
    src = src_full[:, :, 4 : 4 + t]
    scatter_chunk(layout, caches, slots, src)
    for i, kv in enumerate(caches):
        ref_scatter(kind, same_view(kv, expected), slots, src[:, i].contiguous())
    assert torch.equal(mem, expected)
    gather_chunk(layout, caches, slots, out)
    assert same_bits(out, src)


def whole_block_slots(blocks: list[int], n: int, head: int = 0, tail: int = 0) -> torch.Tensor:
    """Slots of a vLLM-shaped chunk: the last ``head`` offsets of blocks[0] (if ``head``),
    whole blocks, then the first ``tail`` offsets of the last block."""
    parts = []
    rest = list(blocks)
    if head:
        b = rest.pop(0)
        parts.append(torch.arange(b * n + n - head, (b + 1) * n))
    last = rest.pop() if tail else None
    parts += [torch.arange(b * n, (b + 1) * n) for b in rest]
    if last is not None:
        parts.append(torch.arange(last * n, last * n + tail))
    return torch.cat(parts)


@pytest.mark.parametrize(("kind", "name"), CHUNK_CASES)
@pytest.mark.parametrize(("order", "head", "tail"), [
    ([3, 4, 5, 0], 0, 0),  # a run of three consecutive blocks, then one more
    ([5, 2, 3, 1], 0, 7),  # a partial last block (a prompt's tail)
    ([1, 4, 2, 6], 5, 9),  # partial at both ends
    ([2], 0, 0),           # exactly one block
])
def test_chunk_of_whole_blocks_matches_reference(kind, name, order, head, tail):
    """Whole blocks move in per-block strided copies; bytes match the per-token references."""
    gen = torch.Generator().manual_seed(13)
    layers, blocks, heads, n, d = 2, 8, 2, 16, 8
    layout = make_layout(kind)
    caches = vllm_kv_caches(
        name, layers=layers, blocks=blocks, heads=heads, block_size=n, head_size=d, dtype=torch.float32, gen=gen
    )
    slots = whole_block_slots(order, n, head, tail)
    t = slots.numel()
    out = torch.empty(2, layers, t, heads * d)
    gather_chunk(layout, caches, slots, out)
    for i, kv in enumerate(caches):
        assert same_bits(out[:, i], ref_gather(kind, kv, slots))

    mem = storage_bytes(caches[0])
    expected = mem.clone()
    src = rand((2, layers, t, heads * d), torch.float32, gen)
    scatter_chunk(layout, caches, slots, src)
    for i, kv in enumerate(caches):
        ref_scatter(kind, same_view(kv, expected), slots, src[:, i].contiguous())
    assert torch.equal(mem, expected), "a whole-block copy touched bytes outside its tokens"


@pytest.mark.parametrize(("kind", "name"), [("CPU_ATTN", "LBHNC")] + [("FLASH_ATTN", n) for n in VLLM_LAYOUTS])
def test_layers_of_one_allocation_move_in_one_copy(kind, name):
    """vLLM's layers are views of one allocation at one layer stride: whole blocks of all
    layers then move with one copy per run (that path is taken), with the same bytes as
    layers allocated apart, which are copied one layer at a time."""
    gen = torch.Generator().manual_seed(17)
    layers, blocks, heads, n, d = 3, 6, 2, 16, 8
    layout = make_layout(kind)
    caches = vllm_kv_caches(
        name, layers=layers, blocks=blocks, heads=heads, block_size=n, head_size=d, dtype=torch.float32, gen=gen
    )
    apart = [kv.clone() for kv in caches]
    assert PagedKV(layout, caches)._all_layers is not None
    assert PagedKV(layout, apart)._all_layers is None
    slots = whole_block_slots([4, 1, 2, 5], n, 3, 5)
    src = rand((2, layers, slots.numel(), heads * d), torch.float32, gen)
    scatter_chunk(layout, caches, slots, src)
    scatter_chunk(layout, apart, slots, src)
    for one, other in zip(caches, apart, strict=True):
        assert same_bits(one, other)
    out = torch.empty_like(src)
    gather_chunk(layout, caches, slots, out)
    assert same_bits(out, src)


@pytest.mark.parametrize("kind", KINDS)
def test_no_tokens_is_a_no_op(kind):
    gen = torch.Generator().manual_seed(4)
    caches = default_caches(
        kind, layers=2, blocks=2, heads=2, block_size=16, head_size=8, dtype=torch.float32, gen=gen
    )
    mem = storage_bytes(caches[0])
    before = mem.clone()
    empty = torch.zeros(0, dtype=torch.long)
    layout = make_layout(kind)
    gather_chunk(layout, caches, empty, torch.empty(2, 2, 0, 16))
    scatter_chunk(layout, caches, empty, torch.empty(2, 2, 0, 16))
    assert torch.equal(mem, before)


def test_chunk_layers_with_different_strides():
    """Layers need not share strides (each gets its own offsets)."""
    gen = torch.Generator().manual_seed(3)
    geometry = dict(layers=1, blocks=4, heads=2, block_size=16, head_size=8, dtype=torch.float16, gen=gen)
    caches = [vllm_kv_caches(name, **geometry)[0] for name in ("LBNHC", "LHBNC", "BHLNC")]
    assert len({kv.stride() for kv in caches}) == 3
    slots = torch.randperm(64, generator=gen)[:20]
    out = torch.empty(2, 3, 20, 16, dtype=torch.float16)
    gather_chunk(GpuPagedLayout(), caches, slots, out)
    for i, kv in enumerate(caches):
        assert same_bits(out[:, i], ref_gather("FLASH_ATTN", kv, slots))


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_logical_kv_in_every_layout_gathers_identically(dtype):
    """The same K/V written (by the references) into CPU_ATTN and every GPU physical order gathers the same."""
    gen = torch.Generator().manual_seed(11)
    layers, blocks, heads, n, d = 2, 5, 3, 16, 8
    all_slots = torch.arange(blocks * n)
    logical = [rand((2, blocks * n, heads * d), dtype, gen) for _ in range(layers)]
    slots = torch.randperm(blocks * n, generator=gen)[:37]
    expected = torch.stack([kv_logical[:, slots] for kv_logical in logical], dim=1)
    gpu_logical = []
    for kind, name in [("CPU_ATTN", "LBHNC")] + [("FLASH_ATTN", name) for name in VLLM_LAYOUTS]:
        caches = vllm_kv_caches(
            name, layers=layers, blocks=blocks, heads=heads, block_size=n, head_size=d, dtype=dtype, gen=gen
        )
        for kv, kv_logical in zip(caches, logical, strict=True):
            ref_scatter(kind, kv, all_slots, kv_logical)
        chunk = torch.empty(2, layers, 37, heads * d, dtype=dtype)
        gather_chunk(make_layout(kind), caches, slots, chunk)
        assert same_bits(chunk, expected), (kind, name)
        if kind != "CPU_ATTN":
            gpu_logical.append(torch.stack([kv.contiguous() for kv in caches]))
    # The GPU backends' logical [B, H, N, 2D] content doesn't depend on the physical order.
    assert all(same_bits(t, gpu_logical[0]) for t in gpu_logical[1:])


# -- the CPU layout against vLLM's definition and kernel ---------------------------------


def test_cpu_layout_matches_backend_view():
    """vLLM's CPU backend: ``kv.view(B, H, 2N, D).chunk(2, dim=2)`` -> (key_cache, value_cache).

    V of (block b, offset o) is ``value_cache[b, :, o, :]``; K is stored
    column-major in ``key_cache[b, h]`` (its N*D elements are [D, N]), so K is
    ``key_cache.reshape(B, H, D, N)[b, :, :, o]``, not ``key_cache[b, :, o, :]``.
    """
    gen = torch.Generator().manual_seed(5)
    b_, h_, n, d = 4, 2, 32, 64
    kv = default_caches(
        "CPU_ATTN", layers=2, blocks=b_, heads=h_, block_size=n, head_size=d, dtype=torch.bfloat16, gen=gen
    )[1]
    key_cache, value_cache = kv.view(b_, h_, 2 * n, d).chunk(2, dim=2)
    slots = torch.randperm(b_ * n, generator=gen)[:50]
    out = torch.empty(2, 50, h_ * d, dtype=torch.bfloat16)
    CpuAttnLayout("vec").gather(kv, slots, out)
    k_dn = key_cache.reshape(b_, h_, d, n)
    for i, s in enumerate(slots.tolist()):
        blk, off = divmod(s, n)
        assert same_bits(out[1, i], value_cache[blk, :, off, :].reshape(-1))
        assert same_bits(out[0, i], k_dn[blk, :, :, off].reshape(-1))


def _load_vllm_cpu_ops() -> bool:
    """Load vLLM's CPU kernel library directly (importing all of vllm takes ~10 s)."""
    if hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        return True
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return False
    root = os.path.dirname(spec.origin)
    # Same choice as vllm.platforms.cpu.CpuPlatform.import_kernels.
    name = "_C"
    if platform.machine().lower() in ("x86_64", "amd64"):
        if not torch.cpu._is_avx512_supported():
            name = "_C_AVX2"
        elif not torch.cpu._is_avx512_bf16_supported():
            name = "_C_AVX512"
    libs = glob.glob(os.path.join(root, f"{name}.*so"))
    if not libs:
        return False
    try:
        torch.ops.load_library(libs[0])
    except (OSError, RuntimeError):
        return False
    return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("isa", "block_size"), [("vec", 32), ("vec", 128), ("vec16", 16), ("vec16", 128),
                                                 ("amx", 32), ("amx", 128)])
def test_cpu_layout_matches_vllm_kernel(dtype, isa, block_size):
    if not _load_vllm_cpu_ops():
        pytest.skip("vLLM's CPU kernels are not installed")
    if isa == "amx" and (dtype != torch.bfloat16 or not torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's AMX kernel: bfloat16 on a CPU with AMX tiles only")
    gen = torch.Generator().manual_seed(block_size)
    blocks, heads, d, t = 4, 2, 64, 3 * block_size // 2 + 1
    slots = torch.randperm(blocks * block_size, generator=gen)[:t]
    key, value = rand((t, heads, d), dtype, gen), rand((t, heads, d), dtype, gen)
    kv = default_caches(
        "CPU_ATTN",
        layers=1,
        blocks=blocks,
        heads=heads,
        block_size=block_size,
        head_size=d,
        dtype=dtype,
        gen=gen,
    )[0]
    ours = kv.clone()
    # cpu_attn.py: kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
    key_cache, value_cache = kv.view(blocks, heads, 2 * block_size, d).chunk(2, dim=2)
    torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")

    layout = CpuAttnLayout(isa)
    out = torch.empty(2, t, heads * d, dtype=dtype)
    layout.gather(kv, slots, out)
    assert same_bits(out[0], key.reshape(t, -1)), "K differs from what vLLM's kernel wrote"
    assert same_bits(out[1], value.reshape(t, -1)), "V differs from what vLLM's kernel wrote"

    layout.scatter(ours, slots, out)
    assert same_bits(ours, kv), "scatter does not write the bytes vLLM's kernel writes"


def test_amx_whole_blocks_and_a_partial_one_for_all_layers_match_vllm_kernel():
    """PagedKV's fast paths on AMX tiles: runs of whole blocks for all layers at once (one
    allocation, as vLLM allocates it) and a partial last block token by token."""
    if not _load_vllm_cpu_ops():
        pytest.skip("vLLM's CPU kernels are not installed")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's AMX kernel needs a CPU with AMX tiles")
    gen = torch.Generator().manual_seed(7)
    layers, blocks, heads, n, d = 3, 5, 2, 32, 64
    flat = torch.zeros(layers, blocks, heads, n, 2 * d, dtype=torch.bfloat16)
    caches = list(flat.unbind(0))
    slots = torch.cat([torch.arange(1 * n, 3 * n), torch.arange(4 * n, 4 * n + 9)])  # blocks 1-2, 9 of block 4
    t = slots.numel()
    chunk = rand((2, layers, t, heads * d), torch.bfloat16, gen)
    for layer, kv in enumerate(caches):
        key_cache, value_cache = kv.view(blocks, heads, 2 * n, d).chunk(2, dim=2)
        torch.ops._C.cpu_attn_reshape_and_cache(chunk[0, layer].reshape(t, heads, d).contiguous(),
                                                chunk[1, layer].reshape(t, heads, d).contiguous(),
                                                key_cache, value_cache, slots, "amx", 1.0, 1.0, "auto")
    paged = PagedKV(CpuAttnLayout("amx"), caches)
    assert paged._all_layers is not None and paged._tiled
    out = torch.empty_like(chunk)
    paged.gather(slots, out)
    assert same_bits(out, chunk), "gather differs from what vLLM's AMX kernel wrote"
    ours = torch.zeros_like(flat)
    PagedKV(CpuAttnLayout("amx"), list(ours.unbind(0))).scatter(slots, chunk)
    assert same_bits(ours, flat), "scatter does not write the bytes vLLM's AMX kernel writes"


def test_cpu_isa_resolution(monkeypatch):
    kv = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'neon' attention kernel is not supported"):
        CpuAttnLayout("neon")
    monkeypatch.setattr(cpu_isa, "vllm_cpu_isa", lambda *args: "neon")
    with pytest.raises(ValueError, match="'neon' attention kernel is not supported"):
        CpuAttnLayout().kv_shape(kv)
    monkeypatch.setattr(cpu_isa, "vllm_cpu_isa", lambda *args: "amx")
    assert CpuAttnLayout().kv_shape(kv) == (2, 1, 32, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        CpuAttnLayout("amx").kv_shape(torch.zeros(2, 1, 32, 48, dtype=torch.bfloat16))
    assert CpuAttnLayout("vec").kv_shape(kv) == (2, 1, 32, 64)  # pinned: no resolution
    monkeypatch.setattr(cpu_isa, "vllm_cpu_isa", lambda *args: "vec16")
    assert layout_for_backend("CPU_ATTN").kv_shape(kv) == (2, 1, 32, 64)


# -- shapes, names and errors ----------------------------------------------------------


def test_kv_shape_and_infer():
    assert CpuAttnLayout("vec").kv_shape(torch.zeros(5, 2, 16, 128), 16) == (5, 2, 16, 64)
    assert GpuPagedLayout().kv_shape(torch.zeros(5, 2, 16, 128), 16) == (5, 2, 16, 64)
    nhd = torch.zeros(5, 16, 2, 128).transpose(1, 2)  # NHD memory, [B, H, N, 2D] view
    assert GpuPagedLayout("FLASHINFER").kv_shape(nhd) == (5, 2, 16, 64)
    caches = [torch.zeros(5, 2, 16, 128, dtype=torch.float16)] * 3
    shape = infer_kv_shape(layout_for_backend("TRITON_ATTN"), caches)
    assert shape == KVShape(num_layers=3, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float16)
    assert shape.chunk_shape(256) == (2, 3, 256, 128)


@pytest.mark.parametrize(
    ("layout", "tensor", "match"),
    [
        (CpuAttnLayout("vec"), torch.zeros(2, 5, 16, 2, 64), "4-D"),
        (CpuAttnLayout("vec"), torch.zeros(5, 2, 16, 63), "even"),
        (CpuAttnLayout("vec"), torch.zeros(5, 2, 128, 16).transpose(2, 3), "contiguous"),
        (CpuAttnLayout("vec"), torch.zeros(5, 2, 16, 64, dtype=torch.int8), "dtype"),
        (GpuPagedLayout(), torch.zeros(2, 5, 16, 2, 64), "4-D"),  # the pre-0.32 5-D layout
        (GpuPagedLayout(), torch.zeros(5, 2, 16, 63), "even"),
        (GpuPagedLayout(), torch.zeros(5, 2, 16, 128, dtype=torch.uint8), "dtype"),  # FP8 / NVFP4 caches
        (GpuPagedLayout(), torch.zeros(0, 2, 16, 128), "empty"),
    ],
)
def test_bad_tensor_raises(layout, tensor, match):
    with pytest.raises(ValueError, match=match):
        layout.kv_shape(tensor)
    with pytest.raises(ValueError):
        layout.gather(tensor, torch.zeros(1, dtype=torch.long), torch.zeros(2, 1, 128))


def test_block_size_must_be_a_multiple_of_the_tensors():
    kv = torch.zeros(5, 2, 16, 128)
    assert GpuPagedLayout().kv_shape(kv, 64) == (5, 2, 16, 64)  # kernel blocks of 16 in blocks of 64
    for block_size in (8, 24, 0):
        with pytest.raises(ValueError, match=f"block_size={block_size}"):
            GpuPagedLayout().kv_shape(kv, block_size)
        with pytest.raises(ValueError, match=f"block_size={block_size}"):
            CpuAttnLayout("vec").kv_shape(kv, block_size)


def test_bad_arguments_raise():
    layout, kv = GpuPagedLayout(), torch.zeros(4, 2, 16, 16)
    ok_slots, out = torch.tensor([0, 5, 63]), torch.zeros(2, 3, 16)
    layout.gather(kv, ok_slots, out)
    for slots, match in [
        (torch.tensor([0, 5, 64]), r"\[0, 64\)"),
        (torch.tensor([-1, 5, 6]), r"\[0, 64\)"),
        (torch.tensor([[0, 5, 6]]), "1-D"),
        (torch.tensor([0.0, 5.0, 6.0]), "integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            layout.gather(kv, slots, out)
        with pytest.raises(ValueError, match=match):
            layout.scatter(kv, slots, out)
    with pytest.raises(ValueError, match="shape"):
        layout.gather(kv, ok_slots, torch.zeros(2, 4, 16))
    with pytest.raises(ValueError, match="dtype"):
        layout.scatter(kv, ok_slots, torch.zeros(2, 3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="shape"):
        gather_chunk(layout, [kv, kv], ok_slots, torch.zeros(2, 1, 3, 16))
    with pytest.raises(ValueError, match="layer 1"):
        gather_chunk(layout, [kv, torch.zeros(4, 1, 16, 32)], ok_slots, torch.zeros(2, 2, 3, 16))
    with pytest.raises(ValueError, match="empty"):
        scatter_chunk(layout, [], ok_slots, torch.zeros(2, 0, 3, 16))


def test_layout_for_backend_names():
    assert SUPPORTED_BACKENDS == ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
    assert isinstance(layout_for_backend("CPU_ATTN"), CpuAttnLayout)
    assert layout_for_backend("CPU_ATTN", cpu_isa="vec16").isa == "vec16"
    for name in GPU_BACKENDS:
        layout = layout_for_backend(name.lower())
        assert isinstance(layout, GpuPagedLayout) and layout.name == name
        assert repr(layout) == f"GpuPagedLayout({name!r})"
    for layout in (CpuAttnLayout(), GpuPagedLayout("TRITON_ATTN")):
        assert layout_for_backend(layout.name).name == layout.name
    with pytest.raises(ValueError, match="not 'CPU_ATTN'"):
        GpuPagedLayout("CPU_ATTN")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("TORCH_SDPA", "old CPU backend"),
        ("FLEX_ATTENTION", ""),
        ("FLASHMLA", "latent"),
        ("FLASH_ATTN_DIFFKV", "different head sizes"),
        ("", ""),
    ],
)
def test_unknown_backend_raises_helpfully(name, why):
    with pytest.raises(ValueError) as err:
        layout_for_backend(name)
    msg = str(err.value)
    assert repr(name) in msg and "not supported" in msg and why in msg
    for needed in (*SUPPORTED_BACKENDS, "--attention-backend"):
        assert needed in msg
