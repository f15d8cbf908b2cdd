"""Process helpers for the command line, the launcher, the test harness and the tests.

One place for what each of them needs around child processes: start one with
its output in a log file (:func:`spawn`), wait until it is ready
(:func:`wait_until`, :func:`wait_healthy`), stop it with everything it started
(:func:`stop_group`), show the end of its log (:func:`tail_log`), pick and
probe TCP ports (:func:`free_port`, :func:`port_in_use`, :func:`can_connect`),
serialize on a lock file (:func:`file_lock`) and print sizes
(:func:`format_bytes`). Process inspection goes through ``psutil``.

Nothing here is on the serving path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import psutil

LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------
# Starting, waiting, stopping
# --------------------------------------------------------------------------


def spawn(cmd: Sequence[str], log_path: Path | str, *, env: Mapping[str, str] | None = None,
          cwd: Path | str | None = None, mode: str = "w", header: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session with stdout and stderr in ``log_path``.

    The new session makes the child a process group leader, so
    :func:`stop_group` stops it and every process it starts. ``mode`` is the
    log's open mode ("w" replaces, "a" appends); ``header`` is written to
    the log first. Raises ``OSError`` when ``cmd`` cannot be executed.
    """
    with open(log_path, mode.replace("b", "") + "b") as log:
        if header is not None:
            log.write(header.encode())
            log.flush()
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=None if cwd is None else str(cwd),
            env=None if env is None else dict(env),
            start_new_session=True,
            close_fds=True,
        )


def wait_until(ready: Callable[[], bool], *, alive: Callable[[], bool], deadline: float,
               on_exit: Callable[[], Exception], on_timeout: Callable[[], Exception],
               interval_s: float = 0.5) -> None:
    """Poll ``ready()`` until it is true.

    Raises ``on_exit()`` as soon as ``alive()`` is false (the process died
    before it was ready) and ``on_timeout()`` once ``time.monotonic()`` passes
    ``deadline``.
    """
    while True:
        if not alive():
            raise on_exit()
        if ready():
            return
        if time.monotonic() > deadline:
            raise on_timeout()
        time.sleep(interval_s)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """``GET url`` answers 200."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, name: str, log_path: Path | str,
                 lines: int = 30) -> None:
    """Block until ``url/health`` answers 200 from ``proc`` (or a process it started); ``RuntimeError``
    with the log's tail if the process exits first, if ``timeout_s`` passes, or if another program
    answers on that port (which ``proc`` then failed to bind: Mooncake's metadata and metrics
    servers, for one, answer ``/health`` with 200 too)."""
    wait_until(
        lambda: http_ok(f"{url}/health"),
        alive=lambda: proc.poll() is None,
        deadline=time.monotonic() + timeout_s,
        on_exit=lambda: RuntimeError(
            f"{name} exited ({proc.returncode}); log {log_path}:\n{tail_log(log_path, lines)}"),
        on_timeout=lambda: RuntimeError(
            f"{name} did not answer at {url} within {timeout_s:.0f} s; log {log_path}:\n{tail_log(log_path, lines)}"),
    )
    port = urlsplit(url).port
    if port is not None and listens(proc.pid, port) is False:
        raise RuntimeError(
            f"{name} (pid {proc.pid}) is not listening on port {port}, but something else answers "
            f"{url}/health there: another program holds the port; give {name} a free port. "
            f"Log {log_path}:\n{tail_log(log_path, lines)}")


def listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` or one of its descendants has a TCP socket listening on ``port``;
    None when that cannot be read (the process gone, or its sockets not ours to see)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    for p in tree:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            return None
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


def stop_group(proc: subprocess.Popen, grace_s: float = 0.0) -> int | None:
    """Stop ``proc`` (started by :func:`spawn`) and every process in its group.

    With ``grace_s`` > 0 the group first gets SIGTERM and up to ``grace_s``
    seconds for all of it to exit, not only ``proc``: a vLLM server's API
    process exits before its worker, which is still draining the connector's
    writes, and killing the worker then loses the chunks it was writing. Then
    whatever is left of the group gets SIGKILL. Returns the child's exit status
    (None if it could not be reaped within 5 s).
    """
    if grace_s > 0:
        members = _group_members(proc.pid)  # now: once the leader is gone, its children are not its children
        if proc.poll() is None or members:
            deadline = time.monotonic() + grace_s
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
            while any(_alive(p) for p in members) and time.monotonic() < deadline:
                time.sleep(0.05)
    # Whatever the child left in its process group goes too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return proc.returncode


def _group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid`` other than its leader."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != pgid and os.getpgid(p.pid) == pgid:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent has not reaped it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tail_log(path: Path | str, lines: int = 25, max_bytes: int = 16384) -> str:
    """The last ``lines`` lines of a log file (read from its last ``max_bytes``), or "(no log)"."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - max_bytes, 0))
            data = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


# --------------------------------------------------------------------------
# Inspecting processes by pid (psutil)
# --------------------------------------------------------------------------


def pid_status(pid: int) -> str | None:
    """psutil's status of ``pid`` ("running", "sleeping", "zombie", ...), None if there is no such process."""
    try:
        return psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def pid_cmdline(pid: int) -> list[str] | None:
    """The command line of ``pid``, None if there is no such process (or it is a zombie)."""
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
        return None


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True when ``port`` cannot be bound on ``host`` or on 0.0.0.0 (some servers bind all interfaces)."""
    for h in (host, "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((h, port))
            except OSError:
                return True
    return False


def hold_port(port: int, host: str = LOOPBACK) -> socket.socket | None:
    """A socket bound (not listening) to ``host:port``, so that no other process, and no port
    the kernel hands out meanwhile, takes the port until the caller closes it right before
    its own server binds it (``up`` holds the proxy's port while the store and the vLLMs,
    which pick free ports of their own, start). ``None`` when the port is free but cannot
    be held (only connections of an earlier server in TIME_WAIT on it). Raises ``OSError``
    naming the port when it is in use."""
    if port_in_use(port, host):
        raise OSError(errno.EADDRINUSE, f"port {port} on {host} is already in use")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # No SO_REUSEADDR: with it on both sides, Linux lets a second socket bind the port.
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_port(exclude: set[int] | None = None) -> int:
    """A currently free TCP port on 127.0.0.1 (and 0.0.0.0), not in ``exclude``.

    Raises ``OSError`` when none is found in 100 tries.
    """
    exclude = exclude or set()
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in exclude and not port_in_use(port):
            return port
    raise OSError("could not find a free TCP port on 127.0.0.1")


def can_connect(host: str, port: int, timeout: float) -> bool:
    """A TCP connection to ``host:port`` opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------
# Files and formatting
# --------------------------------------------------------------------------


@contextlib.contextmanager
def file_lock(path: Path | str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block.

    The lock file is never deleted: unlinking it would let a third process
    lock a fresh inode while a second still holds the old one.
    """
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def format_bytes(n: float) -> str:
    """``n`` bytes for people: "512 B", "1.5 KiB", "3.0 MiB", "2.0 GiB" (GiB is the largest unit)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
