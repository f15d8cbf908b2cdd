"""Every example that runs on one machine runs here, as a user runs it, on the small generated model.

The controls: a first request or run computes (0 cached tokens) and gives the tokens every later
one must give; a request served from the cache reports its tokens cached *and* gives those tokens.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
LINE = re.compile(r"prompt=(\d+) cached=(\d+) text=(.*)$")


def run_example(argv: list[str], model: Path, timeout: int = 600) -> str:
    # A short temp folder: vLLM's own IPC sockets live in it, and a Unix socket path has
    # at most 107 characters (pytest's tmp_path is too long for that).
    tmp = Path(tempfile.mkdtemp(prefix="lmcm-ex-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MODEL": str(model), "TMPDIR": str(tmp), "PY": sys.executable}
    try:
        out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:  # the shell examples keep their logs when they fail
            logs = "".join(f"\n--- {p}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(tmp.rglob("*.log")))
            pytest.fail(f"{argv}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}{logs}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out.stdout


def completions(stdout: str) -> dict[str, tuple[int, int, str]]:
    """``{label: (prompt tokens, cached tokens, text)}`` of the lines the shell examples print."""
    out = {}
    for line in stdout.splitlines():
        m = LINE.search(line)
        if m:
            out[line.split(":")[0].strip()] = (int(m.group(1)), int(m.group(2)), m.group(3))
    return out


@pytest.fixture(scope="module")
def kv_both(model) -> dict[str, tuple[int, int, str]]:
    return completions(run_example(["bash", "examples/kv_both.sh"], model))


def test_kv_both_server_serves_a_repeat_from_the_connector(kv_both):
    prompt, cached, text = kv_both["first request"]
    assert prompt > 256 and cached == 0  # computed: vLLM's own prefix cache is off
    again = kv_both["same again"]
    assert again[1] >= prompt - 1 and again[2] == text


def test_pd_on_one_host_loads_the_prefill_instances_chunks(model, kv_both):
    stdout = run_example(["bash", "examples/pd_one_host.sh"], model)
    prompt, cached, text = completions(stdout)["through the proxy"]
    # The decode instance loaded all but the last token and gives the tokens a recompute gave.
    assert prompt == kv_both["first request"][0] and cached >= prompt - 1
    assert text == kv_both["first request"][2]


def test_offline_python_api_reloads_from_disk_with_the_same_output(model):
    stdout = run_example([sys.executable, "examples/offline_kv_both.py", str(model)], model)
    runs = {run: (int(prompt), int(cached), ast.literal_eval(output)) for run, prompt, cached, output in
            re.findall(r"run (\d): (\d+) prompt tokens, (\d+) cached, output (\[.*\])", stdout)}
    assert set(runs) == {"1", "2"}, stdout
    (prompt, cached1, out1), (_, cached2, out2) = runs["1"], runs["2"]
    assert cached1 == 0 and cached2 >= prompt - 1  # the second LLM, a fresh process, loaded from disk
    assert out1 == out2


def test_warmup_example_fills_the_store_and_a_second_run_writes_nothing(model):
    stdout = run_example([sys.executable, "examples/warmup.py", str(model)], model)
    summaries = re.findall(r"wrote (\d+) chunks", stdout)
    assert int(summaries[0]) > 0, stdout
    assert "0 failed, 0 bad" in stdout
