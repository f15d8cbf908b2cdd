"""The host <-> device mover (kv/device_copy.py) and the copier's use of it.

On this machine (no GPU) the copies run on the CPU: directly (what vLLM's CPU
build gets) and, with ``force_staging``, through the scratch-and-copy path the
GPU takes, so its slicing is checked here. The CUDA tests run where torch sees
a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache_mooncake.kv import device_copy
from lmcache_mooncake.kv.device_copy import TO_DEVICE, TO_HOST, DeviceCopier, for_device
from lmcache_mooncake.kv.layouts import layout_for_backend
from lmcache_mooncake.kv.paged_copy import PagedKV

L, B, H, N, D = 3, 12, 2, 16, 8
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu_paged(device: str = "cpu", fill: bool = True) -> PagedKV:
    """FLASH_ATTN paged KV in vLLM's default NHD order: per-layer [B, H, N, 2D] views of one buffer."""
    raw = torch.randn(L, B, N, H, 2 * D, device=device) if fill else torch.zeros(L, B, N, H, 2 * D, device=device)
    return PagedKV(layout_for_backend("FLASH_ATTN"), [raw[i].permute(0, 2, 1, 3) for i in range(L)])


def chunk_of(paged: PagedKV, slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(2, L, slots.numel(), H * D, device=paged.device)
    paged.gather(slots, out)
    return out


@pytest.mark.parametrize("staged", [False, True])
def test_chunk_round_trip_is_bit_exact_and_done_on_return(staged):
    copier = DeviceCopier("cpu", force_staging=staged)
    src, dst = gpu_paged(), gpu_paged(fill=False)
    slots = torch.randperm(B * N)[:70]
    host = torch.full((2, L, 70, H * D), float("nan"))
    handle = copier.start_to_host(host, lambda t: src.gather(slots, t))
    assert handle.done() and handle.direction == TO_HOST
    assert torch.equal(host, chunk_of(src, slots))
    # A token range of the chunk (a strided host view) into other paged KV.
    handle = copier.start_to_device(host[:, :, 10:50], lambda t: dst.scatter(slots[10:50], t))
    copier.wait(handle)
    assert handle.done() and handle.direction == TO_DEVICE
    assert torch.equal(chunk_of(dst, slots[10:50]), host[:, :, 10:50])
    others = torch.ones(B * N, dtype=torch.bool)
    others[slots[10:50]] = False
    assert not chunk_of(dst, torch.nonzero(others).flatten()).any()  # nothing else written


def test_staged_copies_reuse_one_scratch_per_direction():
    copier = DeviceCopier("cpu", force_staging=True)
    src = gpu_paged()
    seen = []

    def fill(slots):
        def step(t):
            seen.append(t.untyped_storage().data_ptr())
            src.gather(slots, t)
        return step

    for n in (40, 30, 40):
        host = torch.empty(2, L, n, H * D)
        copier.synchronize(copier.start_to_host(host, fill(torch.arange(n))))
        assert torch.equal(host, chunk_of(src, torch.arange(n)))
    assert len(set(seen)) == 1  # allocated for the first copy, reused (smaller fits)
    host = torch.empty(2, L, 100, H * D)
    copier.synchronize(copier.start_to_host(host, fill(torch.arange(100))))
    assert seen[-1] != seen[0]  # grown once for a bigger copy


def test_per_layer_copies_move_one_layer_only():
    copier = DeviceCopier("cpu", force_staging=True)
    src, dst = gpu_paged(), gpu_paged(fill=False)
    slots = torch.randperm(B * N)[:50]
    want = chunk_of(src, slots)
    for layer in range(L):
        host = torch.empty(2, 50, H * D)
        copier.wait(copier.start_layer_to_host(src, layer, slots, host))
        assert torch.equal(host, want[:, layer])
    layer_host = want[:, 1]  # one layer of a chunk buffer: a strided view, as the layer-wise code passes
    copier.wait(copier.start_layer_to_device(dst, 1, slots, layer_host))
    got = chunk_of(dst, slots)
    assert torch.equal(got[:, 1], want[:, 1])
    assert not got[:, 0].any() and not got[:, 2].any()


def test_pieces_split_strided_sides_into_contiguous_runs():
    buf = torch.arange(2 * L * 20 * 4, dtype=torch.float32).view(2, L, 20, 4)
    assert len(device_copy._pieces(buf, torch.empty_like(buf))) == 1
    part = buf[:, :, 5:9]
    pieces = device_copy._pieces(torch.empty(2, L, 4, 4), part)
    assert len(pieces) == 2 * L and all(d.is_contiguous() and s.is_contiguous() for d, s in pieces)
    out = torch.empty(2, L, 4, 4)
    device_copy._copy(out, part)
    assert torch.equal(out, part)
    many = torch.empty(2, 600, 8, 4)[:, :, :2]  # 1,200 pieces: torch's own strided copy instead
    assert len(device_copy._pieces(torch.empty(2, 600, 2, 4), many)) == 1


def _paged_in(order: str, stacked: bool) -> PagedKV:
    """FLASHINFER paged KV in a vLLM physical order; ``stacked=False``: each layer its own tensor."""
    dims = {"L": L, "B": B, "H": H, "N": N, "C": 2 * D}
    raw = torch.randn([dims[d] for d in order])
    logical = raw.permute(*[order.index(d) for d in "LBHNC"])
    layers = [logical[i] if stacked else logical[i].clone() for i in range(L)]
    return PagedKV(layout_for_backend("FLASHINFER"), layers)


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLHNC"])
@pytest.mark.parametrize("stacked", [True, False])
def test_device_gather_and_scatter_match_the_layout_copies(order, stacked):
    src = _paged_in(order, stacked)
    assert (src.all_layers is not None) == stacked
    slots = src.check_slots(torch.randperm(B * N)[:45])
    want = chunk_of(src, slots)
    got = torch.empty_like(want)
    device_copy.gather_tokens(src, slots, got)
    assert torch.equal(got, want)
    one = torch.empty(2, 45, H * D)
    device_copy.gather_tokens(src, slots, one, layer=2)
    assert torch.equal(one, want[:, 2])
    dst = _paged_in(order, stacked)
    for kv in dst.kv_caches:
        kv.zero_()
    device_copy.scatter_tokens(dst, slots, want)
    assert torch.equal(chunk_of(dst, slots), want)
    device_copy.scatter_tokens(dst, slots[:5], torch.ones(2, 5, H * D), layer=0)
    assert bool((chunk_of(dst, slots[:5])[:, 0] == 1).all())
    assert torch.equal(chunk_of(dst, slots[:5])[:, 1:], want[:, 1:, :5])
    rest = torch.ones(B * N, dtype=torch.bool)
    rest[slots] = False
    assert not chunk_of(dst, torch.nonzero(rest).flatten()).any()


def test_device_gather_checks_its_arguments_and_takes_strided_buffers():
    src = gpu_paged()
    slots = src.check_slots(torch.arange(20))
    with pytest.raises(ValueError, match="int64"):
        device_copy.gather_tokens(src, slots.int(), torch.empty(2, L, 20, H * D))
    with pytest.raises(ValueError, match="chunk buffer"):
        device_copy.gather_tokens(src, slots, torch.empty(2, L, 21, H * D))
    wide = torch.empty(2, L, 30, H * D)
    device_copy.gather_tokens(src, slots, wide[:, :, 5:25])  # strided: the layout's own copy
    assert torch.equal(wide[:, :, 5:25], chunk_of(src, slots))


def test_for_device_shares_one_copier_per_device_and_refuses_others():
    assert for_device("cpu") is for_device(torch.device("cpu"))
    assert not for_device("cpu").staged
    with pytest.raises(ValueError, match="cpu and cuda"):
        DeviceCopier("meta")


@pytest.mark.parametrize("backend,blocks", [("FLASH_ATTN", False), ("CPU_ATTN", True)])
def test_paged_kv_copier_staged_matches_direct(backend, blocks):
    """The engine's copier through the staging path (as on a GPU) writes what the direct path writes."""
    engine = pytest.importorskip("lmcache_mooncake.engine")
    layout = layout_for_backend(backend, cpu_isa="vec" if backend == "CPU_ATTN" else None)
    torch.manual_seed(1)
    kv = [torch.randn(B, H, N, 2 * D) for _ in range(L)]
    slots = torch.randperm(B * N)[:96]
    starts, ends = [0, 64], [64, 96]
    results = []
    for staged in (False, True):
        copier = engine.PagedKVCopier(layout, L, H, D, "blocks" if blocks else "tokens")
        copier.copier = DeviceCopier("cpu", force_staging=staged)
        objs = [SimpleNamespace(tensor=torch.empty(2, L, e - s, H * D)) for s, e in zip(starts, ends, strict=True)]
        copier.batched_from_gpu(objs, starts, ends, kvcaches=kv, slot_mapping=slots)
        out = [torch.zeros_like(t) for t in kv]
        copier.batched_to_gpu(objs, starts, ends, kvcaches=out, slot_mapping=slots,
                              skip_leading_tokens=5, load_end=90)
        results.append(([o.tensor for o in objs], out))
    (chunks_a, out_a), (chunks_b, out_b) = results
    assert all(torch.equal(a, b) for a, b in zip(chunks_a, chunks_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(out_a, out_b, strict=True))
    paged_in, paged_out = PagedKV(layout, kv), PagedKV(layout, out_b)
    assert torch.equal(chunk_of(paged_out, slots[5:90]), chunk_of(paged_in, slots[5:90]))
    assert not chunk_of(paged_out, slots[:5]).any() and not chunk_of(paged_out, slots[90:]).any()


# -- CUDA --------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_round_trip_through_streams(pinned):
    copier = DeviceCopier("cuda")
    src, dst = gpu_paged("cuda"), gpu_paged("cuda", fill=False)
    slots = src.check_slots(torch.randperm(B * N)[:70])
    host = torch.empty(2, L, 70, H * D, pin_memory=pinned)
    handle = copier.start_to_host(host, lambda t: src.gather(slots, t))
    assert pinned or handle.done()  # unpinned: staged and complete on return
    copier.wait(handle)
    assert torch.equal(host, chunk_of(src, slots).cpu())
    handle = copier.start_to_device(host[:, :, 10:50], lambda t: dst.scatter(slots[10:50], t))
    copier.wait(handle)  # the current stream waits; the host does not
    assert torch.equal(chunk_of(dst, slots[10:50]).cpu(), host[:, :, 10:50])
    copier.synchronize(handle)
    assert handle.done() and not handle.keep


@cuda
def test_cuda_save_sees_what_the_current_stream_wrote():
    copier = DeviceCopier("cuda")
    src = gpu_paged("cuda")
    slots = src.check_slots(torch.arange(64))
    host = torch.empty(2, L, 64, H * D, pin_memory=True)
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        a = a @ a  # queue work on the current stream, then overwrite KV after it
    src.kv_caches[0].fill_(3.0)
    copier.wait(copier.start_layer_to_host(src, 0, slots, host[:, 0]))
    assert bool((host[:, 0] == 3.0).all())
