"""Races on one key: two writers at once, a reader racing them (real store, real disk tier, no vLLM).

Each writer stores a *different* valid chunk under the same keys (content
keys make the two equal in real use; here a torn or mixed object would
show). Whatever a reader gets while they race must be nothing, or one
writer's whole chunk that passes its check: never a mix, never a part (a
store object whose put never completed reads as an error, never as bytes).
Writers and the reader are separate processes, started together.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.faults

L, H, D, T = 2, 2, 64, 256  # a chunk of 256 tokens: 2 x 2 x 256 x 128 float32, 512 KiB
KEYS = 24
ROUNDS = 6

CHILD = r"""
import sys, time
from pathlib import Path
import torch
from lmcache_mooncake.chunks import chunk_format

role, kind, where, go = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
L, H, D, T, KEYS, ROUNDS = %(dims)s

def chunk(writer):
    return torch.full((2, L, T, H * D), float(writer + 1))

def key_string(r, i):
    return f"race-{r}-{i}"

if kind == "store":
    from lmcache_mooncake.store.client import NOT_FOUND, StoreClient
    client = StoreClient.from_state(where, timeout_s=5.0, local_buffer_bytes=8 << 20)
    def write(r, i, data):
        assert client.batch_put([key_string(r, i)], [data]) == [0]
    def read(r, i):
        buf = bytearray(1 << 20)
        (n,) = client.batch_get_into([key_string(r, i)], [buf])
        if n == NOT_FOUND:
            return None
        if n < 0:  # e.g. -703 REPLICA_IS_NOT_READY: a put that never completed; no bytes at all
            return n
        return bytes(buf[:n])
else:
    import os, threading
    from lmcache_mooncake.tiers.disk import DiskTierConnector, DiskTierSettings, PLUGIN_NAME
    from lmcache_mooncake.tiers.base import engine_context
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from types import SimpleNamespace
    NS = "ab" * 32
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=T, local_cpu=False, max_local_cpu_size=0.05,
                                            lmcache_instance_id="race-" + role)
    meta = LMCacheMetadata(model_name=NS, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float32, kv_shape=(L, 2, T, H, D), chunk_size=T, role="worker")
    engine_context("race-" + role).tier_settings[PLUGIN_NAME] = DiskTierSettings(Path(where), 1 << 30, True)
    tier = DiskTierConnector(None, SimpleNamespace(config=cfg, metadata=meta), cfg)
    def cache_key(r, i):
        return CacheEngineKey(NS, 1, 0, r * 1000 + i + 1, torch.float32)
    def key_string(r, i):
        return cache_key(r, i).to_string()
    def write(r, i, data):
        tier._put_one(cache_key(r, i), SimpleNamespace(tensor=data))
    def read(r, i):
        try:
            return (tier._path(cache_key(r, i))).read_bytes()
        except FileNotFoundError:
            return None

print("READY", flush=True)  # imported and connected; the parent then names the start time
while not go.exists():
    time.sleep(0.005)
start_at = float(go.read_text())
while time.time() < start_at:
    time.sleep(0.001)
if role in ("0", "1"):
    data = chunk(int(role))
    passes = 0
    while passes == 0 or time.time() < start_at + 5:  # rewrite for 5 s: the disk tier replaces files
        for r in range(ROUNDS):
            for i in range(KEYS):
                write(r, i, data if kind == "disk" else chunk_format.encode(key_string(r, i), data))
        passes += 1
    print("OK wrote", passes)
elif role == "check":  # one pass after a writer was killed: nothing, or a whole valid chunk
    seen = {"none": 0, "0": 0, "1": 0, "unreadable": 0}
    for r in range(ROUNDS):
        for i in range(KEYS):
            data = read(r, i)
            if data is None:
                seen["none"] += 1
                continue
            if isinstance(data, int):
                seen["unreadable"] += 1
                continue
            t = chunk_format.decode(data, key_string(r, i))
            assert t.unique().tolist() == [1.0], t.unique().tolist()[:4]
            seen["0"] += 1
    assert seen["0"], seen
    print("OK checked", seen)
else:
    seen = {"none": 0, "0": 0, "1": 0}
    done = False
    while time.time() < start_at + 6 or not done:  # reads while both write, until every key is there
        assert time.time() < start_at + 30, "some keys never appeared"
        done = True
        for r in range(ROUNDS):
            for i in range(KEYS):
                data = read(r, i)
                if data is None or isinstance(data, int):
                    seen["none"] += 1
                    done = False
                    continue
                t = chunk_format.decode(data, key_string(r, i))  # raises on a torn or mixed chunk
                vals = t.unique().tolist()
                assert len(vals) == 1 and vals[0] in (1.0, 2.0), vals[:4]
                seen[str(int(vals[0]) - 1)] += 1
    assert seen["0"] and seen["1"] or kind == "store", seen  # the disk tier replaced files under the reader
    print("OK read", seen)
"""


def start_children(roles: list[str], kind: str, where: Path, go: Path) -> list[subprocess.Popen]:
    """Start one child per role and wait until each has imported and connected (it prints READY)."""
    code = CHILD % {"dims": repr((L, H, D, T, KEYS, ROUNDS))}
    procs = [subprocess.Popen([sys.executable, "-c", code, role, kind, str(where), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for role in roles]
    for p in procs:  # a fixed head start is not enough: imports took 9 s on a slow CI machine
        line = p.stdout.readline()
        while line and line.strip() != "READY":
            line = p.stdout.readline()
        if not line:
            p.wait(timeout=60)
            raise AssertionError(f"a child exited before it was ready: {p.stderr.read()[-3000:]}")
    return procs


def go_at(go: Path, delay: float) -> float:
    """Tell every waiting child to start ``delay`` seconds from now (written atomically)."""
    start_at = time.time() + delay
    tmp = go.with_suffix(".tmp")
    tmp.write_text(repr(start_at))
    tmp.rename(go)
    return start_at


def race(kind: str, where: Path) -> list[str]:
    go = where.parent / f"go-{kind}"
    procs = start_children(["0", "1", "reader"], kind, where, go)
    go_at(go, 0.5)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "OK" in out, out + err[-3000:]
        outs.append(out.strip().splitlines()[-1])
    return outs


@pytest.fixture
def store(tmp_path):
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("Mooncake is not installed")
    sd = tmp_path / "store"
    start_store(StoreSpec(memory_bytes=256 << 20, state_dir=sd))
    yield sd
    stop_store(sd)


def test_two_writers_and_a_reader_on_the_same_store_keys(store):
    print(race("store", store))


def test_two_writers_and_a_reader_on_the_same_disk_chunks(tmp_path):
    print(race("disk", tmp_path / "disk"))


def kill_mid_save(kind: str, where: Path) -> str:
    """SIGKILL a writer 0.2 s into its writes (its first pass, or a rewrite), then read every key once."""
    go = where.parent / f"go-{kind}"
    (writer,) = start_children(["0"], kind, where, go)
    start_at = go_at(go, 0.1)
    time.sleep(max(start_at + 0.2 - time.time(), 0))
    assert writer.poll() is None, "the writer finished before it was killed"
    writer.kill()
    writer.communicate(timeout=30)
    (check,) = start_children(["check"], kind, where, go)  # the go file is there: it starts at once
    out, err = check.communicate(timeout=120)
    assert check.returncode == 0 and "OK" in out, out + err[-3000:]
    return out.strip().splitlines()[-1]


def test_writer_killed_mid_save_leaves_no_partial_store_object(store):
    print(kill_mid_save("store", store))


def test_writer_killed_mid_save_leaves_no_partial_disk_chunk(tmp_path):
    # What a killed writer can leave is its temporary file, never a chunk under a valid name;
    # the next tier that opens the folder removes it. One is planted here (the kill may miss a write).
    ns_dir = tmp_path / "disk" / ("ab" * 32)
    ns_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    planted = ns_dir / f".{'cd' * 32}.lmcm.{int(dead.stdout)}.1234.tmp"
    planted.write_bytes(b"\0" * 1000)
    print(kill_mid_save("disk", tmp_path / "disk"))
    assert not planted.exists()


PUT_CHILD = r"""
import sys
from lmcache_mooncake.store.client import StoreClient
where, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = StoreClient.from_state(where, mode=mode, timeout_s=2.0, local_buffer_bytes=32 << 20)
assert client.batch_put(["stall-warm-" + mode], [b"w" * 4096]) == [0]
print("ready", flush=True)
input()
print("putting", flush=True)
print(client.batch_put([f"stall-{mode}-{i}" for i in range(n)], [bytes([i]) * (1 << 20) for i in range(n)],
                       timeout_s=30.0), flush=True)
"""


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_put_of_a_writer_killed_while_the_store_stalls(store, mode):
    """A writer's put is in flight (the storage process paused), the writer is SIGKILLed, the
    storage process resumed: a put is whole or absent, never partial. Who finishes it differs:
    in ``tcp`` mode the writer moves its own bytes, so its put never completes; in ``shm`` mode
    the storage process moves them from the writer's shared memory, and completes the dead
    writer's put. (A prefill killed mid-save, end to end: ``test_e2e_pd.py``.)"""
    from lmcache_mooncake.store.client import NOT_FOUND, StoreClient
    from lmcache_mooncake.store.launcher import read_state

    n = 12
    names = [f"stall-{mode}-{i}" for i in range(n)]
    storage = read_state(store).client_pid
    writer = subprocess.Popen([sys.executable, "-c", PUT_CHILD, str(store), mode, str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    with StoreClient.from_state(store, timeout_s=2.0, local_buffer_bytes=8 << 20) as checker:
        try:
            assert writer.stdout.readline().strip() == "ready", writer.stderr.read()[-3000:]
            os.kill(storage, signal.SIGSTOP)
            try:
                writer.stdin.write("\n")
                writer.stdin.flush()
                assert writer.stdout.readline().strip() == "putting"
                time.sleep(1.0)
                # tcp: the put began at the master, its bytes wait for the storage process;
                # shm: the put itself waits, unread, for the storage process.
                began = checker.batch_get_into(names[:1], [bytearray(2 << 20)])[0]
                assert began == (-703 if mode == "tcp" else NOT_FOUND), began
                writer.kill()
                writer.communicate(timeout=30)
            finally:
                os.kill(storage, signal.SIGCONT)
        finally:
            writer.kill()
        deadline = time.monotonic() + (3 if mode == "tcp" else 15)
        while time.monotonic() < deadline and not all(checker.batch_exists(names)):
            time.sleep(0.2)
        bufs = [bytearray(2 << 20) for _ in names]
        got = checker.batch_get_into(names, bufs)
    if mode == "tcp":
        assert all(g < 0 for g in got), got  # absent or unreadable: no bytes
    else:
        assert got == [1 << 20] * n, got
        assert all(bytes(b[: 1 << 20]) == bytes([i]) * (1 << 20) for i, b in enumerate(bufs))
