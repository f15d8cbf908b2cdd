"""Start, inspect and stop an embedded Mooncake Store on loopback.

The store is two processes, started detached (their own session, logs in the
state folder) so that they outlive the command that started them:

- ``mooncake_master``: object metadata, allocation and eviction, with its
  HTTP metadata server (``--enable_http_metadata_server``) and its admin /
  metrics HTTP server (``/health``, ``/metrics``) bound to 127.0.0.1.
- one storage process, ``mooncake_client``, which owns ``memory_bytes`` of
  store memory (its "global segment"). Objects live in the memory of the
  process that holds the segment chosen at put time, so the memory must belong
  to this long-lived process and not to vLLM processes: clients attach with
  ``global_segment_size=0`` (see :mod:`lmcache_mooncake.store.client`). Its
  RPC port (``client_port``) is also where same-host clients in ``shm`` mode
  attach.

A JSON state file (``store.json``) in the state folder records pids, ports,
command lines, log paths and the start time; :func:`store_status` and
:func:`stop_store` work from it. :func:`stop_store` only signals a recorded
pid whose ``/proc/<pid>/cmdline`` still equals the recorded command line.

Network exposure: whatever address is passed, Mooncake 0.3.13's HTTP metadata
server (``metadata_port``) and the storage process's transfer-engine ports
(random ports, TCP transport and its RPC) listen on all interfaces (0.0.0.0),
and so does every ``tcp``-mode client's transfer port. They have no
authentication. :data:`ALL_INTERFACES_WARNING` says so in logs and status.
The master RPC port, the metrics port and the storage process's RPC port do
honour 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GiB = 1 << 30
STATE_FILE = "store.json"
LOCK_FILE = "store.lock"
STATE_VERSION = 1
ENV_STATE_DIR = "LMCACHE_MOONCAKE_STORE_DIR"
LOOPBACK = "127.0.0.1"

ALL_INTERFACES_WARNING = (
    "Mooncake's HTTP metadata server and the storage process's data-transfer ports "
    "listen on ALL network interfaces (0.0.0.0), whatever address is configured, "
    "without authentication (so do the transfer ports of every client in 'tcp' mode). "
    "Anyone who can reach this host can read and write the cache. Firewall these "
    "ports or use this only on a host whose network you trust."
)

# Shared libraries the Mooncake binaries load, and the Debian/Ubuntu package
# that provides each (the loader error names the library, not the package).
_LIB_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
}
_LOADER_ERROR = re.compile(r"error while loading shared libraries: (\S+?): cannot open shared object file")


class StoreError(RuntimeError):
    """The store cannot be started, inspected or stopped; the message says why and what to do."""


def default_state_dir() -> Path:
    """``$LMCACHE_MOONCAKE_STORE_DIR``, else ``~/.cache/lmcache-mooncake/store``."""
    env = os.environ.get(ENV_STATE_DIR)
    if env:
        return Path(os.path.expandvars(env)).expanduser()
    return Path.home() / ".cache" / "lmcache-mooncake" / "store"


@dataclass
class StoreSpec:
    """What to start. Ports left ``None`` are picked free on 127.0.0.1."""

    #: Bytes of store memory owned by the storage process (its global segment).
    memory_bytes: int = 4 * GiB
    #: Master RPC port (clients' ``master_addr``).
    master_port: int | None = None
    #: Master's HTTP metadata server port (clients' ``metadata_url``). Listens on all interfaces.
    metadata_port: int | None = None
    #: Master's admin HTTP port (``/health``, ``/metrics``), bound to 127.0.0.1.
    metrics_port: int | None = None
    #: Storage process RPC port, bound to 127.0.0.1 (``shm``-mode clients attach here).
    client_port: int | None = None
    #: Folder for the state file and logs.
    state_dir: Path = field(default_factory=default_state_dir)
    #: Transfer protocol of the storage process: "tcp" or "rdma".
    protocol: str = "tcp"
    #: RDMA device names for ``protocol="rdma"`` (e.g. "mlx5_0,mlx5_1").
    rdma_devices: str = ""
    #: Threads of the storage process's RPC service (serves ``shm``-mode clients).
    client_threads: int = 4
    #: Master evicts when memory use passes this ratio (Mooncake default 0.9).
    eviction_high_watermark_ratio: float = 0.9
    #: Fraction of objects evicted per eviction round (Mooncake default 0.05).
    eviction_ratio: float = 0.05
    #: Seconds a client stays registered after its last heartbeat (Mooncake default 10).
    client_ttl_s: int = 10
    #: Seconds to wait for both processes to answer.
    wait_s: float = 30.0
    #: Extra command-line flags for the master / the storage process.
    extra_master_args: list[str] = field(default_factory=list)
    extra_client_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).expanduser()
        if self.memory_bytes < 16 << 20:
            raise StoreError(f"memory_bytes={self.memory_bytes}: give at least 16 MiB (e.g. 4 GiB)")
        if self.protocol not in ("tcp", "rdma"):
            raise StoreError(f"protocol={self.protocol!r}: use 'tcp' or 'rdma'")
        for name in ("master_port", "metadata_port", "metrics_port", "client_port"):
            port = getattr(self, name)
            if port is not None and not 0 < int(port) < 65536:
                raise StoreError(f"{name}={port} is not a TCP port (1-65535)")
        if not 0 < self.eviction_high_watermark_ratio <= 1 or not 0 < self.eviction_ratio <= 1:
            raise StoreError("eviction ratios must be in (0, 1]")
        if self.wait_s <= 0:
            raise StoreError(f"wait_s={self.wait_s} must be above 0")


@dataclass
class StoreState:
    """What :func:`start_store` started; the content of the JSON state file."""

    state_dir: Path
    host: str
    memory_bytes: int
    protocol: str
    master_port: int
    metadata_port: int
    metrics_port: int
    client_port: int
    master_pid: int
    client_pid: int
    master_cmdline: list[str]
    client_cmdline: list[str]
    master_log: str
    client_log: str
    started_at: float
    version: int = STATE_VERSION

    # Addresses clients use --------------------------------------------------
    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"

    @property
    def client_addr(self) -> str:
        """The storage process's RPC address (``StoreClient`` ``mode="shm"`` attaches here)."""
        return f"{self.host}:{self.client_port}"

    @property
    def state_file(self) -> Path:
        return Path(self.state_dir) / STATE_FILE

    def addresses(self) -> dict[str, str]:
        return {
            "master_addr": self.master_addr,
            "metadata_url": self.metadata_url,
            "client_addr": self.client_addr,
            "metrics_url": self.metrics_url,
        }

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state_dir"] = str(self.state_dir)
        d["addresses"] = self.addresses()
        d["started_at_iso"] = _iso(self.started_at)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreState:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["state_dir"] = Path(kw["state_dir"])
        return cls(**kw)

    def write(self) -> None:
        path = self.state_file
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def read_state(state_dir: Path | str | None = None) -> StoreState | None:
    """The recorded state in ``state_dir`` (default :func:`default_state_dir`), or None."""
    sd = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
    path = sd / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: unreadable state file ({e}); remove it if no store runs there") from e
    try:
        return StoreState.from_dict(data)
    except (KeyError, TypeError) as e:
        raise StoreError(f"{path}: state file lacks {e}; remove it if no store runs there") from e


def start_store(spec: StoreSpec | None = None) -> StoreState:
    """Start the master and one storage process, wait until both answer, record them.

    Raises :class:`StoreError` (and leaves nothing running) when a store is
    already running in ``spec.state_dir``, a given port is taken, a binary or
    shared library is missing, or a process does not answer within
    ``spec.wait_s`` (the message includes the tail of its log).
    """
    spec = spec or StoreSpec()
    sd = spec.state_dir
    sd.mkdir(parents=True, exist_ok=True)
    with _locked(sd):
        existing = read_state(sd)
        if existing is not None:
            alive = [n for n, pid, cmd in _procs(existing) if _pid_matches(pid, cmd)]
            if alive:
                raise StoreError(
                    f"a store is already running in {sd} ({', '.join(alive)} alive; "
                    f"master at {existing.master_addr}). Stop it first "
                    f"(lmcache-mooncake store down --state-dir {sd}) or use another state dir."
                )
            log.warning("removing stale store state in %s (its processes are gone)", sd)
            existing.state_file.unlink(missing_ok=True)

        master_bin, client_bin = find_binaries()
        _check_shared_libraries(master_bin)
        ports = _choose_ports(spec)
        env = dict(os.environ)
        env["MC_TCP_BIND_ADDRESS"] = LOOPBACK  # the storage process advertises its loopback address

        master_cmd = [
            str(master_bin),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={ports['master_port']}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={LOOPBACK}",
            f"--http_metadata_server_port={ports['metadata_port']}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={ports['metrics_port']}",
            "--enable_metric_reporting=false",
            f"--eviction_high_watermark_ratio={spec.eviction_high_watermark_ratio}",
            f"--eviction_ratio={spec.eviction_ratio}",
            f"--client_ttl={spec.client_ttl_s}",
            "--logtostderr",
            *spec.extra_master_args,
        ]
        client_cmd = [
            str(client_bin),
            f"--host={LOOPBACK}",
            f"--port={ports['client_port']}",
            f"--master_server_address={LOOPBACK}:{ports['master_port']}",
            f"--metadata_server=http://{LOOPBACK}:{ports['metadata_port']}/metadata",
            f"--global_segment_size={spec.memory_bytes}",
            "--local_buffer_size=0",
            f"--protocol={spec.protocol}",
            f"--threads={spec.client_threads}",
            "--logtostderr",
            *([f"--device_names={spec.rdma_devices}"] if spec.rdma_devices else []),
            *spec.extra_client_args,
        ]
        master_log = sd / "master.log"
        client_log = sd / "storage.log"
        deadline = time.monotonic() + spec.wait_s
        started: list[int] = []
        try:
            mpid = _spawn(master_cmd, master_log, env, sd)
            started.append(mpid)
            _wait_master(mpid, master_log, ports, deadline, spec.wait_s)
            cpid = _spawn(client_cmd, client_log, env, sd)
            started.append(cpid)
            _wait_storage(cpid, client_log, ports, spec.memory_bytes, deadline, spec.wait_s)
        except BaseException:
            for pid in reversed(started):
                _terminate(pid, None, grace_s=3.0)
            raise
        state = StoreState(
            state_dir=sd,
            host=LOOPBACK,
            memory_bytes=spec.memory_bytes,
            protocol=spec.protocol,
            master_port=ports["master_port"],
            metadata_port=ports["metadata_port"],
            metrics_port=ports["metrics_port"],
            client_port=ports["client_port"],
            master_pid=mpid,
            client_pid=cpid,
            master_cmdline=master_cmd,
            client_cmdline=client_cmd,
            master_log=str(master_log),
            client_log=str(client_log),
            started_at=time.time(),
        )
        state.write()
    log.info(
        "Mooncake store started in %s: master %s, metadata %s, %s of memory (pids %d, %d)",
        sd,
        state.master_addr,
        state.metadata_url,
        _fmt_bytes(spec.memory_bytes),
        mpid,
        cpid,
    )
    log.warning("%s (metadata port %d)", ALL_INTERFACES_WARNING, state.metadata_port)
    return state


def store_status(state_dir: Path | str | None = None, timeout_s: float = 2.0) -> dict[str, Any]:
    """Health, capacity and object count of the store recorded in ``state_dir``.

    Never raises for a dead or missing store; read ``running`` / ``healthy`` /
    ``problems``. Keys:

    - ``running``: a state file exists and both recorded processes are alive
      (pid alive and ``/proc/<pid>/cmdline`` equals the recorded command line).
    - ``healthy``: running, the master's ``/health`` says ``service_ready`` and
      the storage segment is mounted (capacity > 0).
    - ``addresses``: ``master_addr``, ``metadata_url`` (tcp-mode clients),
      ``client_addr`` (shm-mode clients), ``metrics_url``.
    - ``capacity_bytes``, ``used_bytes``, ``free_bytes``, ``object_count``,
      ``clients`` (live Mooncake clients incl. the storage process),
      ``evicted_keys``, ``evicted_bytes``, ``eviction_rounds``,
      ``put_alloc_failures`` (puts refused for lack of space) and
      ``put_failed_items``: from the master's Prometheus ``/metrics``.
    - ``processes``, ``ports``, ``logs``, ``started_at``, ``uptime_s``,
      ``problems`` (list of strings), ``warnings`` (incl. the all-interfaces one).
    """
    sd = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
    out: dict[str, Any] = {
        "state_dir": str(sd),
        "state_file": str(sd / STATE_FILE),
        "running": False,
        "healthy": False,
        "problems": [],
        "warnings": [ALL_INTERFACES_WARNING],
    }
    try:
        st = read_state(sd)
    except StoreError as e:
        out["problems"].append(str(e))
        return out
    if st is None:
        out["problems"].append(f"no store recorded in {sd} (start one with: lmcache-mooncake store up)")
        return out
    procs = {}
    for name, pid, cmd in _procs(st):
        alive = _pid_alive(pid)
        matches = alive and _pid_matches(pid, cmd)
        procs[name] = {"pid": pid, "alive": bool(matches)}
        if not alive:
            out["problems"].append(f"{name} process (pid {pid}) is not running; see {_log_of(st, name)}")
        elif not matches:
            out["problems"].append(f"pid {pid} recorded for the {name} now runs another program")
    out.update(
        processes=procs,
        ports={
            "master": st.master_port,
            "metadata": st.metadata_port,
            "metrics": st.metrics_port,
            "client": st.client_port,
        },
        addresses=st.addresses(),
        memory_bytes=st.memory_bytes,
        protocol=st.protocol,
        logs={"master": st.master_log, "storage": st.client_log},
        started_at=_iso(st.started_at),
        uptime_s=round(time.time() - st.started_at, 1),
    )
    out["running"] = all(p["alive"] for p in procs.values())
    health = _http_json(f"{st.metrics_url}/health", timeout_s)
    out["master_health"] = health
    metrics = _http_text(f"{st.metrics_url}/metrics", timeout_s)
    if health is None or metrics is None:
        out["problems"].append(f"master does not answer at {st.metrics_url}")
        return out
    m = parse_prometheus(metrics)
    cap = int(m.get("master_total_capacity_bytes", 0))
    used = int(m.get("master_allocated_bytes", 0))
    out.update(
        capacity_bytes=cap,
        used_bytes=used,
        free_bytes=max(cap - used, 0),
        object_count=int(m.get("master_key_count", 0)),
        clients=int(m.get("master_active_clients", 0)),
        evicted_keys=int(m.get("master_evicted_key_count", 0)),
        evicted_bytes=int(m.get("master_evicted_size_bytes", 0)),
        eviction_rounds=int(m.get("master_successful_evictions_total", 0)),
        put_alloc_failures=int(m.get("master_put_start_alloc_failures_total", 0)),
        put_failed_items=int(m.get("master_batch_put_start_failed_items_total", 0))
        + int(m.get("master_put_start_failures_total", 0)),
    )
    if cap <= 0:
        out["problems"].append("no storage segment is mounted at the master (storage process not attached)")
    ready = bool(health.get("service_ready")) if isinstance(health, dict) else False
    out["healthy"] = out["running"] and ready and cap > 0
    return out


def stop_store(state_dir: Path | str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """Stop exactly the recorded processes and remove the state file.

    Storage process first, then master: SIGTERM, wait up to ``timeout_s``,
    then SIGKILL. A pid whose command line no longer equals the recorded one is
    left alone (reported under ``skipped``). Returns ``{"stopped": [...],
    "already_gone": [...], "skipped": [...], "was_recorded": bool}``.
    """
    sd = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
    result: dict[str, Any] = {"stopped": [], "already_gone": [], "skipped": [], "was_recorded": False}
    if not sd.exists():
        return result
    with _locked(sd):
        st = read_state(sd)
        if st is None:
            return result
        result["was_recorded"] = True
        for name, pid, cmd in reversed(_procs(st)):  # storage first
            if not _pid_alive(pid):
                result["already_gone"].append(name)
                continue
            if not _pid_matches(pid, cmd):
                result["skipped"].append(f"{name} (pid {pid} now runs another program)")
                continue
            _terminate(pid, cmd, grace_s=timeout_s)
            result["stopped"].append(name)
        st.state_file.unlink(missing_ok=True)
    log.info("Mooncake store in %s stopped: %s", sd, result)
    return result


# --------------------------------------------------------------------------
# Binaries and preflight
# --------------------------------------------------------------------------


def find_binaries() -> tuple[Path, Path]:
    """The ``mooncake_master`` and ``mooncake_client`` executables of the installed wheel.

    The ELF binaries inside the ``mooncake`` package folder are preferred to the
    console-script wrappers so that the recorded pid and command line are the
    server's own.
    """
    import importlib.util

    found: dict[str, Path] = {}
    spec = importlib.util.find_spec("mooncake")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for name in ("mooncake_master", "mooncake_client"):
        for folder in folders:
            p = Path(folder) / name
            if p.is_file():
                if not os.access(p, os.X_OK):
                    with contextlib.suppress(OSError):
                        p.chmod(p.stat().st_mode | 0o111)
                found[name] = p
                break
        else:
            w = shutil.which(name)
            if w:
                found[name] = Path(w)
    missing = [n for n in ("mooncake_master", "mooncake_client") if n not in found]
    if missing:
        raise StoreError(
            f"{' and '.join(missing)} not found: install Mooncake into this Python environment "
            "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1, or "
            "mooncake-transfer-engine==0.3.13.post1 on CUDA hosts)"
        )
    return found["mooncake_master"], found["mooncake_client"]


def missing_library_hint(text: str) -> str | None:
    """An install hint when ``text`` contains a dynamic-loader 'cannot open shared object' error."""
    m = _LOADER_ERROR.search(text) or re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object", text)
    if not m:
        return None
    lib = m.group(1)
    pkg = _LIB_PACKAGES.get(lib)
    if pkg:
        return f"shared library {lib} is missing: install it with `apt-get install {pkg}` (Debian/Ubuntu)"
    return f"shared library {lib} is missing: install the system package that provides it"


def _check_shared_libraries(binary: Path) -> None:
    ldd = shutil.which("ldd")
    if not ldd:
        return
    try:
        out = subprocess.run([ldd, str(binary)], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return
    missing = re.findall(r"^\s*(\S+) => not found", out, re.M)
    if missing:
        hints = [missing_library_hint(f"{lib}: cannot open shared object file") for lib in missing]
        raise StoreError(f"cannot run {binary.name}: " + "; ".join(h for h in hints if h))


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------

_PORT_NAMES = ("master_port", "metadata_port", "metrics_port", "client_port")


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True when ``port`` cannot be bound on ``host`` or on 0.0.0.0 (the metadata server binds all)."""
    for h in (host, "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((h, port))
            except OSError:
                return True
    return False


def free_port(exclude: set[int] | None = None) -> int:
    """A currently free TCP port on 127.0.0.1 (and 0.0.0.0), not in ``exclude``."""
    exclude = exclude or set()
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in exclude and not port_in_use(port):
            return port
    raise StoreError("could not find a free TCP port on 127.0.0.1")


def _choose_ports(spec: StoreSpec) -> dict[str, int]:
    given = {n: int(getattr(spec, n)) for n in _PORT_NAMES if getattr(spec, n) is not None}
    dup = {p for p in given.values() if list(given.values()).count(p) > 1}
    if dup:
        names = [n for n, p in given.items() if p in dup]
        raise StoreError(f"the same port {sorted(dup)} is given for {', '.join(names)}; give distinct ports")
    for name, port in given.items():
        if port_in_use(port):
            raise StoreError(
                f"port {port} ({name}) is already in use on this host; "
                f"free it, pass another {name}, or leave it unset to pick a free one"
            )
    ports = dict(given)
    for name in _PORT_NAMES:
        if name not in ports:
            ports[name] = free_port(set(ports.values()))
    return ports


def _can_connect(port: int, host: str = LOOPBACK, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> int:
    if log_path.exists():
        with contextlib.suppress(OSError):
            os.replace(log_path, log_path.with_suffix(".log.prev"))
    with open(log_path, "ab") as lf:
        lf.write(f"# {_iso(time.time())} started: {' '.join(cmd)}\n".encode())
        lf.flush()
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=lf,
                stderr=subprocess.STDOUT,
                cwd=str(cwd),
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            raise StoreError(f"cannot start {cmd[0]}: {e}") from e
    # The Popen object is dropped on purpose: the process is detached and
    # outlives us. We reap it ourselves (see _reap) if we stop it.
    _CHILDREN.add(proc.pid)
    return proc.pid


_CHILDREN: set[int] = set()


def _log_tail(path: Path | str, lines: int = 25) -> str:
    try:
        data = Path(path).read_bytes()[-16384:].decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


def _died(pid: int, name: str, log_path: Path, ports: dict[str, int]) -> StoreError:
    tail = _log_tail(log_path)
    hint = missing_library_hint(tail)
    if hint:
        return StoreError(f"{name} could not start: {hint}. Log {log_path}:\n{tail}")
    if re.search(r"address already in use|bind.*fail|failed to (listen|bind)", tail, re.I):
        taken = [f"{n}={p}" for n, p in ports.items() if port_in_use(p)]
        which = f" (in use now: {', '.join(taken)})" if taken else ""
        return StoreError(f"{name} could not bind a port{which}; pass free ports. Log {log_path}:\n{tail}")
    return StoreError(f"{name} (pid {pid}) exited during startup. Log {log_path}:\n{tail}")


def _wait_master(pid: int, log_path: Path, ports: dict[str, int], deadline: float, wait_s: float) -> None:
    url = f"http://{LOOPBACK}:{ports['metrics_port']}/health"
    while True:
        if not _pid_alive(pid):
            raise _died(pid, "mooncake_master", log_path, ports)
        h = _http_json(url, 0.5)
        if (
            isinstance(h, dict)
            and h.get("service_ready")
            and _can_connect(ports["master_port"])
            and _can_connect(ports["metadata_port"])
        ):
            return
        if time.monotonic() > deadline:
            raise StoreError(
                f"mooncake_master (pid {pid}) did not answer within {wait_s:g} s "
                f"(health {url}, rpc port {ports['master_port']}, metadata port {ports['metadata_port']}). "
                f"Log {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(0.1)


def _wait_storage(
    pid: int, log_path: Path, ports: dict[str, int], memory: int, deadline: float, wait_s: float
) -> None:
    url = f"http://{LOOPBACK}:{ports['metrics_port']}/metrics"
    while True:
        if not _pid_alive(pid):
            raise _died(pid, "mooncake_client (storage process)", log_path, ports)
        text = _http_text(url, 0.5)
        cap = int(parse_prometheus(text).get("master_total_capacity_bytes", 0)) if text else 0
        if cap >= memory and _can_connect(ports["client_port"]):
            return
        if time.monotonic() > deadline:
            raise StoreError(
                f"storage process mooncake_client (pid {pid}) did not mount its {_fmt_bytes(memory)} "
                f"segment within {wait_s:g} s (master reports capacity {cap}). "
                f"Log {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(0.1)


def _procs(st: StoreState) -> list[tuple[str, int, list[str]]]:
    return [("master", st.master_pid, st.master_cmdline), ("storage", st.client_pid, st.client_cmdline)]


def _log_of(st: StoreState, name: str) -> str:
    return st.master_log if name == "master" else st.client_log


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _reap(pid: int) -> None:
    if pid in _CHILDREN:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                _CHILDREN.discard(pid)
        except ChildProcessError:
            _CHILDREN.discard(pid)


def _pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie child of ours is reaped here)."""
    state = _proc_state(pid)
    if state is None:
        _CHILDREN.discard(pid)
        return False
    if state in ("Z", "X"):
        if pid in _CHILDREN:
            # Our child: reap it. waitpid reports nothing until every thread of a
            # multi-threaded process has exited, so until then it counts as alive.
            _reap(pid)
            return pid in _CHILDREN
        return False
    return True


def _pid_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _pid_matches(pid: int, cmd: list[str]) -> bool:
    return _pid_alive(pid) and _pid_cmdline(pid) == list(cmd)


def _terminate(pid: int, cmd: list[str] | None, grace_s: float) -> None:
    """SIGTERM, wait ``grace_s``, SIGKILL; re-checks the command line before each signal."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _pid_alive(pid) or (cmd is not None and _pid_cmdline(pid) != list(cmd)):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if not _pid_alive(pid):
                return
            time.sleep(0.05)


@contextlib.contextmanager
def _locked(sd: Path):
    with open(sd / LOCK_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------
# HTTP helpers
# --------------------------------------------------------------------------


def _http_text(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback URL we built)
            return r.read().decode(errors="replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _http_json(url: str, timeout: float) -> Any:
    text = _http_text(url, timeout)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_prometheus(text: str | None) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: ``{name: value}``."""
    out: dict[str, float] = {}
    for line in (text or "").splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) >= 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = float(parts[1])
    return out


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
