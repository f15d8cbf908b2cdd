"""Direct gets from the store: chunks land in LMCache's buffer, one copy fewer (real store, no vLLM).

Each check runs in a fresh process (LMCache's engine keeps process-wide state),
against one real store per module: the master and a storage process on
loopback. Copies are counted where they happen: ``chunk_format.decode_into``
is the copy out of the client's staging region, so the check wraps it.
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
import os, signal, sys, time
import torch
from lmcache_mooncake import engine
from lmcache_mooncake.chunks import chunk_format
from lmcache_mooncake.kv import layouts, paged_copy
from lmcache_mooncake.config import CacheConfig, MooncakeConfig
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.store.launcher import read_state

check, sd = sys.argv[1], sys.argv[2]
L, H, D, N, B = 2, 2, 64, 16, 96
NS = KeyNamespace("direct-" + check, "float32", L, H, D, 256)
TOKENS = 1000  # 3 full chunks and a 232-token tail
staged_copies = [0]
_decode_into = chunk_format.decode_into
def counted(*args, **kwargs):
    staged_copies[0] += 1
    return _decode_into(*args, **kwargs)
chunk_format.decode_into = counted

def make(mode, name, timeout=5.0):
    mc = MooncakeConfig(store_dir=sd, mode=mode, timeout=timeout, local_buffer_size=16 << 20)
    cfg = CacheConfig(max_local_cpu_size=0.05, mooncake=mc)
    return engine.build_engine(cfg, NS, layouts.layout_for_backend("CPU_ATTN"), torch.float32, name)

torch.manual_seed(0)
kv = [torch.randn(B, H, N, 2 * D) for _ in range(L)]
tokens = torch.arange(TOKENS) + 5
slots = torch.randperm(B * N)[:TOKENS]
rc = engine.request_configs(None, None)
writer = make("tcp", "writer")
writer.store(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
assert engine.drain(writer, 30)
engine.close_engine(writer, "writer")
layout = layouts.layout_for_backend("CPU_ATTN")

def load(eng):
    out = [torch.zeros_like(t) for t in kv]
    hit = eng.lookup(tokens=tokens, request_configs=rc)
    ret = eng.retrieve(tokens, mask=None, kvcaches=out, slot_mapping=slots, request_configs=rc)
    got = torch.empty(2, L, TOKENS, H * D)
    want = torch.empty(2, L, TOKENS, H * D)
    paged_copy.gather_chunk(layout, out, slots, got)
    paged_copy.gather_chunk(layout, kv, slots, want)
    n = int(ret.sum())
    return hit, n, torch.equal(got[:, :, :n], want[:, :, :n])

def counters(name):
    return engine.context(name).stats.snapshot()

if check == "direct_and_staged":
    for mode in ("tcp", "shm"):
        staged_copies[0] = 0
        eng = make(mode, mode)
        try:
            assert load(eng) == (TOKENS, TOKENS, True), (mode, load(eng))
            c = counters(mode)
        finally:
            engine.close_engine(eng, mode)
        if mode == "tcp":  # full chunks straight into LMCache's buffer; the short tail through staging
            assert (c.get("store_direct_reads"), c.get("store_staged_reads"), staged_copies[0]) == (3, 1, 1), c
        else:  # Mooncake's dummy client writes only into the storage process's pool
            assert (c.get("store_direct_reads", 0), c.get("store_staged_reads"), staged_copies[0]) == (0, 4, 4), c
        print(mode, "direct", c.get("store_direct_reads", 0), "staged", c.get("store_staged_reads"),
              "copies out of staging", staged_copies[0])

elif check == "damaged":
    from lmcache_mooncake.store.client import StoreClient
    from lmcache_mooncake.tiers.mooncake import object_name
    eng = make("tcp", "reader")
    try:
        keys = [k for _, _, k in eng.token_database.process_tokens(tokens=tokens, request_configs=rc)]
        name = object_name(keys[1])  # a full chunk: read directly
        with StoreClient.from_state(sd, timeout_s=5.0, local_buffer_bytes=4 << 20) as c:
            size = c.batch_object_sizes([name])[0]
            buf = bytearray(size)
            assert c.batch_get_into([name], [buf]) == [size]
            buf[-5] ^= 0xFF  # one flipped byte in the payload: same size, so the direct path reads it
            assert c.batch_remove([name], force=True) == [0]
            assert c.batch_put([name], [bytes(buf)]) == [0]
        hit, n, equal = load(eng)
        c = counters("reader")
        assert (hit, n, equal) == (TOKENS, 256, True), (hit, n, equal)  # the prefix before it, bit-exact
        assert c["store_verify_failures"] == 1 and c["store_bad_removed"] == 1, c
        # One batched get: chunks 0 and 2 direct, 1 failed its check there, the tail staged.
        assert (c.get("store_direct_reads"), c.get("store_staged_reads")) == (2, 1), c
        print("damaged chunk: a miss, removed; loaded", n, "tokens before it")
    finally:
        engine.close_engine(eng, "reader")

elif check == "timeout":
    import gc
    from lmcache_mooncake.tiers.mooncake import MooncakeTierConnector
    storage = read_state(sd).client_pid
    eng = make("tcp", "reader", timeout=1.0)
    try:
        cpu = eng.storage_manager.storage_backends["LocalCPUBackend"]
        os.kill(storage, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            hit, n, _ = load(eng)
            took = time.monotonic() - t0
        finally:
            os.kill(storage, signal.SIGCONT)
        c = counters("reader")
        assert n == 0 and took < 10, (hit, n, took)
        assert c["store_quarantined_chunks"] == 3, c  # the full chunks' buffers, given up
        assert c["store_quarantined_bytes"] == 3 * 2 * L * 256 * H * D * 4, c
        # The tier LMCache built (it is reachable only through LMCache's internals).
        (tier,) = [o for o in gc.get_objects()
                   if isinstance(o, MooncakeTierConnector) and o.ctx.instance_id == "reader"]
        quarantined = [(o.tensor.data_ptr(), o.tensor.data_ptr() + o.tensor.numel() * 4)
                       for o in tier._quarantine._held]
        assert len(quarantined) == 3, quarantined
        # Later gets work once the storage process runs again (the client reconnects by itself),
        # and none of their buffers is one of the quarantined ones.
        deadline = time.monotonic() + 30
        while True:
            hit, n, equal = load(eng)
            if n == TOKENS or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (n, equal) == (TOKENS, True), (hit, n, equal, counters("reader"))
        # Take every buffer LMCache's allocator can still hand out: none is a quarantined one.
        from lmcache.v1.memory_management import MemoryFormat
        taken = []
        while True:
            obj = cpu.allocate([torch.Size([2, L, 256, H * D])], [torch.float32], MemoryFormat.KV_2LTD,
                               eviction=True, busy_loop=False)
            if obj is None:
                break
            taken.append(obj)
        assert len(taken) > 50, len(taken)  # nearly the whole 51 MiB pool
        for obj in taken:
            p = obj.tensor.data_ptr()
            assert not any(lo <= p < hi for lo, hi in quarantined), "a quarantined buffer was handed out again"
            obj.ref_count_down()
        print("timed-out get: 3 buffers quarantined,", n, "tokens loaded after SIGCONT, in", round(took, 2), "s")
    finally:
        engine.close_engine(eng, "reader")
elif check == "worker_shm":
    # A worker's load in shm mode, chunks in the "blocks" layout: each chunk goes from the
    # staging region, where it is checked, straight into paged KV (connector/direct.py); none
    # is copied into an LMCache buffer first. Then a damaged chunk stops the load there.
    from lmcache_mooncake.connector import worker
    from lmcache_mooncake.connector.direct import DirectLoader
    from lmcache_mooncake.connector.metadata import LoadOp
    from lmcache_mooncake.store.client import StoreClient
    from lmcache_mooncake.tiers.mooncake import object_name
    from pathlib import Path
    NB = KeyNamespace("direct-worker-shm", "float32", L, H, D, 256, chunk_layout="blocks")
    block_ids = torch.randperm(B)[: -(-TOKENS // N)].tolist()
    bslots = [b * N + i for b in block_ids for i in range(N)][:TOKENS]
    mc = MooncakeConfig(store_dir=sd, mode="tcp", timeout=5.0, local_buffer_size=16 << 20)
    w = engine.build_engine(CacheConfig(max_local_cpu_size=0.05, mooncake=mc), NB, layout, torch.float32, "wb")
    w.store(tokens, mask=None, kvcaches=kv, slot_mapping=torch.tensor(bslots), request_configs=rc)
    assert engine.drain(w, 30)
    engine.close_engine(w, "wb")

    def worker_load(name, skip, end):
        cfg = CacheConfig(max_local_cpu_size=0.05, mooncake=MooncakeConfig(store_dir=sd, mode="shm", timeout=5.0,
                                                                          local_buffer_size=16 << 20))
        run = Path(sd) / name
        run.mkdir()
        side = worker.WorkerSide(cfg, "m", "CPU_ATTN", N, run, run / "lookup.sock", name, 0, 1)
        out = [torch.full_like(t, 7.0) for t in kv]
        side.kv_caches, side.namespace = out, NB
        side.engine = engine.build_engine(cfg, NB, layout, torch.float32, name)
        try:
            side._direct = DirectLoader.for_engine(side.engine)
            chunks = list(side.engine.token_database.process_tokens(tokens, request_configs=rc))
            assert [(k, len(r)) for k, r in side._direct.segments(chunks, out)] == [("store", 4)]
            failed = side._load(LoadOp("r", tokens.tolist(), bslots[:end], skip, end, block_ids))
            return out, failed, side.stats.snapshot(), chunks
        finally:
            side.shutdown()

    staged_copies[0] = 0
    out, failed, c, chunks = worker_load("ws1", N, TOKENS - 1)
    assert failed == set() and c["loaded_tokens"] == TOKENS - 1 - N, (failed, c)
    assert (c.get("store_staged_reads"), c.get("store_direct_reads", 0), staged_copies[0]) == (4, 0, 0), c
    got = torch.empty(2, L, TOKENS, H * D)
    want = torch.empty(2, L, TOKENS, H * D)
    paged_copy.gather_chunk(layout, out, torch.tensor(bslots), got)
    paged_copy.gather_chunk(layout, kv, torch.tensor(bslots), want)
    assert torch.equal(got[:, :, N:TOKENS - 1], want[:, :, N:TOKENS - 1])
    assert (got[:, :, :N] == 7).all() and (got[:, :, TOKENS - 1:] == 7).all()

    name = object_name(chunks[2][2])
    with StoreClient.from_state(sd, timeout_s=5.0, local_buffer_bytes=4 << 20) as cl:
        size = cl.batch_object_sizes([name])[0]
        buf = bytearray(size)
        assert cl.batch_get_into([name], [buf]) == [size]
        buf[-5] ^= 0xFF
        assert cl.batch_remove([name], force=True) == [0]
        assert cl.batch_put([name], [bytes(buf)]) == [0]
    out, failed, c, _ = worker_load("ws2", 0, TOKENS - 1)
    assert failed == set(block_ids[512 // N : -(-(TOKENS - 1) // N)]), failed
    assert c["store_verify_failures"] == 1 and c["store_bad_removed"] == 1 and c["loaded_tokens"] == 512, c
    print("worker shm load: 4 chunks from staging into paged KV, none copied out of staging first")
print("OK")
"""


def run_check(name: str, store: Path) -> str:
    p = subprocess.run([sys.executable, "-c", CHILD, name, str(store)], capture_output=True, text=True,
                       cwd=REPO, timeout=180)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("direct")


def test_tcp_loads_full_chunks_directly_and_shm_through_staging(store):
    """Both paths load bit-exact; tcp copies only the short tail out of staging, shm every chunk."""
    print(run_check("direct_and_staged", store))


def test_damaged_chunk_read_directly_is_a_miss_and_removed(store):
    print(run_check("damaged", store))


def test_a_worker_in_shm_mode_copies_staged_chunks_straight_into_paged_kv(store):
    print(run_check("worker_shm", store))


@pytest.mark.faults
def test_timed_out_direct_get_quarantines_its_buffers(store):
    """The storage process paused mid-load: the load is a miss within the timeout, its buffers
    are never reused, and after SIGCONT the same engine loads bit-exact again."""
    print(run_check("timeout", store))
