"""A server process for the end-to-end tests: started, waited for on /health, killed with its group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.cmd, self.env, self.port, self.log = name, cmd, env, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        """Spawn the process (in its own session) without waiting for it."""
        with open(self.log, "a") as f:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 420) -> Server:
        """Block until /health answers 200; fail if the process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None and self.proc.poll() is None, f"{self.name} exited; see {self.log}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            assert time.monotonic() < deadline, f"{self.name} not ready; see {self.log}"
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the process and everything it started."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
