"""A server process for the end-to-end tests: started, waited for on /health, killed with its group."""

from __future__ import annotations

import subprocess
from pathlib import Path

from lmcache_mooncake import procs


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.cmd, self.env, self.port, self.log = name, cmd, env, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        """Spawn the process (in its own session) without waiting for it; its log is appended to."""
        self.proc = procs.spawn(self.cmd, self.log, env=self.env, mode="a")
        return self

    def wait_ready(self, timeout_s: float = 420) -> Server:
        """Block until /health answers 200; fail (with the log's tail) if the process exits or the time runs out."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        procs.wait_healthy(self.proc, self.url, timeout_s, self.name, self.log)
        return self

    def kill(self) -> None:
        """SIGKILL the process and everything it started."""
        if self.proc is not None:
            procs.stop_group(self.proc)
