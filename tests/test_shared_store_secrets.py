"""Instances with different chunk auth secrets share one Mooncake store or disk folder (no vLLM).

Object names do not depend on the secret, so each instance meets the other's
chunks. Neither may delete them: a chunk another secret sealed fails this
instance's check (a miss) but is good for its writer. Only a chunk damaged
under an instance's own secret is removed. Run in a child process, with
LMCache's engine as a vLLM worker builds it, once over shared memory (the
staged read path) and once over TCP (reads straight into LMCache's buffers).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed"
)

CHILD = r"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[2])
from engine_checks import NS, N, make_kv

from lmcache_mooncake import engine
from lmcache_mooncake.chunks import keys
from lmcache_mooncake.config import CacheConfig, MooncakeConfig
from lmcache_mooncake.kv import layouts, paged_copy
from lmcache_mooncake.store.client import StoreClient
from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store

tmp, mode = Path(sys.argv[1]), sys.argv[3]
kv = make_kv()
slots = torch.arange(600)
rc = engine.request_configs(None, None)
layout = layouts.layout_for_backend("CPU_ATTN")
secrets = {None: None}
for who in ("a", "b"):
    secrets[who] = tmp / f"secret-{who}"
    secrets[who].write_text(f"{who}-shared-secret-of-enough-bytes\n")
prompts = {who: torch.arange(600) % 1000 + 10 * i + 3 for i, who in enumerate(("a", "b"))}
names = {who: keys.object_names(NS, p.tolist()) for who, p in prompts.items()}
runs = iter(range(100))


def instance(who):
    # A fresh engine each time, so nothing is served from its CPU tier.
    mc = MooncakeConfig(store_dir=str(tmp / "store"), mode=mode, timeout=5.0, put_timeout=10.0,
                        local_buffer_size=32 << 20)
    cfg = CacheConfig(max_local_cpu_size=0.05, chunk_auth_key_file=None if who is None else str(secrets[who]),
                      mooncake=mc)
    name = f"{who}-{next(runs)}"
    return engine.build_engine(cfg, NS, layout, torch.float32, name), name


def write(who):
    eng, name = instance(who)
    try:
        eng.store(prompts[who], mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
        assert engine.drain(eng, 30)
        assert engine.context(eng).stats.snapshot().get("store_puts") == 3
    finally:
        engine.close_engine(eng, name)


def read(who, whose):
    # (tokens loaded, the engine's counters); the loaded KV must equal what was stored.
    eng, name = instance(who)
    try:
        assert eng.lookup(tokens=prompts[whose], request_configs=rc) == 600  # the store has the objects
        out = [torch.zeros_like(t) for t in kv]
        ret = eng.retrieve(prompts[whose], mask=None, kvcaches=out, slot_mapping=slots, request_configs=rc)
        got = int(ret.sum())
        # Slots 0.. are whole paged blocks in order: the blocks the load filled hold what was stored.
        full = got // N
        assert all(torch.equal(o[:full], k[:full]) for o, k in zip(out, kv)), (who, whose)
        assert all(not o[-(-got // N):].any() for o in out), (who, whose)
        return got, engine.context(eng).stats.snapshot()
    finally:
        engine.close_engine(eng, name)


def in_store(who):
    with StoreClient.from_state(tmp / "store", timeout_s=5.0, local_buffer_bytes=8 << 20) as c:
        return c.batch_exists(names[who])


start_store(StoreSpec(memory_bytes=256 << 20, state_dir=tmp / "store"))
try:
    write("a")
    write("b")
    assert in_store("a") == in_store("b") == [True] * 3
    # Each reads the other's chunks (and a reader without a secret reads a's): misses, none removed.
    for reader, whose in (("b", "a"), ("a", "b"), (None, "a")):
        got, stats = read(reader, whose)
        assert got == 0, (reader, whose, got)
        assert stats.get("store_verify_failures") == stats.get("store_foreign_kept") >= 1, stats
        assert stats.get("store_bad_removed", 0) == 0, stats
        assert in_store(whose) == [True] * 3, (reader, whose)
    # Each still hits its own, bit-exact.
    for who in ("a", "b"):
        got, stats = read(who, who)
        assert got == 600 and stats.get("store_hits") == 3 and not stats.get("store_verify_failures"), stats
    print(mode, "each kept the other's chunks and hit its own")

    # The control: a chunk damaged under a's own secret is removed by a (and kept by b).
    victim = names["a"][1]
    with StoreClient.from_state(tmp / "store", timeout_s=5.0, local_buffer_bytes=8 << 20) as c:
        buf = bytearray(4 << 20)
        (n,) = c.batch_get_into([victim], [buf])
        assert n > 0, n
        damaged = bytearray(buf[:n])
        damaged[-100] ^= 0xFF
        assert c.batch_remove([victim], force=True) == [0]
        assert c.batch_put([victim], [bytes(damaged)]) == [0]
    got, stats = read("b", "a")
    assert got == 0 and stats.get("store_bad_removed", 0) == 0 and in_store("a") == [True] * 3, stats
    got, stats = read("a", "a")
    assert got == 256, got
    assert stats.get("store_bad_removed") == 1 and not stats.get("store_foreign_kept"), stats
    assert in_store("a") == [True, False, True]
    print(mode, "a removed the chunk damaged under its own secret")
finally:
    stop_store(tmp / "store")
print("OK")
"""


@pytest.mark.parametrize("mode", ["auto", "tcp"])
def test_instances_with_different_secrets_keep_each_others_chunks(tmp_path, mode):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(HERE), mode], capture_output=True,
                       text=True, cwd=HERE.parent, timeout=300)
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-5000:]


CHILD_DISK = r"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[2])
from engine_checks import make_engine, make_kv, store_and_close

from lmcache_mooncake import engine

tmp = Path(sys.argv[1])
kv, tokens, slots, rc = make_kv(), torch.arange(600) + 5, torch.arange(600), engine.request_configs(None, None)
secrets = {}
for who in ("a", "b"):
    secrets[who] = tmp / f"secret-{who}"
    secrets[who].write_text(f"{who}-shared-secret-of-enough-bytes\n")
disk = tmp / "disk"
store_and_close(disk, kv, tokens, slots, rc, secret_file=secrets["a"])
files = sorted(disk.glob("*/*.lmcm"))
assert len(files) == 3, files


def lookup(secret):
    eng, name = make_engine(disk, secret_file=secret)
    try:
        return eng.lookup(tokens=tokens, request_configs=rc), engine.context(eng).stats.snapshot()
    finally:
        engine.close_engine(eng, name)


for secret in (secrets["b"], None):
    hit, stats = lookup(secret)
    assert hit == 0 and stats.get("disk_foreign_kept") == stats.get("disk_verify_failures") >= 1, stats
    assert all(p.exists() for p in files)
hit, stats = lookup(secrets["a"])
assert hit == 600 and not stats.get("disk_verify_failures"), stats
print("OK")
"""


def test_a_shared_disk_folder_keeps_chunks_another_secret_sealed(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD_DISK, str(tmp_path), str(HERE)], capture_output=True,
                       text=True, cwd=HERE.parent, timeout=300)
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-5000:]
