"""Device check of the connector's layer-wise pipeline (``connector/layerwise.py``) itself.

``gpu_check.py``'s ``layerwise`` rows time per-layer copies of the copy module; this runs the
classes the worker runs with ``layerwise: true``, on paged KV as vLLM 0.32 allocates it
(``gpu_check.paged_buffer``, ``FLASH_ATTN`` ``LBNHC`` and ``FLASHINFER`` ``LBHNC``, bf16,
blocks of 16), with a synthetic per-layer "forward" (one square matmul per layer, sized like
one layer's copy) on the compute stream:

- save: ``LayerwiseSaver`` after each layer's matmul, as ``save_kv_layer`` is called; bit-exact
  against the paged source; ``hidden`` = ``1 - (forward with saves - forward) / saves alone``.
- load: ``LayerwiseLoader.start`` before the forward, ``wait_layer`` before each layer's matmul,
  as ``wait_for_layer_load`` is called; the step's new tokens (the last block's free tail) are
  written into paged KV before each wait, as vLLM's KV update does, and must survive;
  bit-exact; ``hidden`` likewise.

Needs only torch and this package (the connector package's ``__init__`` imports vLLM, so the
module file is loaded on its own). ``--device cpu`` runs the same code (copies synchronous,
``hidden`` about 0); ``tests/test_gpu_check.py`` runs it with ``--quick``.

    python benchmarks/gpu_layerwise.py [--device cuda|cpu] [--quick] [--json PATH]

Exit status 0 when every row is bit-exact. Goal (CUDA only, printed): load ``hidden`` >= 0.5.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import gpu_check  # noqa: E402
from gpu_check import GOAL_HIDDEN, _matmul_size, paged_buffer, timed, token_slots  # noqa: E402

from lmcache_mooncake.kv.layouts import layout_for_backend  # noqa: E402


def _layerwise_module() -> Any:
    spec = importlib.util.spec_from_file_location("lmcm_layerwise", REPO / "lmcache_mooncake/connector/layerwise.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


LW = _layerwise_module()
ORDERS = (("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "LBHNC"))


def check(device: torch.device, backend: str, order: str, sizes: gpu_check.Sizes) -> dict[str, Any]:
    dtype, n_block, tokens, layers = torch.bfloat16, 16, sizes.layer_tokens, sizes.layers
    blocks = 2 * -(-tokens // n_block) + 2
    layout = layout_for_backend(backend)
    raw, views = paged_buffer(order, layers, blocks, sizes.heads, n_block, sizes.head_size, dtype, device)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(5)).tolist()
    src_slots = token_slots(table[: blocks // 2], n_block, tokens)
    dst_table = table[blocks // 2 :]
    mm: list[torch.Tensor] = []  # the per-layer matmul's operand, sized once the loads are timed

    def forward(per_layer=lambda i: None, before=lambda i: None) -> None:
        for i in range(layers):
            before(i)
            torch.mm(mm[0], mm[0])
            per_layer(i)

    out: dict[str, Any] = {"backend": backend, "kv_layout": order, "tokens": tokens, "layers": layers}

    # -- save: after each layer, as save_kv_layer --------------------------------------------------
    saver = LW.LayerwiseSaver(views, n_block)
    slot_list = src_slots.tolist()

    def saves(with_forward: bool) -> list:
        saver.begin([slot_list], [0], object())
        (forward if with_forward else (lambda per_layer: [per_layer(i) for i in range(layers)]))(
            per_layer=lambda i: saver.layer(i, views[i]))
        return saver.finish()

    out["save_alone_s"] = timed(lambda: saves(False), sizes.reps, device)
    (staged,) = saves(False)
    ok_save = staged.kv_caches is not None and all(
        torch.equal(_tokens(layout, staged.kv_caches[i], staged.slots), _tokens(layout, views[i], src_slots))
        for i in range(layers))

    # -- load: start before the forward, wait before each layer -----------------------------------
    end = tokens - 5  # the last block's free tail: the step's new tokens
    dst_slots = token_slots(dst_table, n_block, tokens)
    loader = LW.LayerwiseLoader(views, n_block, layout)
    want = [_tokens(layout, views[i], src_slots[:end]).cpu() for i in range(layers)]
    new = [torch.randn(2, tokens - end, sizes.heads * sizes.head_size).to(device, dtype).view(torch.int16)
           for _ in range(layers)]

    def loads(with_forward: bool) -> None:
        (into,) = loader.begin([(dst_slots[:end].tolist(), 0, 0)])
        for i in range(layers):  # what the worker's retrieve writes into staging
            layout.scatter(into.kv_caches[i], torch.tensor(into.slots), want[i].view(dtype))
        loader.start()

        def before(i: int) -> None:
            layout.scatter(views[i], dst_slots[end:], new[i].view(dtype))  # vLLM's KV update of layer i
            loader.wait_layer(i)

        if with_forward:
            forward(before=before)
        else:
            for i in range(layers):
                before(i)
        assert loader.finish() == []
        loader.finish_all()

    out["load_alone_s"] = timed(lambda: loads(False), sizes.reps, device)
    out["matmul_n"] = n = _matmul_size(device, out["load_alone_s"] / layers)
    mm.append(torch.randn(n, n, device=device, dtype=dtype))
    out["forward_s"] = forward_s = timed(forward, sizes.reps, device)
    out["save_with_forward_s"] = timed(lambda: saves(True), sizes.reps, device)
    out["load_with_forward_s"] = timed(lambda: loads(True), sizes.reps, device)
    (staged_f,) = saves(True)
    ok_save = ok_save and all(torch.equal(_tokens(layout, staged_f.kv_caches[i], staged_f.slots),
                                          _tokens(layout, views[i], src_slots)) for i in range(layers))
    ok_load = all(torch.equal(_tokens(layout, views[i], dst_slots[:end]).cpu(), want[i]) and
                  torch.equal(_tokens(layout, views[i], dst_slots[end:]), new[i]) for i in range(layers))
    for what in ("save", "load"):
        alone, both = out[f"{what}_alone_s"], out[f"{what}_with_forward_s"]
        out[f"{what}_hidden"] = 1 - (both - forward_s) / alone if alone > 0 else 0.0
    out["bit_exact"] = bool(ok_save and ok_load)
    out["save_bit_exact"], out["load_bit_exact"] = bool(ok_save), bool(ok_load)
    return out


def _tokens(layout, kv_layer: torch.Tensor, slots) -> torch.Tensor:
    slots = torch.as_tensor(slots)
    buf = torch.empty(2, len(slots), kv_layer.shape[1] * (kv_layer.shape[-1] // 2), dtype=kv_layer.dtype,
                      device=kv_layer.device)
    layout.gather(kv_layer, slots, buf)
    return buf.view(torch.int16)  # compared as integers: the random bits hold NaNs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="a small cache (4 layers, 512 tokens): a smoke run")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "gpu_layerwise.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sizes = gpu_check.QUICK if args.quick else gpu_check.FULL
    rows = []
    for backend, order in ORDERS:
        r = check(device, backend, order, sizes)
        rows.append(r)
        print(f"{'ok  ' if r['bit_exact'] else 'FAIL'} {backend}/{order} {r['tokens']} tokens x {r['layers']} layers: "
              f"forward {r['forward_s'] * 1e3:.2f} ms; save {r['save_alone_s'] * 1e3:.2f} ms alone, hidden "
              f"{r['save_hidden']:.2f}; load {r['load_alone_s'] * 1e3:.2f} ms alone, hidden {r['load_hidden']:.2f}",
              flush=True)
    if device.type == "cuda":
        worst = min(r["load_hidden"] for r in rows)
        print(f"goal: layer-wise load hidden >= {GOAL_HIDDEN}: {'met' if worst >= GOAL_HIDDEN else 'NOT met'} "
              f"({worst:.2f})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
