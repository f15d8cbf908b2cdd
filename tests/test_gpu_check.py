"""benchmarks/gpu_check.py, the device check, run on the CPU so that it cannot rot.

On a GPU host it is run by hand (``docs/gpu.md``); here ``--device cpu --quick``
runs every one of its checks through the same code (copies synchronous,
staging forced for the unpinned rows) in well under a minute, and its paged
buffers are compared with the ones vLLM itself allocates.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_gpu_check_runs_on_cpu_and_every_check_is_bit_exact(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")]
    report = json.loads(out.read_text())
    assert report["ok"] and report["errors"] == []
    # 3 physical orders x 2 dtypes x 2 block sizes, plus one unpinned (staged) row per order.
    assert len(report["copies"]) == 15 and all(r["bit_exact"] for r in report["copies"])
    assert sum(line.startswith("ok   copies") for line in lines) == 15
    assert len(report["layerwise"]) == 3 and all(r["bit_exact"] for r in report["layerwise"])
    tiers = {r["tier"] for r in report["tiers"]}
    skipped = " ".join(s["check"] for s in report["skipped"])
    if importlib.util.find_spec("lmcache") is not None:
        assert {"cpu", "disk"} <= tiers and all(r["bit_exact"] for r in report["tiers"])
        assert "store" in tiers or "tiers store" in skipped
    else:
        assert "tiers" in skipped


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLHNC"])
def test_paged_buffers_have_vllms_strides(order):
    """The script builds paged KV by hand (no vLLM on the GPU host); here it must match what
    vLLM 0.32's create_kv_cache_views makes of the same physical order."""
    pytest.importorskip("vllm.v1.kv_cache_interface")
    gpu_check = _load("gpu_check", SCRIPT)
    layout_copy = _load("layout_copy", REPO / "benchmarks" / "layout_copy.py")
    geometry = (3, 5, 2, 16, 8, torch.bfloat16, torch.device("cpu"))
    theirs = layout_copy.vllm_kv_caches(order, *geometry)
    _, mine = gpu_check.paged_buffer(order, *geometry)
    assert [(t.shape, t.stride(), t.storage_offset()) for t in theirs] == \
        [(m.shape, m.stride(), m.storage_offset()) for m in mine]


def test_the_layerwise_device_check_runs_on_cpu_and_is_bit_exact(tmp_path):
    """benchmarks/gpu_layerwise.py: the connector's layer-wise saver and loader on paged KV as
    vLLM allocates it, with vLLM's KV update of the step's new tokens before each wait."""
    out = tmp_path / "gpu_layerwise.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_layerwise.py"), "--device", "cpu",
                           "--quick", "--json", str(out)], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["save_bit_exact"] and r["load_bit_exact"] for r in rows)
