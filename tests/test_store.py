"""The embedded Mooncake store and its client, with real processes.

Each test starts the store it needs on free loopback ports in a tmp folder and
stops it; the fixture checks that every recorded pid is gone afterwards.
Clients run in separate Python processes ("agents", this file run as a
script), driven line by line over stdin/stdout, as vLLM workers would be.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from lmcache_mooncake.store.launcher import (
    StoreError,
    StoreSpec,
    read_state,
    start_store,
    stop_store,
    store_status,
)

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed"
)


def payload(key: str, size: int) -> np.ndarray:
    """Deterministic bytes for a key, so any process can check a read bit-exactly."""
    return np.random.default_rng(zlib.crc32(key.encode())).integers(0, 256, size, dtype=np.uint8)


# --------------------------------------------------------------------------
# Agent: a client process
# --------------------------------------------------------------------------


def agent_main() -> None:
    from lmcache_mooncake.store.client import StoreClient

    client = None

    def reply(obj: dict) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        t0 = time.monotonic()
        try:
            if op == "connect":
                client = StoreClient.from_state(
                    req["state_dir"],
                    mode=req.get("mode", "tcp"),
                    timeout_s=req.get("timeout_s", 5.0),
                    local_buffer_bytes=req.get("local_buffer_bytes", 16 * MiB),
                    retry_interval_s=req.get("retry_interval_s", 0.5),
                    max_retry_interval_s=req.get("max_retry_interval_s", 2.0),
                    pin=req.get("pin", "none"),
                )
                reply({"ok": True, "healthy": client.healthy})
            elif op == "put":
                bufs = [payload(k, req["size"]) for k in req["keys"]]
                t0 = time.monotonic()
                codes = client.batch_put(req["keys"], bufs)
                reply({"codes": codes, "elapsed": time.monotonic() - t0})
            elif op == "get":
                bufs = [np.zeros(req["size"], dtype=np.uint8) for _ in req["keys"]]
                t0 = time.monotonic()
                codes = client.batch_get_into(req["keys"], bufs)
                elapsed = time.monotonic() - t0
                exact = [
                    bool(c == req["size"] and (b == payload(k, req["size"])).all())
                    for k, b, c in zip(req["keys"], bufs, codes, strict=True)
                ]
                reply({"codes": codes, "exact": exact, "elapsed": elapsed})
            elif op == "put_parts":
                # Each object stored as two parts (a head and the rest), read back whole.
                parts = [(payload(k, req["size"])[:100], payload(k, req["size"])[100:]) for k in req["keys"]]
                reply({"codes": client.batch_put(req["keys"], parts)})
            elif op == "get_visit":
                seen: dict[int, bool] = {}
                keys, size, stop_at = req["keys"], req["size"], req.get("raise_at")

                def visit(i: int, data: memoryview, keys=keys, size=size, seen=seen, stop=stop_at) -> None:
                    if i == stop:
                        raise RuntimeError(f"visitor stops at {i}")
                    seen[i] = bool((np.frombuffer(data, np.uint8) == payload(keys[i], size)).all())

                try:
                    codes = client.batch_get_visit(keys, [size] * len(keys), visit)
                except RuntimeError as e:
                    reply({"raised": str(e)})
                    continue
                reply({"codes": codes, "exact": [seen.get(i, False) for i in range(len(codes))]})
            elif op == "exists":
                r = client.batch_exists(req["keys"])
                reply({"result": r, "elapsed": time.monotonic() - t0})
            elif op == "stats":
                reply({"stats": client.stats()})
            elif op == "quit":
                client.close()
                reply({"ok": True})
                return
        except BaseException as e:  # noqa: BLE001 - the test asserts there are none
            reply({"exception": repr(e)})


class Agent:
    def __init__(self, log_path: Path):
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "agent"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line[2:])

    def __call__(self, op: str, timeout: float = 60.0, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            out = json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"agent did not answer {op} within {timeout} s") from None
        assert "exception" not in out, f"{op} raised in the client: {out['exception']}"
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self("quit", timeout=15)
            except (AssertionError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture
def stores(tmp_path):
    """Start stores in tmp dirs; on teardown stop them and check no process is left."""
    started: list[tuple[Path, list[int]]] = []

    def start(name: str = "store", **kw):
        sd = tmp_path / name
        st = start_store(StoreSpec(state_dir=sd, **{"memory_bytes": 256 * MiB, **kw}))
        started.append((sd, [st.master_pid, st.client_pid]))
        return st

    yield start
    for sd, _ in started:
        stop_store(sd)
    left = [pid for _, pids in started for pid in pids if not _gone(pid)]
    assert not left, f"processes left running: {left}"


@pytest.fixture
def agents(tmp_path):
    made: list[Agent] = []

    def make() -> Agent:
        a = Agent(tmp_path / f"agent{len(made)}.log")
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def test_round_trip_across_processes_and_clean_stop(stores, agents, tmp_path):
    st = stores()
    status = store_status(st.state_dir)
    assert status["healthy"], status["problems"]
    assert status["capacity_bytes"] == 256 * MiB and status["object_count"] == 0
    assert status["addresses"]["master_addr"] == st.master_addr
    assert any("ALL network interfaces" in w for w in status["warnings"])

    keys = [f"rt-{i}" for i in range(8)]
    for mode in ("tcp", "shm"):
        a = agents()
        assert a("connect", state_dir=str(st.state_dir), mode=mode)["healthy"]
        mkeys = [f"{mode}-{k}" for k in keys]
        assert a("put", keys=mkeys, size=MiB)["codes"] == [0] * 8
        assert a("exists", keys=[*mkeys, "absent"])["result"] == [True] * 8 + [False]
        got = a("get", keys=[*mkeys, "absent"], size=MiB)
        assert got["codes"] == [MiB] * 8 + [-704]
        assert all(got["exact"][:8])
    # A reader in another process, other mode, sees the same objects bit-exactly.
    r = agents()
    r("connect", state_dir=str(st.state_dir), mode="shm")
    assert all(r("get", keys=[f"tcp-{k}" for k in keys], size=MiB)["exact"])
    assert store_status(st.state_dir)["object_count"] == 16

    result = stop_store(st.state_dir)
    assert sorted(result["stopped"]) == ["master", "storage"]
    assert _gone(st.master_pid) and _gone(st.client_pid)
    assert read_state(st.state_dir) is None
    after = store_status(st.state_dir)
    assert not after["running"] and not after["healthy"]


def test_parts_put_as_one_object_and_visited_in_staging(stores, agents):
    st = stores()
    a = agents()
    a("connect", state_dir=str(st.state_dir), mode="shm", local_buffer_bytes=4 * MiB)
    keys = [f"parts-{i}" for i in range(6)]  # 6 MiB: more than one round of the staging region
    assert a("put_parts", keys=keys, size=MiB)["codes"] == [0] * 6
    got = a("get", keys=keys, size=MiB)
    assert got["codes"] == [MiB] * 6 and all(got["exact"]), "the parts are one object, back to back"
    visited = a("get_visit", keys=[*keys, "absent"], size=MiB)
    assert visited["codes"] == [MiB] * 6 + [-704]
    assert visited["exact"] == [True] * 6 + [False], "the visitor sees each object's bytes, and none for a miss"
    # Gets are fetched in parts while the visitor works on the part before: a visitor that
    # raises while the next part is in flight gives the client back usable.
    assert a("get_visit", keys=keys, size=MiB, raise_at=1) == {"raised": "visitor stops at 1"}
    again = a("get_visit", keys=keys, size=MiB)
    assert again["codes"] == [MiB] * 6 and all(again["exact"])


def test_data_survives_the_writer(stores, agents):
    st = stores()
    w = agents()
    w("connect", state_dir=str(st.state_dir))
    keys = [f"w-{i}" for i in range(4)]
    assert w("put", keys=keys, size=MiB)["codes"] == [0] * 4
    w.kill()  # SIGKILL: no clean detach
    r = agents()
    r("connect", state_dir=str(st.state_dir))
    got = r("get", keys=keys, size=MiB)
    assert got["codes"] == [MiB] * 4 and all(got["exact"])


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_master_killed_degrades_to_misses_then_recovers(stores, agents, mode):
    st = stores(f"store-{mode}")
    timeout_s, margin = 1.0, 0.5
    a = agents()
    a("connect", state_dir=str(st.state_dir), mode=mode, timeout_s=timeout_s)
    assert a("put", keys=["before"], size=MiB)["codes"] == [0]

    os.kill(st.master_pid, signal.SIGKILL)
    timings = []
    for i in range(3):
        e = a("exists", keys=["before"])
        g = a("get", keys=["before"], size=MiB)
        p = a("put", keys=[f"down-{i}"], size=MiB)
        assert e["result"] == [False]
        assert g["codes"][0] < 0 and p["codes"][0] < 0
        timings += [e["elapsed"], g["elapsed"], p["elapsed"]]
    print(f"{mode}: call times with the master down: {[round(t, 3) for t in timings]}")
    assert max(timings) <= timeout_s + margin, timings
    assert a("stats")["stats"]["healthy"] is False

    # Restart the whole store on the same ports; the same client object resumes.
    stop_store(st.state_dir)
    stores(
        f"store-{mode}",
        master_port=st.master_port,
        metadata_port=st.metadata_port,
        metrics_port=st.metrics_port,
        client_port=st.client_port,
    )
    t0 = time.monotonic()
    while True:
        p = a("put", keys=["after"], size=MiB)
        if p["codes"] == [0]:
            break
        # Never a put refused for our shared memory: a client that says it is back has attached
        # to the restarted storage process (it answers a probe, but maps nothing of ours).
        assert p["codes"] != [-600], "the shm client called itself reconnected without attaching again"
        assert time.monotonic() - t0 < 20, f"no recovery within 20 s: {p}"
        time.sleep(0.25)
    recovered = time.monotonic() - t0
    print(f"{mode}: recovered {recovered:.2f} s after the store restarted")
    got = a("get", keys=["after", "before"], size=MiB)
    assert got["codes"][0] == MiB and got["exact"][0]
    assert got["codes"][1] == -704  # a restarted store starts empty
    s = a("stats")["stats"]
    assert s["healthy"] and s["reconnects"] >= 2


def test_hung_master_times_out_then_resumes(stores, agents):
    """A master that accepts connections but never answers (SIGSTOP): calls give up at timeout_s."""
    st = stores()
    timeout_s, margin = 1.0, 0.5
    a = agents()
    a("connect", state_dir=str(st.state_dir), timeout_s=timeout_s)
    assert a("put", keys=["k"], size=MiB)["codes"] == [0]
    os.kill(st.master_pid, signal.SIGSTOP)
    try:
        calls = [a("get", keys=["k"], size=MiB), a("put", keys=["k2"], size=MiB), a("exists", keys=["k"])]
    finally:
        os.kill(st.master_pid, signal.SIGCONT)
    timings = [c["elapsed"] for c in calls]
    print(f"call times with the master stopped: {[round(t, 3) for t in timings]}")
    assert max(timings) <= timeout_s + margin, timings
    assert calls[0]["codes"] == [-10001]  # ERR_TIMEOUT: the first call waited timeout_s
    assert calls[1]["codes"] == [-10002]  # ERR_UNAVAILABLE: later calls fail at once
    assert calls[2]["result"] == [False]
    t0 = time.monotonic()
    while a("get", keys=["k"], size=MiB)["codes"] != [MiB]:
        assert time.monotonic() - t0 < 15, "no recovery within 15 s of SIGCONT"
        time.sleep(0.25)
    assert a("stats")["stats"]["timeouts"] == 1


def test_store_full_fails_puts_without_raising(stores, agents):
    st = stores(memory_bytes=32 * MiB)
    a = agents()
    a("connect", state_dir=str(st.state_dir), timeout_s=5.0)
    keys = [f"full-{i}" for i in range(64)]
    codes = []
    for i in range(0, 64, 8):
        codes += a("put", keys=keys[i : i + 8], size=MiB)["codes"]
    failed = sum(c != 0 for c in codes)
    status = store_status(st.state_dir)
    print(f"store full: {failed}/64 puts failed ({sorted(set(codes))}); "
          f"evicted {status['evicted_keys']}, alloc failures {status['put_alloc_failures']}, "
          f"{status['object_count']} objects, {status['used_bytes'] / MiB:.0f} MiB used")
    assert status["healthy"]
    # 64 MiB into 32 MiB: the master evicted, refused some puts, or both.
    assert status["evicted_keys"] + status["put_alloc_failures"] > 0, status
    assert status["used_bytes"] <= 32 * MiB
    assert a("stats")["stats"]["puts_failed"] == failed
    # Whatever the store still holds reads back bit-exactly.
    present = [k for k, e in zip(keys, a("exists", keys=keys)["result"], strict=True) if e]
    assert 0 < len(present) <= 32
    got = a("get", keys=present, size=MiB)
    assert all(got["exact"]), got["codes"]


def test_pinned_objects_survive_a_store_filled_past_capacity(stores, agents):
    st = stores(memory_bytes=32 * MiB)
    pinned, other = agents(), agents()
    pinned("connect", state_dir=str(st.state_dir), timeout_s=5.0, pin="soft")
    other("connect", state_dir=str(st.state_dir), timeout_s=5.0)
    soft = [f"soft-{i}" for i in range(6)]
    assert pinned("put", keys=soft, size=MiB)["codes"] == [0] * 6
    assert store_status(st.state_dir)["soft_pinned_objects"] == 6
    # The control: unpinned objects written first are the ones evicted (with
    # pin="none" above, the "soft" ones go too: checked by hand).
    early = [f"early-{i}" for i in range(6)]
    assert other("put", keys=early, size=MiB)["codes"] == [0] * 6
    for i in range(0, 96, 8):  # 96 MiB of unpinned traffic into 32 MiB
        other("put", keys=[f"fill-{j}" for j in range(i, i + 8)], size=MiB)
    status = store_status(st.state_dir)
    assert status["evicted_keys"] > 0, status
    assert not all(other("exists", keys=early)["result"]), "nothing unpinned was evicted: the check shows nothing"
    assert other("exists", keys=soft)["result"] == [True] * 6
    assert all(other("get", keys=soft, size=MiB)["exact"])


def test_port_in_use_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for name in ("master_port", "metadata_port", "client_port"):
            with pytest.raises(StoreError, match=rf"port {port} \({name}\) is already in use"):
                start_store(StoreSpec(state_dir=tmp_path / "s", memory_bytes=64 * MiB, **{name: port}))
    assert read_state(tmp_path / "s") is None


def test_second_start_in_same_state_dir_errors(stores):
    st = stores()
    with pytest.raises(StoreError, match="already running"):
        start_store(StoreSpec(state_dir=st.state_dir, memory_bytes=64 * MiB))
    assert store_status(st.state_dir)["healthy"]  # the first store is untouched


def test_master_that_does_not_answer_in_time_is_reported_and_cleaned_up(tmp_path):
    from lmcache_mooncake.store.launcher import free_port, port_in_use

    port = free_port()
    with pytest.raises(StoreError, match=r"did not answer within 0.05 s(.|\n)*Log .*master.log"):
        start_store(StoreSpec(state_dir=tmp_path / "s", memory_bytes=64 * MiB, master_port=port, wait_s=0.05))
    assert read_state(tmp_path / "s") is None
    t0 = time.monotonic()
    while port_in_use(port):  # the half-started master was stopped
        assert time.monotonic() - t0 < 5, f"port {port} still in use"
        time.sleep(0.1)


def test_missing_library_hint():
    from lmcache_mooncake.store.launcher import missing_library_hint

    loader = (
        "mooncake_master: error while loading shared libraries: libibverbs.so.1: "
        "cannot open shared object file: No such file or directory"
    )
    assert "apt-get install libibverbs1" in missing_library_hint(loader)
    py = "libibverbs.so.1: cannot open shared object file: No such file or directory"  # ImportError text
    assert "apt-get install libibverbs1" in missing_library_hint(py)
    assert missing_library_hint("all good") is None


def test_client_connect_errors_fast_without_a_store():
    from lmcache_mooncake.store.launcher import free_port

    code = f"""
import time
from lmcache_mooncake.store.client import StoreClient, ERR_UNAVAILABLE
from lmcache_mooncake.store.launcher import StoreError
addr, url = "127.0.0.1:{free_port()}", "http://127.0.0.1:{free_port()}/metadata"
t = time.monotonic()
try:
    StoreClient.connect(addr, url, timeout_s=1)
    raise SystemExit("no error")
except StoreError as e:
    assert "cannot connect" in str(e) and addr in str(e), e
assert time.monotonic() - t < 2
c = StoreClient.connect(addr, url, timeout_s=1, require=False)
t = time.monotonic()
assert not c.healthy
assert c.batch_exists(["a"]) == [False]
assert c.batch_get_into(["a"], [bytearray(8)]) == [ERR_UNAVAILABLE]
assert c.batch_put(["a"], [b"x"]) == [ERR_UNAVAILABLE]
assert time.monotonic() - t < 1
c.close()
print("OK")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]


def test_status_without_store(tmp_path):
    s = store_status(tmp_path / "nothing")
    assert not s["running"] and "no store recorded" in s["problems"][0]
    assert stop_store(tmp_path / "nothing")["was_recorded"] is False


if __name__ == "__main__" and sys.argv[1:] == ["agent"]:
    agent_main()
