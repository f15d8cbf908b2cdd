"""Command-line options of the test suite, and the fixtures most modules share.

A module that needs another model or store defines its own ``model`` or
``store`` fixture, which then wins over these.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
from lmcache_mooncake.testing.models import ModelSpec, build_model

# Offline vLLM runs (testing.offline) keep vLLM's engine and worker in one process: each
# process start imports vLLM again (about 14 s on two cores), and the suite starts dozens.
# Served instances (vllm serve) keep vLLM's three processes. 0 runs the offline ones that way too.
os.environ.setdefault("LMCACHE_MOONCAKE_VLLM_IN_PROCESS", "1")


def pytest_addoption(parser) -> None:
    parser.addoption("--soak-minutes", type=float, default=1.0,
                     help="minutes of load in tests/test_soak.py (default 1: the short run of make test)")


@pytest.fixture(scope="module")
def model() -> Path:
    """The tiny generated Llama most tests run (built once, then read from its cache folder)."""
    return build_model(ModelSpec(arch="llama", size="tiny", seed=0))


@pytest.fixture(scope="module")
def store(work: Path):
    """A 256 MiB Mooncake store for the module, its state in the module's own ``work`` folder."""
    sd = work / "store"
    start_store(StoreSpec(memory_bytes=256 << 20, state_dir=sd))
    yield sd
    stop_store(sd)
