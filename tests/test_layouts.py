"""Paged KV layouts: vectorised gather/scatter agree with per-token references written from each definition.

The references below loop over tokens in Python and read the layouts straight
from their definitions (see lmcache_mooncake/layouts.py). The CPU layout is
also checked against vLLM's own cache-write kernel when vLLM is installed.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mooncake import layouts
from lmcache_mooncake.layouts import (
    CpuAttnLayout,
    FlashAttnLayout,
    FlashInferLayout,
    KVShape,
    PagedLayout,
    gather_chunk,
    infer_kv_shape,
    layout_for_backend,
    scatter_chunk,
)

KINDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_layout(kind: str) -> PagedLayout:
    # Pin the CPU kernel: the auto default would (correctly) refuse bf16 on AMX machines.
    return CpuAttnLayout("vec") if kind == "CPU_ATTN" else layout_for_backend(kind)


def paged_shape(kind: str, blocks: int, heads: int, block_size: int, head_size: int) -> tuple[int, ...]:
    if kind == "CPU_ATTN":
        return (blocks, heads, block_size, 2 * head_size)
    if kind == "FLASH_ATTN":
        return (2, blocks, block_size, heads, head_size)
    return (blocks, 2, block_size, heads, head_size)


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so comparisons are bit-exact (-0.0 != 0.0, NaN == same NaN)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- per-token references, from the layout definitions -----------------------------


def ref_read(kind: str, kv: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([H, D] each) of the token at ``slot``."""
    if kind == "CPU_ATTN":
        _, heads, n, width = kv.shape
        d = width // 2
        blk, off = divmod(slot, n)
        ks, vs = [], []
        for h in range(heads):
            flat = kv[blk, h].reshape(-1)  # the (block, head)'s N*2D elements
            ks.append(flat[torch.arange(d) * n + off])  # K is [D, N]: element d at d*N + o
            vs.append(flat[n * d + off * d : n * d + (off + 1) * d])  # V is [N, D] after K
        return torch.stack(ks), torch.stack(vs)
    n = kv.shape[2]
    blk, off = divmod(slot, n)
    if kind == "FLASH_ATTN":
        return kv[0, blk, off].clone(), kv[1, blk, off].clone()
    return kv[blk, 0, off].clone(), kv[blk, 1, off].clone()


def ref_write(kind: str, kv: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if kind == "CPU_ATTN":
        _, heads, n, width = kv.shape
        d = width // 2
        blk, off = divmod(slot, n)
        for h in range(heads):
            flat = kv[blk, h].view(-1)
            flat[torch.arange(d) * n + off] = k[h]
            flat[n * d + off * d : n * d + (off + 1) * d] = v[h]
        return
    n = kv.shape[2]
    blk, off = divmod(slot, n)
    if kind == "FLASH_ATTN":
        kv[0, blk, off], kv[1, blk, off] = k, v
    else:
        kv[blk, 0, off], kv[blk, 1, off] = k, v


def ref_gather(kind: str, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = [ref_read(kind, kv, int(s)) for s in slots]
    k = torch.stack([r[0].reshape(-1) for r in rows])
    v = torch.stack([r[1].reshape(-1) for r in rows])
    return torch.stack([k, v])  # [2, T, H*D]


def ref_scatter(kind: str, kv: torch.Tensor, slots: torch.Tensor, src: torch.Tensor, heads: int) -> None:
    for i, s in enumerate(slots.tolist()):
        ref_write(kind, kv, s, src[0, i].view(heads, -1), src[1, i].view(heads, -1))


# -- core properties ---------------------------------------------------------------


def check_layer(kind: str, kv: torch.Tensor, slots: torch.Tensor, heads: int, head_size: int, gen) -> None:
    """All four properties for one layer tensor (which may be a view of a bigger one)."""
    layout = make_layout(kind)
    t = slots.numel()
    base = kv if kv._base is None else kv._base  # check the whole allocation stays intact
    before = base.clone()

    out = torch.empty(2, t, heads * head_size, dtype=kv.dtype)
    layout.gather(kv, slots, out)
    assert same_bits(out, ref_gather(kind, kv, slots)), "gather differs from the per-token reference"
    assert same_bits(base, before), "gather modified the paged tensor"

    src = rand((2, t, heads * head_size), kv.dtype, gen)
    layout.scatter(kv, slots, src)
    back = torch.empty_like(out)
    layout.gather(kv, slots, back)
    assert same_bits(back, src), "scatter-then-gather did not round-trip"

    expected = before.clone()
    exp_kv = expected.as_strided(kv.shape, kv.stride(), kv.storage_offset() - base.storage_offset())
    ref_scatter(kind, exp_kv, slots, src, heads)
    assert same_bits(base, expected), "scatter wrote outside its slots or differs from the reference"

    fresh = torch.zeros_like(kv)
    layout.scatter(fresh, slots, src)
    ref_fresh = torch.zeros_like(kv)
    ref_scatter(kind, ref_fresh, slots, src, heads)
    assert same_bits(fresh, ref_fresh), "scatter into zeros differs from the per-token reference"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 128, 256])
def test_layer_properties(kind, block_size, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + block_size)
    heads, head_size = 2, 8
    blocks = -(-num_tokens // block_size) + 3  # slots are a strict random subset
    kv = rand(paged_shape(kind, blocks, heads, block_size, head_size), torch.bfloat16, gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:num_tokens]
    check_layer(kind, kv, slots, heads, head_size, gen)


def strided_layer(kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen) -> torch.Tensor:
    """A non-contiguous layer view, like one layer of vLLM's cross-layer or padded-page allocations."""
    if kind == "CPU_ATTN":
        b, h, n, w = shape
        # Blocks of 3 layers interleaved (block stride spans all layers), plus a padding head.
        return rand((b, 3, h + 1, n, w), dtype, gen)[:, 1, :h]
    # K/V, block and token strides all padded; rows of H*D are no longer contiguous.
    padded = tuple(s + 1 for s in shape[:-1]) + (shape[-1] + 3,)
    return rand(padded, dtype, gen)[tuple(slice(1, 1 + s) for s in shape)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(DTYPES),
    blocks=st.integers(1, 5),
    heads=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 3, 16]),
    head_size=st.sampled_from([1, 2, 8, 16]),
    strided=st.booleans(),
    frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_layer_properties_random(kind, dtype, blocks, heads, block_size, head_size, strided, frac, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = paged_shape(kind, blocks, heads, block_size, head_size)
    kv = strided_layer(kind, shape, dtype, gen) if strided else rand(shape, dtype, gen)
    num_tokens = max(1, round(frac * blocks * block_size))
    slots = torch.randperm(blocks * block_size, generator=gen)[:num_tokens]
    check_layer(kind, kv, slots, heads, head_size, gen)


# -- whole chunks ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_gather_scatter(kind, dtype):
    gen = torch.Generator().manual_seed(7)
    layers, blocks, heads, n, d, t = 3, 6, 2, 16, 8, 40
    layout = make_layout(kind)
    caches = [rand(paged_shape(kind, blocks, heads, n, d), dtype, gen) for _ in range(layers)]
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
    before = [kv.clone() for kv in caches]
    src_full = rand((2, layers, t + 9, heads * d), dtype, gen)
    src = src_full[:, :, 4 : 4 + t]
    scatter_chunk(layout, caches, slots, src)
    for i, kv in enumerate(caches):
        expected = before[i]
        ref_scatter(kind, expected, slots, src[:, i].contiguous(), heads)
        assert same_bits(kv, expected)
    gather_chunk(layout, caches, slots, out)
    assert same_bits(out, src)


@pytest.mark.parametrize("kind", KINDS)
def test_no_tokens_is_a_no_op(kind):
    layout, kv = make_layout(kind), torch.randn(paged_shape(kind, 2, 2, 16, 8))
    before = kv.clone()
    empty = torch.zeros(0, dtype=torch.long)
    gather_chunk(layout, [kv], empty, torch.empty(2, 1, 0, 16))
    scatter_chunk(layout, [kv], empty, torch.empty(2, 1, 0, 16))
    assert same_bits(kv, before)


def test_chunk_layers_with_different_strides():
    """Layers need not share strides (each gets its own offsets)."""
    gen = torch.Generator().manual_seed(3)
    shape = paged_shape("FLASH_ATTN", 4, 2, 16, 8)
    caches = [rand(shape, torch.float16, gen), strided_layer("FLASH_ATTN", shape, torch.float16, gen)]
    slots = torch.randperm(64, generator=gen)[:20]
    out = torch.empty(2, 2, 20, 16, dtype=torch.float16)
    gather_chunk(FlashAttnLayout(), caches, slots, out)
    for i, kv in enumerate(caches):
        assert same_bits(out[:, i], ref_gather("FLASH_ATTN", kv, slots))


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_logical_kv_in_every_layout_gathers_identically(dtype):
    gen = torch.Generator().manual_seed(11)
    layers, blocks, heads, n, d = 2, 5, 3, 16, 8
    all_slots = torch.arange(blocks * n)
    logical = [rand((2, blocks * n, heads * d), dtype, gen) for _ in range(layers)]
    slots = torch.randperm(blocks * n, generator=gen)[:37]
    chunks = {}
    for kind in KINDS:
        caches = [torch.zeros(paged_shape(kind, blocks, heads, n, d), dtype=dtype) for _ in range(layers)]
        for kv, kv_logical in zip(caches, logical, strict=True):
            ref_scatter(kind, kv, all_slots, kv_logical, heads)
        chunks[kind] = torch.empty(2, layers, 37, heads * d, dtype=dtype)
        gather_chunk(make_layout(kind), caches, slots, chunks[kind])
    expected = torch.stack([kv_logical[:, slots] for kv_logical in logical], dim=1)
    for kind in KINDS:
        assert same_bits(chunks[kind], expected), kind


# -- the CPU layout against vLLM's definition and kernel ---------------------------------


def test_cpu_layout_matches_backend_view():
    """vLLM's CPU backend: ``kv.view(B, H, 2N, D).chunk(2, dim=2)`` -> (key_cache, value_cache).

    V of (block b, offset o) is ``value_cache[b, :, o, :]``; K is stored
    column-major in ``key_cache[b, h]`` (its N*D elements are [D, N]), so K is
    ``key_cache.reshape(B, H, D, N)[b, :, :, o]``, not ``key_cache[b, :, o, :]``.
    """
    gen = torch.Generator().manual_seed(5)
    b_, h_, n, d = 4, 2, 32, 64
    kv = rand((b_, h_, n, 2 * d), torch.bfloat16, gen)
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
    """Load vLLM's CPU kernel library directly (importing vllm takes ~10 s)."""
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
@pytest.mark.parametrize(("isa", "block_size"), [("vec", 32), ("vec", 128), ("vec16", 16), ("vec16", 128)])
def test_cpu_layout_matches_vllm_kernel(dtype, isa, block_size):
    if not _load_vllm_cpu_ops():
        pytest.skip("vLLM's CPU kernels are not installed")
    gen = torch.Generator().manual_seed(block_size)
    blocks, heads, d, t = 4, 2, 64, 3 * block_size // 2 + 1
    slots = torch.randperm(blocks * block_size, generator=gen)[:t]
    key, value = rand((t, heads, d), dtype, gen), rand((t, heads, d), dtype, gen)
    kv = torch.zeros(blocks, heads, block_size, 2 * d, dtype=dtype)
    key_cache, value_cache = kv.view(blocks, heads, 2 * block_size, d).chunk(2, dim=2)
    torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")

    layout = CpuAttnLayout(isa)
    out = torch.empty(2, t, heads * d, dtype=dtype)
    layout.gather(kv, slots, out)
    assert same_bits(out[0], key.reshape(t, -1)), "K differs from what vLLM's kernel wrote"
    assert same_bits(out[1], value.reshape(t, -1)), "V differs from what vLLM's kernel wrote"

    ours = torch.zeros_like(kv)
    layout.scatter(ours, slots, out)
    assert same_bits(ours, kv), "scatter does not write the bytes vLLM's kernel writes"


def test_cpu_isa_resolution(monkeypatch):
    kv = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="amx"):
        CpuAttnLayout("amx")
    monkeypatch.setattr(layouts, "_vllm_cpu_isa", lambda *args: "amx")
    with pytest.raises(ValueError, match="'amx' attention kernel is not supported"):
        CpuAttnLayout().kv_shape(kv)
    assert CpuAttnLayout("vec").kv_shape(kv) == (2, 1, 32, 64)  # pinned: no resolution
    monkeypatch.setattr(layouts, "_vllm_cpu_isa", lambda *args: "vec16")
    assert layout_for_backend("CPU_ATTN").kv_shape(kv) == (2, 1, 32, 64)


# -- shapes, names and errors ----------------------------------------------------------


def test_kv_shape_and_infer():
    assert CpuAttnLayout("vec").kv_shape(torch.zeros(5, 2, 16, 128), 16) == (5, 2, 16, 64)
    assert FlashAttnLayout().kv_shape(torch.zeros(2, 5, 16, 2, 64)) == (5, 2, 16, 64)
    assert FlashInferLayout().kv_shape(torch.zeros(5, 2, 16, 2, 64)) == (5, 2, 16, 64)
    caches = [torch.zeros(2, 5, 16, 2, 64, dtype=torch.float16)] * 3
    shape = infer_kv_shape(FlashAttnLayout(), caches)
    assert shape == KVShape(num_layers=3, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float16)
    assert shape.chunk_shape(256) == (2, 3, 256, 128)


@pytest.mark.parametrize(
    ("layout", "tensor", "match"),
    [
        (CpuAttnLayout("vec"), torch.zeros(2, 5, 16, 2, 64), "4-D"),
        (CpuAttnLayout("vec"), torch.zeros(5, 2, 16, 63), "even"),
        (CpuAttnLayout("vec"), torch.zeros(5, 2, 128, 16).transpose(2, 3), "contiguous"),
        (CpuAttnLayout("vec"), torch.zeros(5, 2, 16, 64, dtype=torch.int8), "dtype"),
        (FlashAttnLayout(), torch.zeros(5, 2, 16, 128), "5-D"),
        (FlashAttnLayout(), torch.zeros(5, 2, 16, 2, 64), "size 2"),
        (FlashInferLayout(), torch.zeros(2, 5, 16, 2, 64), "size 2"),
        (FlashInferLayout(), torch.zeros(0, 2, 16, 2, 64), "empty"),
    ],
)
def test_bad_tensor_raises(layout, tensor, match):
    with pytest.raises(ValueError, match=match):
        layout.kv_shape(tensor)
    with pytest.raises(ValueError):
        layout.gather(tensor, torch.zeros(1, dtype=torch.long), torch.zeros(2, 1, 128))


def test_block_size_mismatch_raises():
    with pytest.raises(ValueError, match="block_size=32"):
        FlashAttnLayout().kv_shape(torch.zeros(2, 5, 16, 2, 64), 32)


def test_bad_arguments_raise():
    layout, kv = FlashAttnLayout(), torch.zeros(2, 4, 16, 2, 8)
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
        gather_chunk(layout, [kv, torch.zeros(2, 4, 16, 1, 16)], ok_slots, torch.zeros(2, 2, 3, 16))
    with pytest.raises(ValueError, match="empty"):
        scatter_chunk(layout, [], ok_slots, torch.zeros(2, 0, 3, 16))


def test_layout_for_backend_names():
    assert isinstance(layout_for_backend("CPU_ATTN"), CpuAttnLayout)
    assert layout_for_backend("CPU_ATTN", cpu_isa="vec16").isa == "vec16"
    assert isinstance(layout_for_backend("FLASH_ATTN"), FlashAttnLayout)
    assert isinstance(layout_for_backend("flashinfer"), FlashInferLayout)
    for layout in (CpuAttnLayout(), FlashAttnLayout(), FlashInferLayout()):
        assert layout_for_backend(layout.name).name == layout.name


@pytest.mark.parametrize("name", ["TRITON_ATTN", "TORCH_SDPA", "FLEX_ATTENTION", ""])
def test_unknown_backend_raises_helpfully(name):
    with pytest.raises(ValueError) as err:
        layout_for_backend(name)
    msg = str(err.value)
    assert repr(name) in msg and "not supported" in msg
    for needed in ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "--attention-backend", "VLLM_ATTENTION_BACKEND"):
        assert needed in msg
