"""glibc malloc settings for the vLLM children: when they are set, and that they stop the re-faulting."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from lmcache_mooncake.runtime import malloc_env as me
from lmcache_mooncake.testing.offline import vllm_env

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc's malloc only")

# Allocate, write and free an 80 MiB block (a test-model MLP activation of a 4,096-token step)
# 20 times; print the page faults of the last 19.
FAULTS = """
import json, resource
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = bytearray(80 << 20); del b
f0 = faults()
for _ in range(19):
    b = bytearray(80 << 20); b[::4096] = b"x" * len(b[::4096]); del b
print(json.dumps(faults() - f0))
"""


def child_faults(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@glibc
def test_the_tunables_keep_freed_blocks_in_the_heap(monkeypatch):
    monkeypatch.setattr(me, "vllm_bundles_tcmalloc", lambda: False)
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
            and not (k.startswith("MALLOC_") and k.endswith("_"))}
    tuned = dict(base, **me.malloc_env(base))
    assert "glibc.malloc.mmap_threshold" in tuned["GLIBC_TUNABLES"]
    plain, kept = child_faults(base), child_faults(tuned)
    # glibc's default: mapped and faulted again each time (19 x 20,480 pages); tuned: reused.
    assert plain > 19 * 15_000, plain
    assert kept < 2_000, kept


@glibc
def test_other_tunables_are_kept_and_ours_appended(monkeypatch):
    monkeypatch.setattr(me, "vllm_bundles_tcmalloc", lambda: False)
    got = me.malloc_env({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})["GLIBC_TUNABLES"]
    assert got.startswith("glibc.pthread.rseq=0:glibc.malloc.mmap_threshold=")


@pytest.mark.parametrize("env", [
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
    {"LD_PRELOAD": "/opt/libjemalloc.so.2"},
    {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
    {"MALLOC_TRIM_THRESHOLD_": "0"},
    {"LMCACHE_MOONCAKE_MALLOC": "default"},
])
def test_a_choice_already_made_is_left_alone(env, monkeypatch):
    monkeypatch.setattr(me, "vllm_bundles_tcmalloc", lambda: False)
    assert me.malloc_env(env) == {}


def test_nothing_when_vllm_preloads_its_own_tcmalloc(monkeypatch):
    monkeypatch.setattr(me, "vllm_bundles_tcmalloc", lambda: True)
    assert me.malloc_env({}) == {}


@glibc
def test_vllm_children_get_it_and_a_user_setting_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(me, "vllm_bundles_tcmalloc", lambda: False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LMCACHE_MOONCAKE_MALLOC", raising=False)
    assert "glibc.malloc.trim_threshold" in vllm_env(tmp_path / "a")["GLIBC_TUNABLES"]
    assert "GLIBC_TUNABLES" not in vllm_env(tmp_path / "b", {"LMCACHE_MOONCAKE_MALLOC": "default"})


@glibc
def test_serve_runs_vllm_with_it_and_prints_it(monkeypatch):
    """``serve --print-command`` shows the environment serve adds; the opt-out removes it."""
    if me.vllm_bundles_tcmalloc():
        pytest.skip("this vLLM preloads its own tcmalloc")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    cmd = [sys.executable, "-m", "lmcache_mooncake.cli", "serve", "--role", "both", "--model", "m", "--print-command"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, env=env, check=True).stdout
    assert out.startswith("GLIBC_TUNABLES=glibc.malloc.mmap_threshold=")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, check=True,
                         env=dict(env, LMCACHE_MOONCAKE_MALLOC="default")).stdout
    assert "GLIBC_TUNABLES" not in out and " -m vllm.entrypoints.openai.api_server " in out
