"""Several "hosts" on one machine: Linux network, IPC and mount namespaces a test creates.

Each simulated host gets its own network namespace with one interface on a
private bridge (``10.213.<net>.<n>/24``, nothing else reachable: no route
out, and its loopback is its own), its own IPC namespace and its own
``/dev/shm``, so processes on two hosts share no memory and reach each other
only through the addresses assigned here. The file system stays shared (the
model folder, logs and run folders are read from outside).

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and ``ip``/``unshare``;
:func:`unavailable` says why not, for a test to skip. Used by
``tests/test_e2e_hosts.py``; ``docs/deployment.md`` gives the same recipe as
shell commands. Everything made is removed by :meth:`SimulatedHosts.close`
(every process left in a namespace is killed first).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_mooncake.runtime import procs

#: Runs one HTTP request inside a namespace and prints status and body as JSON.
_HTTP_CLIENT = """
import json, sys, urllib.request, urllib.error
method, url, body, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
req = urllib.request.Request(url, method=method, data=body.encode() if body else None,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = {"status": r.status, "body": r.read().decode()}
except urllib.error.HTTPError as e:
    out = {"status": e.code, "body": e.read().decode()}
except Exception as e:
    out = {"status": 0, "body": repr(e)}
print(json.dumps(out))
"""


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"lmcm-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'ip netns add' failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class SimulatedHosts:
    """Hosts ``names`` on one bridge; ``with SimulatedHosts([...]) as hosts:``."""

    def __init__(self, names: Sequence[str], net: int = 213, subnet: int | None = None):
        self.names = list(names)
        self.tag = f"lmcm{os.getpid() % 100000}"
        self._net = f"10.{net}.{subnet if subnet is not None else os.getpid() % 250}"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # -- set-up and tear-down ------------------------------------------------
    def __enter__(self) -> SimulatedHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def netns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"{self._net}.{self.names.index(name) + 1}"

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = ["ip", *(["-n", ns] if ns else []), *args]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")

    def _create(self) -> None:
        switch = self.netns("switch")
        self._ip("netns", "add", switch)
        self._made.append(switch)
        self._ip("link", "add", "br0", "type", "bridge", ns=switch)
        self._ip("link", "set", "br0", "up", ns=switch)
        for i, name in enumerate(self.names):
            ns = self.netns(name)
            self._ip("netns", "add", ns)
            self._made.append(ns)
            port = f"p{i}"
            self._ip("link", "add", port, "netns", switch, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", port, "master", "br0", "up", ns=switch)
            self._ip("addr", "add", f"{self.address(name)}/24", "dev", "eth0", ns=ns)
            self._ip("link", "set", "eth0", "up", ns=ns)
            self._ip("link", "set", "lo", "up", ns=ns)

    def close(self) -> None:
        """Kill every process on the hosts, then remove the namespaces (idempotent)."""
        for p in self._procs:
            procs.stop_group(p)
        for ns in self._made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        deadline = time.monotonic() + 10
        for ns in self._made:
            while (subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.strip()
                   and time.monotonic() < deadline):
                time.sleep(0.1)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self._procs.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this object that still exist (for a test's final check)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in listed.splitlines() if line.startswith(self.tag + "-")]

    # -- running things on a host ---------------------------------------------
    def command(self, name: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run on host ``name``: its network namespace, a new IPC namespace and a private
        ``/dev/shm`` (so no shared memory with any other host)."""
        inner = 'mount -t tmpfs -o size=4g lmcm-shm /dev/shm && exec "$0" "$@"'
        return ["ip", "netns", "exec", self.netns(name), "unshare", "--ipc", "--mount", "--propagation",
                "private", "sh", "-c", inner, *cmd]

    def spawn(self, name: str, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None
              ) -> subprocess.Popen:
        p = procs.spawn(self.command(name, cmd), log, env=env)
        self._procs.append(p)
        return p

    def run(self, name: str, cmd: Sequence[str], timeout: float = 120, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, cmd), capture_output=True, text=True, timeout=timeout, env=env)

    def http(self, name: str, method: str, url: str, body: Any = None, timeout: float = 300) -> tuple[int, str]:
        """One HTTP request made from host ``name``: (status, body); status 0 when nothing answered."""
        data = "" if body is None else json.dumps(body)
        r = self.run(name, [sys.executable, "-c", _HTTP_CLIENT, method, url, data, str(timeout)],
                     timeout=timeout + 30)
        if r.returncode != 0 or not r.stdout.strip():
            return 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        return int(out["status"]), out["body"]

    def can_connect(self, name: str, host: str, port: int) -> bool:
        """Whether a TCP connection from host ``name`` to ``host:port`` succeeds."""
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2).close()"
        return self.run(name, [sys.executable, "-c", probe, host, str(port)], timeout=30).returncode == 0

    def wait_http(self, name: str, url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 420) -> None:
        """Block until ``url`` answers 200 from host ``name``; fail with the log's tail if ``proc`` exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: process exited ({proc.returncode}); log {log}:\n{procs.tail_log(log)}")
            if self.http(name, "GET", url, timeout=5)[0] == 200:
                return
            time.sleep(2)
        raise RuntimeError(f"{name}: {url} did not answer within {timeout_s:g} s; log {log}:\n{procs.tail_log(log)}")
