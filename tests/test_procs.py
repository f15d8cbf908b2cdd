"""The process helpers: a child with its log, waiting for it, stopping its whole group, ports, locks, sizes."""

from __future__ import annotations

import socket
import sys
import threading
import time

import psutil
import pytest

from lmcache_mooncake.runtime import procs


def test_spawn_logs_and_stop_group_takes_the_grandchildren(tmp_path):
    log = tmp_path / "child.log"
    # The child prints, starts a grandchild in its own group, and waits.
    code = ("import subprocess, sys, time; print('hello from the child', flush=True); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    proc = procs.spawn([sys.executable, "-c", code], log, header="# header\n")
    deadline = time.monotonic() + 20
    while "hello from the child" not in procs.tail_log(log) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs.tail_log(log).splitlines()[:2] == ["# header", "hello from the child"]
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (grandchild,) = psutil.Process(proc.pid).children()
    assert procs.pid_cmdline(proc.pid)[:2] == [sys.executable, "-c"]
    procs.stop_group(proc, grace_s=5)
    assert proc.returncode is not None
    grandchild.wait(5)  # gone with its group
    assert procs.pid_status(grandchild.pid) is None


def test_stop_group_waits_for_the_whole_group_not_only_its_leader(tmp_path):
    """A vLLM server's API process exits on SIGTERM before its worker has drained the
    connector's writes: the grace period is for the group, so the worker is not killed."""
    done = tmp_path / "drained"
    worker = ("import pathlib, signal, sys, time\n"
              "def term(*_):\n"
              "    time.sleep(1.5)  # draining\n"
              f"    pathlib.Path({str(done)!r}).write_text('ok')\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, term)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    leader = ("import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {worker!r}])\n"
              "time.sleep(60)\n")  # SIGTERM's default action: the leader exits at once
    log = tmp_path / "leader.log"
    proc = procs.spawn([sys.executable, "-c", leader], log)
    deadline = time.monotonic() + 20
    while "ready" not in procs.tail_log(log) and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    procs.stop_group(proc, grace_s=10)
    assert done.read_text() == "ok", "the worker was killed while it drained"
    assert time.monotonic() - t0 < 8


def test_tail_log_of_a_missing_file_says_so(tmp_path):
    assert procs.tail_log(tmp_path / "nope.log") == "(no log)"
    f = tmp_path / "long.log"
    f.write_text("".join(f"line {i}\n" for i in range(100)))
    assert procs.tail_log(f, 3) == "line 97\nline 98\nline 99"


def test_wait_until_raises_what_it_is_given():
    with pytest.raises(RuntimeError, match="died"):
        procs.wait_until(lambda: False, alive=lambda: False, deadline=time.monotonic() + 5,
                         on_exit=lambda: RuntimeError("died"), on_timeout=lambda: RuntimeError("slow"))
    with pytest.raises(TimeoutError, match="slow"):
        procs.wait_until(lambda: False, alive=lambda: True, deadline=time.monotonic() + 0.2, interval_s=0.05,
                         on_exit=lambda: RuntimeError("died"), on_timeout=lambda: TimeoutError("slow"))
    calls = []
    procs.wait_until(lambda: calls.append(1) or len(calls) > 2, alive=lambda: True, deadline=time.monotonic() + 5,
                     on_exit=RuntimeError, on_timeout=TimeoutError, interval_s=0.01)
    assert len(calls) == 3


def test_ports_and_can_connect():
    port = procs.free_port()
    assert not procs.port_in_use(port) and not procs.can_connect("127.0.0.1", port, 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert procs.port_in_use(port) and procs.can_connect("127.0.0.1", port, 0.5)
        assert procs.free_port(exclude={port}) != port


def test_file_lock_excludes_a_second_holder(tmp_path):
    lock = tmp_path / "x.lock"
    order = []

    def second():
        with procs.file_lock(lock):
            order.append("second")

    with procs.file_lock(lock):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first")
    t.join(5)
    assert order == ["first", "second"]


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                          (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB"), (2048 << 30, "2048.0 GiB")])
def test_format_bytes(n, text):
    assert procs.format_bytes(n) == text


_HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_wait_healthy_refuses_a_port_another_program_answers_on(tmp_path):
    port = procs.free_port()
    other = procs.spawn([sys.executable, "-c", _HEALTH_SERVER, str(port)], tmp_path / "other.log")
    # A child that cannot bind the port (it never tries) while another program answers /health there.
    child = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "child.log")
    try:
        # Control (and the wait for it to answer): the program that answers is the one waited on.
        procs.wait_healthy(other, f"http://127.0.0.1:{port}", 30, "server", tmp_path / "other.log")
        with pytest.raises(RuntimeError, match=f"is not listening on port {port}"):
            procs.wait_healthy(child, f"http://127.0.0.1:{port}", 30, "proxy", tmp_path / "child.log")
    finally:
        procs.stop_group(child)
        procs.stop_group(other)


def test_a_held_port_is_neither_handed_out_nor_bindable_until_released():
    """up holds the proxy's port while the store and vLLM pick free ports (one of them once
    took it: the proxy then failed with 'address already in use')."""
    port = procs.free_port()
    hold = procs.hold_port(port)
    assert hold is not None
    try:
        assert procs.port_in_use(port)
        assert all(procs.free_port() != port for _ in range(50))
        with pytest.raises(OSError, match=f"port {port} .* already in use"):
            procs.hold_port(port)
    finally:
        hold.close()
    with socket.socket() as s:  # the control: released, the proxy can bind it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_up_refuses_a_proxy_port_in_use_before_starting_anything(tmp_path):
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "lmcache_mooncake.cli", "up", "--model", str(tmp_path),
                              "--port", str(port), "--state-dir", str(tmp_path / "store"),
                              "--work-dir", str(tmp_path / "w")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--port {port} is not free" in out.stderr
    assert not (tmp_path / "store" / "store.json").exists()
