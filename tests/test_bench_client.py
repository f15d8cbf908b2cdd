"""testing/bench_client.py without vLLM: its command line and the per-SLO goodput it computes
from vLLM's detailed result (the end-to-end run is tests/test_e2e_serving_client.py)."""

from __future__ import annotations

from pathlib import Path

from lmcache_mooncake.testing.bench_client import ClientRun, client_command, goodput_per_slo


def test_command_is_vllms_serve_arguments():
    run = ClientRun("http://127.0.0.1:9000", "/m", ["--dataset-name", "random"], 8, Path("/r/out.json"),
                    request_rate=2.0, goodput_ms={"ttft": 500, "tpot": 50})
    cmd = client_command(run)
    assert cmd[1:3] == ["-m", "lmcache_mooncake.testing.bench_client"]
    joined = " ".join(cmd)
    for part in ("--base-url http://127.0.0.1:9000", "--num-prompts 8", "--result-dir /r",
                 "--result-filename out.json", "--request-rate 2.0", "--goodput ttft:500 tpot:50", "--ignore-eos",
                 "--save-detailed"):
        assert part in joined, part
    assert "--request-rate" not in client_command(ClientRun("u", "/m", [], 1, Path("/r/x.json")))


def test_goodput_per_slo_counts_each_slo_alone_and_skips_failed_requests():
    # Request 0: TTFT 0.2 s, 3 tokens, TPOT (0.1 + 0.3) / 2 = 0.2 s; request 1: TTFT 0.9 s, TPOT 0.01 s;
    # request 2 failed (TTFT 0, no tokens).
    result = {"duration": 2.0, "ttfts": [0.2, 0.9, 0.0], "itls": [[0.1, 0.3], [0.01], []], "output_lens": [3, 2, 0]}
    got = goodput_per_slo(result, {"ttft": 500, "tpot": 50, "e2el": 1000})
    assert got == {"ttft": 0.5, "tpot": 0.5, "e2el": 1.0}
