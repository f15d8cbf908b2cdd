"""Device check: paged KV <-> host chunks on a GPU, bit-exact, and their speed against pinned memcpy.

One run gives every GPU figure (under 5 minutes on one H100); ``--device cpu``
runs the same code on the CPU (``tests/test_gpu_check.py`` does, with
``--quick``, so the script cannot rot). Checks, each a table row (JSON in
``benchmarks/results/gpu_check.json``):

- ``copies``: paged KV as vLLM 0.32 allocates it (one buffer, per-layer
  ``[B, H, N, 2D]`` views) for ``FLASH_ATTN`` in vLLM's default order ``LBNHC``
  (NHD), ``FLASHINFER`` in ``LBHNC`` (HND, its SM100 order) and block-outer
  ``BLHNC``; bf16 and fp16; blocks of 16 and 128. A prompt's chunks (the last
  partial) go through :class:`~lmcache_mooncake.kv.device_copy.DeviceCopier`
  into pinned host buffers (one unpinned row per order: the staging path) and
  back into fresh paged KV at other blocks, also for a load starting and ending
  inside chunks. Bit-exact (random bits compared as integers) against the
  source read straight from the buffer, other blocks untouched; GB/s against
  pinned ``cudaMemcpyAsync`` of the same bytes each way, in the same run.
- ``tiers``: the same through LMCache's engine with our copier: the CPU tier
  timed against that memcpy, then disk and Mooncake store, each read back by a
  fresh engine; skipped, with the reason, where LMCache or Mooncake is missing.
- ``layerwise``: each layer's load on the copy stream against a synthetic
  matmul per layer (sized like one layer's load) on the compute stream, which
  waits on the layer's event before its matmul: ``queued`` starts every load
  first, ``ahead`` starts layer ``l + 1`` before layer ``l``'s matmul. Hidden
  = ``1 - (overlapped - compute) / load`` (about 0 on the CPU: copies there
  are synchronous).

Needs only torch and this package; vLLM is not needed: where it does not
import, the one vLLM module this package imports at import time
(``vllm.distributed.kv_events``, via the tiers) is stubbed here.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--quick] [--json PATH] [--no-tiers] [--no-store]

Exit status 0 when every check that ran was bit-exact and raised nothing; 1
otherwise. Goals (CUDA only) are printed and recorded, not enforced.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lmcache_mooncake.kv.device_copy import DeviceCopier  # noqa: E402
from lmcache_mooncake.kv.layouts import layout_for_backend  # noqa: E402
from lmcache_mooncake.kv.paged_copy import PagedKV  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "gpu_check.json"
CHUNK = 256
#: (backend, vLLM KVCacheLayout of the buffer): the physical orders checked.
LAYOUTS = (("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "LBHNC"), ("FLASHINFER", "BLHNC"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: (dtype, block size) of every layout checked.
GEOMETRIES = tuple((dname, block_size) for dname in DTYPES for block_size in (16, 128))
GOAL_TIER_RATIO = 0.8
GOAL_HIDDEN = 0.5


@dataclass(frozen=True)
class Sizes:
    layers: int
    heads: int
    head_size: int
    copy_tokens: int  # prompt of the copies check (ends in a partial chunk)
    tier_tokens: int
    layer_tokens: int  # tokens per layer in the layer-wise check
    reps: int

    def token_bytes(self, dtype: torch.dtype) -> int:
        return 2 * self.layers * self.heads * self.head_size * dtype.itemsize


FULL = Sizes(layers=32, heads=8, head_size=128, copy_tokens=16 * CHUNK + 100, tier_tokens=8 * CHUNK + 100,
             layer_tokens=8192, reps=5)  # a Llama-3-8B-shaped cache: 128 KiB per token
QUICK = Sizes(layers=4, heads=2, head_size=64, copy_tokens=2 * CHUNK + 37, tier_tokens=2 * CHUNK + 37,
              layer_tokens=512, reps=2)


# -- paged KV as vLLM allocates it ------------------------------------------------


def paged_buffer(order: str, layers: int, blocks: int, heads: int, block_size: int, head_size: int,
                 dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(raw, views)``: one buffer in vLLM's physical ``order`` (a ``KVCacheLayout`` name over
    ``L, B, H, N, C``) and its per-layer logical ``[B, H, N, 2D]`` views, as
    ``create_kv_cache_views`` (vllm/v1/kv_cache_interface.py) builds them: the same strides
    (``tests/test_gpu_check.py`` compares them with vLLM's where vLLM imports). Filled with
    random bit patterns (NaNs included: comparisons are of the integers)."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": block_size, "C": 2 * head_size}
    raw = torch.randint(-(2**15), 2**15, [sizes[d] for d in order], dtype=torch.int16, device=device)
    raw = raw.view(dtype)
    logical = raw.permute(*[order.index(d) for d in "LBHNC"])  # [L, B, H, N, C] view
    return raw, [logical[i] for i in range(layers)]


def canonical(raw: torch.Tensor, order: str) -> torch.Tensor:
    """``raw`` as an ``[L, B, N, H, C]`` integer view, read straight from the physical buffer
    (the reference: no layout code of ours)."""
    return raw.view(torch.int16).permute(*[order.index(d) for d in "LBNHC"])


def token_slots(block_table: list[int], block_size: int, tokens: int) -> torch.Tensor:
    return torch.tensor([block_table[t // block_size] * block_size + t % block_size for t in range(tokens)])

def chunk_ranges(tokens: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, tokens)) for a in range(0, tokens, CHUNK)]


def synchronizer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median seconds of ``reps`` calls of ``fn`` (device work included), after one untimed call."""
    sync = synchronizer(device)
    times = []
    for i in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device,
               pinned: bool = True) -> torch.Tensor:
    """A host tensor, pinned when ``device`` is a GPU (as LMCache's CPU tier is there) unless not ``pinned``."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned and device.type == "cuda")


class Memcpy:
    """The baseline: one plain copy of the same bytes each way, timed in the same run (pinned
    ``cudaMemcpyAsync`` on a GPU, a host ``memcpy`` on the CPU), on buffers allocated once."""

    def __init__(self, nbytes: int, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps
        self.host = host_empty([nbytes], torch.uint8, device)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host.fill_(1)
        self.dev.fill_(2)
        self._seen: dict[int, dict[str, float]] = {}

    def seconds(self, nbytes: int) -> dict[str, float]:
        """``{"d2h_s": ..., "h2d_s": ...}`` for ``nbytes`` (at most the buffers' size)."""
        if nbytes not in self._seen:
            host, dev = self.host[:nbytes], self.dev[:nbytes]
            self._seen[nbytes] = {
                "d2h_s": timed(lambda: host.copy_(dev, non_blocking=True), self.reps, self.device),
                "h2d_s": timed(lambda: dev.copy_(host, non_blocking=True), self.reps, self.device),
            }
        return self._seen[nbytes]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")

# -- checks ------------------------------------------------------------------------


class Report:
    """Rows of the table, the JSON record and whether every check passed."""

    def __init__(self, device: torch.device, sizes: Sizes) -> None:
        self.ok = True
        self.data: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "device_type": device.type, "torch": torch.__version__, "python": platform.python_version(),
            "sizes": sizes.__dict__, "chunk_size": CHUNK, "copies": [], "tiers": [], "layerwise": [],
            "skipped": [], "errors": [],
        }

    def row(self, section: str, ok: bool, name: str, text: str, **fields: Any) -> None:
        self.ok &= ok
        self.data[section].append({"name": name, "bit_exact": ok, **fields})
        print(f"{'ok  ' if ok else 'FAIL'} {section:<9} {name:<34} {text}", flush=True)

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append({"check": what, "why": why})
        print(f"skip {what}: {why}", flush=True)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time a section of the run (``section_s`` in the JSON)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.data.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 2)

    @contextlib.contextmanager
    def guard(self, section: str, name: str) -> Iterator[None]:
        """Record an exception in one check as a failure of that check, and go on."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - reported, counted as a failure
            self.ok = False
            self.data["errors"].append({"check": f"{section} {name}", "error": repr(exc),
                                        "traceback": traceback.format_exc()})
            print(f"FAIL {section:<9} {name:<34} raised {exc!r}", flush=True)
            traceback.print_exc()


def check_copies(report: Report, copier: DeviceCopier, sizes: Sizes, backend: str, order: str, dname: str,
                 block_size: int, memcpy: Memcpy, pinned: bool = True) -> None:
    """Save a prompt's chunks into host chunk buffers (pinned on a GPU, unless ``pinned`` is
    False: then through the copier's pinned staging) and load them back; see the module docstring."""
    device, dtype, tokens = copier.device, DTYPES[dname], sizes.copy_tokens
    layout = layout_for_backend(backend)
    blocks = 2 * (-(-tokens // block_size)) + 3
    gen = torch.Generator().manual_seed(block_size)
    table = torch.randperm(blocks, generator=gen).tolist()
    src_table, dst_table = table[: blocks // 2], table[blocks // 2 :]
    geometry = (sizes.layers, blocks, sizes.heads, block_size, sizes.head_size, dtype, device)
    raw, views = paged_buffer(order, *geometry)
    src = PagedKV(layout, views)
    fresh_raw, fresh_views = paged_buffer(order, *geometry)
    fresh = PagedKV(layout, fresh_views)
    hidden = sizes.heads * sizes.head_size
    src_slots = src.check_slots(token_slots(src_table, block_size, tokens))
    dst_slots = fresh.check_slots(token_slots(dst_table, block_size, tokens))
    bufs = [host_empty((2, sizes.layers, b - a, hidden), dtype, device, pinned) for a, b in chunk_ranges(tokens)]

    def save() -> None:
        handles = [copier.start_chunk_to_host(src, src_slots[a:b], buf)
                   for buf, (a, b) in zip(bufs, chunk_ranges(tokens), strict=True)]
        for h in handles:
            copier.synchronize(h)

    def load(into: PagedKV, lo: int = 0, hi: int = tokens) -> None:
        handles = []
        for buf, (a, b) in zip(bufs, chunk_ranges(tokens), strict=True):
            x, y = max(a, lo), min(b, hi)
            if y > x:
                handles.append(copier.start_chunk_to_device(into, dst_slots[x:y], buf[:, :, x - a : y - a]))
        for h in handles:
            copier.synchronize(h)

    nbytes = tokens * sizes.token_bytes(dtype)
    save_s = timed(save, sizes.reps, device)
    load_s = timed(lambda: load(fresh), sizes.reps, device)
    ok = _same_tokens(raw, fresh_raw, order, src_table, dst_table, block_size, 0, tokens)
    # A load that starts and ends inside chunks, into a zeroed cache: only those tokens change.
    fresh_raw.zero_()
    lo, hi = CHUNK // 2 + 3, tokens - 5
    load(fresh, lo, hi)
    ok &= _same_tokens(raw, fresh_raw, order, src_table, dst_table, block_size, lo, hi)
    ok &= _untouched(fresh_raw, order, dst_table, block_size, lo, hi)
    name = f"{backend}/{order} {dname} N={block_size}{'' if pinned else ' unpinned'}"
    base = memcpy.seconds(nbytes)
    ratio_save, ratio_load = base["d2h_s"] / save_s, base["h2d_s"] / load_s
    report.row("copies", ok, name,
               f"save {gbps(nbytes, save_s):7.2f} GB/s ({ratio_save:4.2f}x memcpy)  "
               f"load {gbps(nbytes, load_s):7.2f} GB/s ({ratio_load:4.2f}x memcpy)",
               backend=backend, kv_layout=order, dtype=dname, block_size=block_size, pinned=pinned,
               bytes=nbytes, save_s=save_s, load_s=load_s, save_vs_memcpy=ratio_save, load_vs_memcpy=ratio_load)


def _same_tokens(raw: torch.Tensor, fresh_raw: torch.Tensor, order: str, src_table: list[int],
                 dst_table: list[int], block_size: int, lo: int, hi: int) -> bool:
    """Tokens ``[lo, hi)`` at their destination blocks equal the source's, bit for bit."""
    t = torch.arange(lo, hi)
    s_blk = torch.tensor(src_table)[t // block_size].to(raw.device)
    d_blk = torch.tensor(dst_table)[t // block_size].to(raw.device)
    off = (t % block_size).to(raw.device)
    return torch.equal(canonical(raw, order)[:, s_blk, off], canonical(fresh_raw, order)[:, d_blk, off])


def _untouched(fresh_raw: torch.Tensor, order: str, dst_table: list[int], block_size: int, lo: int,
               hi: int) -> bool:
    """Every element of the zeroed cache outside tokens ``[lo, hi)`` is still zero."""
    canon = canonical(fresh_raw, order)  # [L, B, N, H, C]
    written = torch.zeros(canon.shape[1:3], dtype=torch.bool, device=fresh_raw.device)
    t = torch.arange(lo, hi)
    written[torch.tensor(dst_table)[t // block_size].to(written.device), (t % block_size).to(written.device)] = True
    return not bool(canon[:, ~written].any())


# -- tiers (LMCache's engine) ---------------------------------------------------------


def import_engine(report: Report) -> types.ModuleType | None:
    """``lmcache_mooncake.engine``, stubbing vLLM's KV-event module where vLLM does not import;
    None (reported) where LMCache does not import."""
    try:
        importlib.import_module("vllm.distributed.kv_events")
        report.data["vllm"] = "imported"
    except Exception as exc:  # noqa: BLE001 - absent or broken: stubbed
        report.data["vllm"] = f"stubbed ({exc!r})"
        _stub_vllm_kv_events()
    try:
        return importlib.import_module("lmcache_mooncake.engine")
    except Exception as exc:  # noqa: BLE001 - reported as a skip
        report.skip("tiers", f"lmcache_mooncake.engine does not import (LMCache missing or broken?): {exc!r}")
        return None


def _stub_vllm_kv_events() -> None:
    """What ``lmcache_mooncake.obs.kv_events`` imports from vLLM, as inert classes (no events are
    published in this check)."""
    for name in [n for n in list(sys.modules) if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]

    class _Event:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.args, self.kwargs = args, kwargs

    for name in ("vllm", "vllm.distributed"):
        sys.modules[name] = types.ModuleType(name)
    events = types.ModuleType("vllm.distributed.kv_events")
    for cls in ("BlockRemoved", "BlockStored", "KVCacheEvent", "KVConnectorKVEvents"):
        setattr(events, cls, type(cls, (_Event,), {}))
    sys.modules["vllm.distributed.kv_events"] = events


@contextlib.contextmanager
def mooncake_store(report: Report, workdir: Path, nbytes: int, enabled: bool) -> Iterator[Path | None]:
    """A Mooncake master and storage process for the check (its state folder), or None (reported)."""
    if not enabled:
        report.skip("tiers store", "--no-store")
        yield None
        return
    try:
        importlib.import_module("mooncake.store")
        from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
    except Exception as exc:  # noqa: BLE001 - reported as a skip
        report.skip("tiers store", f"the Mooncake wheel does not import: {exc!r}")
        yield None
        return
    state_dir = workdir / "store"
    try:
        start_store(StoreSpec(memory_bytes=max(nbytes, 64 << 20), state_dir=state_dir))
    except Exception as exc:  # noqa: BLE001 - reported as a skip
        report.skip("tiers store", f"the store did not start: {exc!r}")
        yield None
        return
    try:
        yield state_dir
    finally:
        stop_store(state_dir)


def check_tiers(report: Report, engine: types.ModuleType, sizes: Sizes, device: torch.device, backend: str,
                order: str, dname: str, block_size: int, memcpy: Memcpy, workdir: Path,
                store_dir: Path | None, slower_tiers: bool) -> None:
    """The CPU tier timed (store and retrieve, against memcpy), then where ``slower_tiers`` the
    disk tier and the store, each written by one engine and read back by a fresh one."""
    from lmcache_mooncake.chunks.keys import KeyNamespace
    from lmcache_mooncake.config import CacheConfig, MooncakeConfig

    dtype, tokens, reps = DTYPES[dname], sizes.tier_tokens, min(sizes.reps, 3)
    layout = layout_for_backend(backend)
    tag = f"{backend}-{order}-{dname}-{block_size}"
    ns = KeyNamespace(f"gpu-check-{tag}", str(dtype).removeprefix("torch."), sizes.layers, sizes.heads,
                      sizes.head_size, CHUNK)
    nbytes = tokens * sizes.token_bytes(dtype)
    blocks = -(-tokens // block_size) + 2
    geometry = (sizes.layers, blocks, sizes.heads, block_size, sizes.head_size, dtype, device)
    raw, views = paged_buffer(order, *geometry)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(7)).tolist()
    slots = token_slots(table, block_size, tokens)
    rc = engine.request_configs(None, None)
    prompts = [torch.arange(tokens) + 1000 * (r + 1) for r in range(reps + 1)]  # one per store: new keys
    gib = (reps + 2) * nbytes / 2**30 + 0.05

    def build(name: str, **cfg: Any) -> Any:
        return engine.build_engine(CacheConfig(max_local_cpu_size=gib, prefault_cpu_tier=False, **cfg), ns,
                                   layout, dtype, f"{tag}-{name}")

    def read_back(eng: Any, prompt: torch.Tensor) -> tuple[bool, float]:
        out_raw, out_views = paged_buffer(order, *geometry)
        sync = synchronizer(device)
        sync()
        t0 = time.perf_counter()
        ret = eng.retrieve(prompt, mask=None, kvcaches=out_views, slot_mapping=slots, request_configs=rc)
        sync()
        took = time.perf_counter() - t0
        return bool(ret.all()) and _same_tokens(raw, out_raw, order, table, table, block_size, 0, tokens), took

    name = f"{backend}/{order} {dname} N={block_size}"
    with report.guard("tiers", f"cpu {name}"):
        eng = build("cpu")
        try:
            it = iter(prompts)
            store_s = timed(lambda: eng.store(next(it), mask=None, kvcaches=views, slot_mapping=slots,
                                              request_configs=rc), reps, device)
            results = [read_back(eng, p) for p in prompts]
        finally:
            engine.close_engine(eng, f"{tag}-cpu")
        ok = all(r[0] for r in results)
        load_s = statistics.median(r[1] for r in results[1:])
        base = memcpy.seconds(nbytes)
        rs, rl = base["d2h_s"] / store_s, base["h2d_s"] / load_s
        report.row("tiers", ok, f"cpu {name}",
                   f"store {gbps(nbytes, store_s):7.2f} GB/s ({rs:4.2f}x memcpy)  "
                   f"retrieve {gbps(nbytes, load_s):7.2f} GB/s ({rl:4.2f}x memcpy)",
                   tier="cpu", backend=backend, kv_layout=order, dtype=dname, block_size=block_size,
                   bytes=nbytes, store_s=store_s, retrieve_s=load_s, store_vs_memcpy=rs, retrieve_vs_memcpy=rl)

    if not slower_tiers:
        return
    slower: dict[str, dict[str, Any]] = {"disk": {"local_disk": str(workdir / f"disk-{tag}")}}
    if store_dir is not None:
        slower["store"] = {"mooncake": MooncakeConfig(store_dir=str(store_dir), mode="tcp", timeout=5.0)}
    for tier, cfg in slower.items():
        with report.guard("tiers", f"{tier} {name}"):
            writer = build(f"{tier}-w", **cfg)
            try:
                writer.store(prompts[0], mask=None, kvcaches=views, slot_mapping=slots, request_configs=rc)
                if not engine.drain(writer, 120):
                    raise RuntimeError(f"{tier} writes did not finish in 120 s")
            finally:
                engine.close_engine(writer, f"{tag}-{tier}-w")
            reader = build(f"{tier}-r", **cfg)  # a fresh engine: its CPU tier is empty
            try:
                ok, took = read_back(reader, prompts[0])
            finally:
                engine.close_engine(reader, f"{tag}-{tier}-r")
            report.row("tiers", ok, f"{tier} {name}", f"retrieve by a fresh engine {gbps(nbytes, took):7.2f} GB/s",
                       tier=tier, backend=backend, kv_layout=order, dtype=dname, block_size=block_size,
                       bytes=nbytes, retrieve_s=took)


# -- layer-wise overlap -----------------------------------------------------------


def check_layerwise(report: Report, copier: DeviceCopier, sizes: Sizes, backend: str, order: str) -> None:
    device, dtype, block_size, tokens = copier.device, torch.bfloat16, 16, sizes.layer_tokens
    layout = layout_for_backend(backend)
    blocks = -(-tokens // block_size)
    raw, views = paged_buffer(order, sizes.layers, blocks, sizes.heads, block_size, sizes.head_size, dtype, device)
    raw.zero_()
    paged = PagedKV(layout, views)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(3)).tolist()
    slots = paged.check_slots(token_slots(table, block_size, tokens))
    hidden = sizes.heads * sizes.head_size
    host = [host_empty((2, tokens, hidden), dtype, device) for _ in range(sizes.layers)]
    want = torch.randint(-(2**15), 2**15, (sizes.layers, 2, tokens, hidden), dtype=torch.int16)
    for layer, h in enumerate(host):
        h.view(torch.int16).copy_(want[layer])

    def load_all() -> None:
        handles = [copier.start_layer_to_device(paged, layer, slots, host[layer]) for layer in range(sizes.layers)]
        for h in handles:
            copier.synchronize(h)

    load_s = timed(load_all, sizes.reps, device)
    n = _matmul_size(device, load_s / sizes.layers)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def compute() -> None:
        for _ in range(sizes.layers):
            torch.mm(a, b)

    def queued() -> None:
        handles = [copier.start_layer_to_device(paged, layer, slots, host[layer]) for layer in range(sizes.layers)]
        for h in handles:
            copier.wait(h)
            torch.mm(a, b)

    def ahead() -> None:
        handle = copier.start_layer_to_device(paged, 0, slots, host[0])
        for layer in range(sizes.layers):
            copier.wait(handle)
            if layer + 1 < sizes.layers:
                handle = copier.start_layer_to_device(paged, layer + 1, slots, host[layer + 1])
            torch.mm(a, b)

    compute_s = timed(compute, sizes.reps, device)
    figures: dict[str, float] = {}
    for mode, fn in (("queued", queued), ("ahead", ahead)):
        raw.zero_()
        overlapped = timed(fn, sizes.reps, device)
        figures[f"{mode}_s"] = overlapped
        figures[f"{mode}_hidden"] = 1 - (overlapped - compute_s) / load_s
    got = torch.stack([torch.empty(2, tokens, hidden, dtype=dtype, device=device) for _ in range(sizes.layers)])
    for layer in range(sizes.layers):
        layout.gather(views[layer], slots, got[layer])
    ok = torch.equal(got.view(torch.int16).cpu(), want)
    report.row("layerwise", ok, f"{backend}/{order} bf16 N={block_size}",
               f"load {load_s * 1e3:7.2f} ms  compute {compute_s * 1e3:7.2f} ms (matmul {n})  hidden: "
               f"queued {figures['queued_hidden']:5.2f}, ahead {figures['ahead_hidden']:5.2f}",
               backend=backend, kv_layout=order, tokens=tokens, load_s=load_s, compute_s=compute_s,
               matmul_n=n, **figures)


def _matmul_size(device: torch.device, target_s: float) -> int:
    """A square bf16 matmul size whose time is about ``target_s`` on ``device``."""
    n = 1024 if device.type == "cuda" else 128
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t = timed(lambda: [torch.mm(a, a) for _ in range(10)], 3, device) / 10
    scaled = int(n * (target_s / max(t, 1e-9)) ** (1 / 3))
    return max(64, min(16384, scaled // 64 * 64 or 64))


# -- main -------------------------------------------------------------------------


def run_tiers(report: Report, args: argparse.Namespace, sizes: Sizes, device: torch.device, memcpy: Memcpy) -> None:
    """:func:`check_tiers` for every geometry through the CPU tier, and for fewer (every layout,
    both dtypes at N=16; with ``--quick`` bf16 only, CPU tier too) through disk and store."""
    if args.no_tiers:
        report.skip("tiers", "--no-tiers")
        return
    engine = import_engine(report)
    if engine is None:
        return
    slow_geometries = [("bf16", 16)] if args.quick else [("bf16", 16), ("fp16", 16)]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        store_bytes = 2 * len(LAYOUTS) * len(slow_geometries) * sizes.tier_tokens * sizes.token_bytes(torch.bfloat16)
        with mooncake_store(report, Path(tmp), store_bytes, not args.no_store) as store_dir:
            for backend, order in LAYOUTS:
                for dname, block_size in GEOMETRIES:
                    slower = (dname, block_size) in slow_geometries
                    if args.quick and not slower:
                        continue
                    check_tiers(report, engine, sizes, device, backend, order, dname, block_size, memcpy,
                                Path(tmp), store_dir, slower)


def goals(report: Report) -> None:
    """The GPU goals of issue 35, from the rows (recorded; CUDA only)."""
    if report.data["device_type"] != "cuda":
        report.data["goals"] = "not judged on the CPU"
        return
    tiers = [r for r in report.data["tiers"] if r.get("tier") == "cpu"]
    layer = report.data["layerwise"]
    result = {
        "cpu_tier_vs_memcpy_min": min((min(r["store_vs_memcpy"], r["retrieve_vs_memcpy"]) for r in tiers),
                                      default=None),
        "copies_vs_memcpy_min": min((min(r["save_vs_memcpy"], r["load_vs_memcpy"]) for r in report.data["copies"]),
                                    default=None),
        "layerwise_hidden_min": min((max(r["queued_hidden"], r["ahead_hidden"]) for r in layer), default=None),
    }
    for goal, key, floor in (("tier_goal_met", "cpu_tier_vs_memcpy_min", GOAL_TIER_RATIO),
                             ("layerwise_goal_met", "layerwise_hidden_min", GOAL_HIDDEN)):
        result[goal] = result[key] is not None and result[key] >= floor
    report.data["goals"] = result
    print(f"goals: CPU tier >= {GOAL_TIER_RATIO} of memcpy: {result['cpu_tier_vs_memcpy_min']} "
          f"(copies alone {result['copies_vs_memcpy_min']}); layer-wise hidden >= {GOAL_HIDDEN}: "
          f"{result['layerwise_hidden_min']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (the CPU test)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--no-tiers", action="store_true", help="skip LMCache's tiers")
    parser.add_argument("--no-store", action="store_true", help="skip the Mooncake store tier")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    torch.manual_seed(0)
    report = Report(device, sizes)
    copier = DeviceCopier(device)
    print(f"device {report.data['device']} ({device}), torch {torch.__version__}, sizes {sizes}", flush=True)

    biggest = max(sizes.copy_tokens, sizes.tier_tokens) * sizes.token_bytes(torch.float16)
    memcpy = Memcpy(biggest, device, sizes.reps)
    base = memcpy.seconds(biggest)
    report.data["memcpy"] = {"bytes": biggest, **base, "d2h_gbps": gbps(biggest, base["d2h_s"]),
                             "h2d_gbps": gbps(biggest, base["h2d_s"])}
    print(f"memcpy  {biggest / 2**20:.0f} MiB: device->host {report.data['memcpy']['d2h_gbps']:.2f} GB/s, "
          f"host->device {report.data['memcpy']['h2d_gbps']:.2f} GB/s", flush=True)
    with report.section("copies"):
        for backend, order in LAYOUTS:
            for dname, block_size in GEOMETRIES:
                with report.guard("copies", f"{backend}/{order} {dname} N={block_size}"):
                    check_copies(report, copier, sizes, backend, order, dname, block_size, memcpy)
            # Unpinned host buffers go through the copier's pinned staging (on the CPU: a copier
            # that stages anyway, so the test runs that path too).
            staged = copier if device.type == "cuda" else DeviceCopier(device, force_staging=True)
            with report.guard("copies", f"{backend}/{order} bf16 N=16 unpinned"):
                check_copies(report, staged, sizes, backend, order, "bf16", 16, memcpy, pinned=False)
    with report.section("tiers"):
        run_tiers(report, args, sizes, device, memcpy)
    with report.section("layerwise"):
        for backend, order in LAYOUTS:
            with report.guard("layerwise", f"{backend}/{order}"):
                check_layerwise(report, copier, sizes, backend, order)
    goals(report)
    report.data["ok"] = report.ok
    report.data["seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report.data, indent=1, default=str))
    print(f"{'all checks bit-exact' if report.ok else 'SOME CHECKS FAILED'} in {report.data['seconds']:.1f} s "
          f"({report.data.get('section_s')}); JSON: {args.json}", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
