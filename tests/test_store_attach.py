"""The Mooncake tier's attachment to a store that is missing at start-up (real store, no vLLM).

Runs in a child process, as a vLLM worker would hold the client.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed"
)

CHILD = r"""
import functools, logging, sys, time
from pathlib import Path
from lmcache_mooncake.config import MooncakeConfig
from lmcache_mooncake.engine import store_endpoint
from lmcache_mooncake.store.client import StoreClient
from lmcache_mooncake.store.launcher import StoreSpec, free_port, start_store, stop_store
from lmcache_mooncake.tiers.attach import StoreAttachment

warnings = []
class Grab(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING and record.name.endswith("attach"):
            warnings.append(record.getMessage())
logging.getLogger("lmcache_mooncake.tiers.attach").addHandler(Grab())
tmp = Path(sys.argv[1])

def factory(mc):
    return lambda ep: StoreClient.from_config(mc, ep, require=False, local_buffer_bytes=4 << 20,
                                              retry_interval_s=0.2, max_retry_interval_s=0.5)

def wait_usable(att, deadline_s=30.0):
    t = time.monotonic()
    while True:
        c = att.client()
        if c is not None and c.batch_put(["k"], [b"value"]) == [0] and c.batch_exists(["k"]) == [True]:
            return time.monotonic() - t
        assert time.monotonic() - t < deadline_s, att.stats()
        time.sleep(0.1)

def never_blocks(att, n=20):
    for _ in range(n):
        t = time.monotonic()
        c = att.client()
        if c is not None:
            assert c.batch_exists(["k"]) == [False]
        assert time.monotonic() - t < 0.6, time.monotonic() - t

# 1. auto, nothing recorded: one warning naming the state folder, misses, then attach on `store up`.
sd = tmp / "auto-store"
mc = MooncakeConfig(store_dir=str(sd), timeout=1.0)
att = StoreAttachment(mc, functools.partial(store_endpoint, mc), factory(mc), retry_s=0.2, max_retry_s=0.5)
assert att.client() is None and att.endpoint is None
never_blocks(att)
assert len(warnings) == 1 and str(sd) in warnings[0] and "store up" in warnings[0], warnings
start_store(StoreSpec(memory_bytes=64 << 20, state_dir=sd))
try:
    took = wait_usable(att)
    print(f"auto attached after {took:.2f} s")
    assert att.stats()["attached"] == 1 and att.endpoint.mode == "shm"
finally:
    stop_store(sd)
    att.close()

# 2. explicit addresses, nothing listening: one warning naming the address, misses, then reconnect.
warnings.clear()
ports = dict(master_port=free_port(), metadata_port=free_port(), metrics_port=free_port(), client_port=free_port())
mc = MooncakeConfig(master_address=f"127.0.0.1:{ports['master_port']}",
                    metadata_server=f"http://127.0.0.1:{ports['metadata_port']}/metadata", timeout=1.0)
t = time.monotonic()
att = StoreAttachment(mc, functools.partial(store_endpoint, mc), factory(mc), retry_s=0.2, max_retry_s=0.5)
assert time.monotonic() - t < 2.0
assert att.client() is not None and not att.client().healthy
never_blocks(att)
assert len(warnings) == 1 and mc.master_address in warnings[0], warnings
sd = tmp / "explicit-store"
start_store(StoreSpec(memory_bytes=64 << 20, state_dir=sd, **ports))
try:
    took = wait_usable(att)
    print(f"explicit reconnected after {took:.2f} s")
    assert att.stats()["reconnects"] >= 1
finally:
    stop_store(sd)
    att.close()
print("OK")
"""


def test_missing_store_is_a_miss_then_attaches(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                       cwd=REPO, timeout=180)
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-4000:]
