"""Time gather/scatter of one chunk between paged KV and a KV_2LTD buffer, per layout.

Qwen2-0.5B geometry by default: 24 layers, 2 KV heads of 64, bf16, blocks of
128 tokens, 2000 blocks per layer, chunks of 256 tokens. The paged tensors
are allocated the way vLLM 0.32's model runner does (one flat buffer viewed
per layer by ``vllm.v1.kv_cache_interface.create_kv_cache_views``), so they
have vLLM's real strides. Layouts timed: ``CPU_ATTN`` (in ``LBHNC``, the only
physical order the CPU backend allows) and the layout the GPU backends share
(``FLASH_ATTN`` / ``FLASHINFER`` / ``TRITON_ATTN``, rows ``GPU/...``) in each
physical order given by ``--kv-layouts`` (default: ``LBNHC`` = NHD, vLLM's
default; ``LBHNC`` = HND; ``BLNHC``, block-outer: every block holds all the
layers' pages). Each is timed on two slot patterns: ``blocks`` (the chunk
fills two whole blocks picked at random, which is what a 256-token chunk
looks like in vLLM) and ``scattered`` (256 random slots anywhere: the worst
case). ``CPU_ATTN`` is also timed with chunks kept as its blocks' own bytes
(``block_chunks.py``, rows ``(chunk as blocks)``), the chunk layout its
``vec`` kernels use. The baseline is a plain contiguous ``copy_`` of the same
number of bytes, timed in the same run.

    .venv/bin/python benchmarks/layout_copy.py [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from lmcache_mooncake.chunks.keys import BLOCKS, TOKENS
from lmcache_mooncake.kv import block_chunks
from lmcache_mooncake.kv.layouts import CpuAttnLayout, GpuPagedLayout, PagedLayout
from lmcache_mooncake.kv.paged_copy import PagedKV, gather_chunk, scatter_chunk

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "layout_copy.json"


def vllm_kv_caches(
    kv_layout: str,
    layers: int,
    blocks: int,
    heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2D]`` views of one allocation, as vLLM 0.32 builds them.

    Strides as in ``get_kv_cache_config_from_groups`` (vllm/v1/core/kv_cache_utils.py),
    views as in ``allocate_kv_cache`` (vllm/v1/worker/utils.py). The buffer is
    uninitialised on purpose: only the pages a chunk touches get materialised
    (filling 24 x 125 MiB first would dominate the run); the round-trip check
    writes the chunk before reading it.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[kv_layout]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    bytes_per_block = layers * spec.page_size_bytes
    interleaved = bytes_per_block if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, blocks, layers, layout, fixed_strides=(None, interleaved, None, None, None)
    )
    size = bytes_per_block * blocks
    raw = torch.empty(size, dtype=torch.int8, device=device)
    tensor = KVCacheTensor(
        size=size,
        layers=[f"layer.{i}" for i in range(layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    return create_kv_cache_views(raw, spec, blocks, layout, tensor)


def timed_pairs(
    fn: Callable[[], object], baseline: Callable[[], object], reps: int, device: torch.device
) -> list[tuple[float, float]]:
    """``(fn seconds, baseline seconds)`` per rep, each pair run back to back.

    Pairing makes the ratio robust to other load on the machine drifting
    during the run. One untimed warm-up call first (it also faults in the
    pages the chunk touches).
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once(f: Callable[[], object]) -> float:
        start = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - start

    once(fn)
    once(baseline)
    return [(once(fn), once(baseline)) for _ in range(reps)]


def _scatter_blocks(paged: PagedKV, slots: torch.Tensor, src: torch.Tensor) -> None:
    block_chunks.scatter(paged, slots, src, 0, slots.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})"
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--kv-layouts",
        default="LBNHC,LBHNC,BLNHC",
        help="vLLM KVCacheLayout physical orders to time the GPU backends' layout in (comma-separated)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 0 = torch's choice (default 1: steadier on a shared machine, "
        "where a multi-threaded copy_ waits for whichever thread another process descheduled)",
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    n, t = args.block_size, args.tokens
    hidden = args.kv_heads * args.head_size
    chunk_bytes = 2 * args.layers * t * hidden * dtype.itemsize

    whole_blocks = torch.randperm(args.blocks, generator=gen)[: -(-t // n)]
    patterns = {
        "blocks": (whole_blocks[:, None] * n + torch.arange(n)).reshape(-1)[:t],
        "scattered": torch.randperm(args.blocks * n, generator=gen)[:t],
    }
    src = torch.randn(2, args.layers, t, hidden, generator=gen).to(dtype).to(device)
    out = torch.empty_like(src)
    memcpy_src, memcpy_dst = src.clone(), torch.empty_like(src)

    def memcpy() -> None:
        memcpy_dst.copy_(memcpy_src)

    rows = []
    memcpy_times: list[float] = []
    cases: list[tuple[PagedLayout, str]] = [(CpuAttnLayout("vec"), "LBHNC")]
    cases += [(GpuPagedLayout(), name.strip()) for name in args.kv_layouts.split(",") if name.strip()]
    for layout, kv_layout in cases:
        label = f"{'CPU_ATTN' if isinstance(layout, CpuAttnLayout) else 'GPU'}/{kv_layout}"
        caches = vllm_kv_caches(
            kv_layout, args.layers, args.blocks, args.kv_heads, n, args.head_size, dtype, device
        )
        chunk_layouts = [TOKENS]
        if layout.chunk_layout(caches[0], t) == BLOCKS and t % n == 0:
            chunk_layouts.append(BLOCKS)
        for (pattern, slots), chunk_layout in itertools.product(patterns.items(), chunk_layouts):
            slots = slots.to(device)
            # As the connector copies: the paged tensors validated once (PagedKV), many chunks.
            paged = PagedKV(layout, caches)
            if chunk_layout == BLOCKS:
                # The chunk keeps the blocks' own bytes (block_chunks.py), as CPU_ATTN's chunks do.
                gather, scatter = partial(block_chunks.gather, paged), partial(_scatter_blocks, paged)
            else:
                gather, scatter = paged.gather, paged.scatter
            scatter(slots, src)
            gather(slots, out)
            if not torch.equal(out.view(torch.int16), src.view(torch.int16)):
                raise SystemExit(f"{label}/{pattern}/{chunk_layout}: gather after scatter did not round-trip")
            if chunk_layout == TOKENS:
                scatter_chunk(layout, caches, slots, src)  # the one-shot helpers agree
                gather_chunk(layout, caches, slots, out)
                if not torch.equal(out.view(torch.int16), src.view(torch.int16)):
                    raise SystemExit(f"{label}/{pattern}: gather_chunk did not round-trip")
            for op, fn in (
                ("gather", partial(gather, slots, out)),
                ("scatter", partial(scatter, slots, src)),
            ):
                pairs = timed_pairs(fn, memcpy, args.reps, device)
                times = [p[0] for p in pairs]
                memcpy_times += [p[1] for p in pairs]
                median_s = statistics.median(times)
                rows.append(
                    {
                        "layout": label + (" (chunk as blocks)" if chunk_layout == BLOCKS else ""),
                        "op": op,
                        "pattern": pattern,
                        "median_ms": median_s * 1e3,
                        "min_ms": min(times) * 1e3,
                        "gb_per_s": chunk_bytes / median_s / 1e9,
                        # op speed / memcpy speed, per back-to-back pair, then the median.
                        "of_memcpy": statistics.median(base / t for t, base in pairs),
                    }
                )
        del caches
        gc.collect()

    memcpy_s = statistics.median(memcpy_times)
    memcpy_gbps = chunk_bytes / memcpy_s / 1e9

    print(
        f"chunk: {t} tokens x {args.layers} layers x {args.kv_heads} heads x {args.head_size} "
        f"({dtype}, block {n}, {args.blocks} blocks) = {chunk_bytes / 2**20:.2f} MiB; "
        f"{args.reps} reps, medians; torch {torch.__version__}, {torch.get_num_threads()} threads, {device}"
    )
    print(f"{'layout':<34} {'op':<8} {'pattern':<10} {'ms':>8} {'GB/s':>8} {'of memcpy':>10}")
    print(
        f"{'memcpy':<34} {'copy_':<8} {'contiguous':<10} {memcpy_s * 1e3:>8.3f} {memcpy_gbps:>8.2f} {1.0:>9.2f}x"
    )
    for r in rows:
        print(
            f"{r['layout']:<34} {r['op']:<8} {r['pattern']:<10} {r['median_ms']:>8.3f} "
            f"{r['gb_per_s']:>8.2f} {r['of_memcpy']:>9.3f}x"
        )

    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"dtype": str(dtype)},
        "chunk_bytes": chunk_bytes,
        "env": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            # Other processes competing for the CPUs make every number noisier.
            "loadavg_1m_at_end": os.getloadavg()[0],
        },
        "memcpy": {"median_ms": memcpy_s * 1e3, "min_ms": min(memcpy_times) * 1e3, "gb_per_s": memcpy_gbps},
        "results": rows,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
