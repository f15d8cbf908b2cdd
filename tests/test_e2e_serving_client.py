"""vLLM's own serving benchmark client (``vllm bench serve``) against ``lmcache-mooncake up``.

Not a client of ours: vLLM's client streams every request (``stream: true``,
``stream_options.include_usage``, ``ignore_eos``, ``max_tokens``) and counts a
request failed when the stream gives no token or the status is not 200. One
``up`` (store, 1 prefill, 1 decode, proxy) on the generated tiny model serves
it; the control runs the same client where nothing listens, so the checks
can fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from lmcache_mooncake.runtime.procs import free_port
from lmcache_mooncake.testing.bench_client import ClientRun, run_client
from lmcache_mooncake.testing.up_stack import UpSpec, up_stack

pytestmark = pytest.mark.e2e

PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 256, 8


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("serving-client")
    spec = UpSpec(model=str(model), work=work, store_memory="256MiB",
                  vllm_args=["--dtype=float32", "--max-model-len=4096"])
    with up_stack(spec) as s:
        yield s


def random_run(base_url: str, model: Path, out: Path) -> ClientRun:
    return ClientRun(base_url, str(model), ["--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
                                            "--random-output-len", str(OUTPUT_LEN)],
                     PROMPTS, out, seed=0, request_rate=4.0, timeout_s=180)


def problems(result: dict[str, Any]) -> list[str]:
    """What is wrong with a result of :func:`random_run` (empty: every request served in full)."""
    out = []
    if result["failed"] != 0:
        errors = [e for e in result.get("errors") or [] if e]
        out.append(f"failed {result['failed']}: {errors[0][-600:] if errors else '?'}")
    if result["completed"] != PROMPTS:
        out.append(f"completed {result['completed']} of {PROMPTS}")
    if result["total_output_tokens"] != PROMPTS * OUTPUT_LEN:
        out.append(f"output tokens {result['total_output_tokens']}, want {PROMPTS * OUTPUT_LEN}")
    if result.get("output_lens") != [OUTPUT_LEN] * PROMPTS:
        out.append(f"per-request output tokens {result.get('output_lens')}")
    return out


def test_vllm_benchmark_client_through_up(stack, model, tmp_path):
    stats_before = httpx.get(f"{stack.url}/stats", timeout=10).json()
    result = run_client(random_run(stack.url, model, tmp_path / "up.json"), tmp_path / "client.log")
    print(f"vllm bench serve through up: {result['completed']} completed, {result['failed']} failed, "
          f"{result['total_output_tokens']} output tokens, TTFT p50 {result['median_ttft_ms']:.0f} ms, "
          f"TPOT p50 {result['median_tpot_ms']:.1f} ms")
    assert not problems(result), f"{problems(result)}; proxy log {stack.work / 'proxy.log'}"
    # Streamed: every request's first token, then one gap per further token, each its own SSE event.
    assert all(t > 0 for t in result["ttfts"]), result["ttfts"]
    assert [len(itl) for itl in result["itls"]] == [OUTPUT_LEN - 1] * PROMPTS
    # And through the proxy: each request went through its prefill-then-decode path.
    stats = httpx.get(f"{stack.url}/stats", timeout=10).json()
    assert stats["requests"] - stats_before["requests"] == PROMPTS, stats


def test_control_client_where_nothing_listens_reports_failures(model, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    result = run_client(random_run(dead, model, tmp_path / "dead.json"), tmp_path / "client.log")
    assert result["completed"] == 0 and result["failed"] == PROMPTS, result
    assert problems(result)
    assert any("Cannot connect" in (e or "") for e in result["errors"]), result["errors"]
