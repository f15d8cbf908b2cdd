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

What is started and recorded is in :mod:`lmcache_mooncake.store.state`, the
binaries in :mod:`lmcache_mooncake.store.binaries`, process and port helpers
in :mod:`lmcache_mooncake.runtime.procs`.

A JSON state file (``store.json``) in the state folder records pids, ports,
command lines, log paths and the start time; :func:`store_status` and
:func:`stop_store` work from it. :func:`stop_store` only signals a recorded
pid whose command line (read with ``psutil``) still equals the recorded command line.

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
import json
import logging
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from lmcache_mooncake.runtime import procs
from lmcache_mooncake.runtime.procs import format_bytes, free_port, port_in_use, tail_log
from lmcache_mooncake.store.binaries import check_shared_libraries, find_binaries, missing_library_hint
from lmcache_mooncake.store.errors import StoreError
from lmcache_mooncake.store.state import (
    LOCK_FILE,
    STATE_FILE,
    StoreSpec,
    StoreState,
    default_state_dir,
    iso_time,
    read_state,
)

__all__ = [
    "ALL_INTERFACES_WARNING",
    "StoreError",
    "StoreSpec",
    "StoreState",
    "default_state_dir",
    "find_binaries",
    "free_port",
    "missing_library_hint",
    "parse_prometheus",
    "port_in_use",
    "read_state",
    "restart_storage",
    "start_store",
    "stop_store",
    "store_status",
]

log = logging.getLogger(__name__)

ALL_INTERFACES_WARNING = (
    "Mooncake's HTTP metadata server and the storage process's data-transfer ports "
    "listen on ALL network interfaces (0.0.0.0), whatever address is configured, "
    "without authentication (so do the transfer ports of every client in 'tcp' mode). "
    "Anyone who can reach this host can read and write the cache. Firewall these "
    "ports or use this only on a host whose network you trust."
)

# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


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
        check_shared_libraries(master_bin)
        ports = _choose_ports(spec)
        env = dict(os.environ)
        host = spec.host
        env["MC_TCP_BIND_ADDRESS"] = host  # the address the storage process advertises to clients

        master_cmd = [
            str(master_bin),
            f"--rpc_address={host}",
            f"--rpc_port={ports['master_port']}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={ports['metadata_port']}",
            f"--metrics_host={host}",
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
            f"--host={host}",
            f"--port={ports['client_port']}",
            f"--master_server_address={host}:{ports['master_port']}",
            f"--metadata_server=http://{host}:{ports['metadata_port']}/metadata",
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
            _wait_master(host, mpid, master_log, ports, deadline, spec.wait_s)
            cpid = _spawn(client_cmd, client_log, env, sd)
            started.append(cpid)
            _wait_storage(host, cpid, client_log, ports, spec.memory_bytes, deadline, spec.wait_s)
        except BaseException:
            for pid in reversed(started):
                _terminate(pid, None, grace_s=3.0)
            raise
        state = StoreState(
            state_dir=sd,
            host=host,
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
        format_bytes(spec.memory_bytes),
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
      (pid alive and its command line equals the recorded one).
    - ``healthy``: running, the master's ``/health`` says ``service_ready`` and
      the storage segment is mounted (capacity > 0).
    - ``addresses``: ``master_addr``, ``metadata_url`` (tcp-mode clients),
      ``client_addr`` (shm-mode clients), ``metrics_url``.
    - ``capacity_bytes``, ``used_bytes``, ``free_bytes``, ``object_count``,
      ``clients`` (live Mooncake clients incl. the storage process),
      ``evicted_keys``, ``evicted_bytes``, ``eviction_rounds``,
      ``soft_pinned_objects`` (Mooncake 0.3.13's master counts soft pins only, in
      objects, not bytes; hard pins are not reported),
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
        started_at=iso_time(st.started_at),
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
        soft_pinned_objects=int(m.get("master_soft_pin_key_count", 0)),
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


def restart_storage(state_dir: Path | str | None = None, timeout_s: float = 30.0) -> StoreState:
    """Start the recorded storage process again, with its recorded command line (same ports),
    stopping it first if it still runs; the master is left as it is.

    For a storage process that crashed or was killed: the objects it held are
    gone (the master forgets them), clients reconnect by themselves. Returns
    once the master places new objects in the new process only (it keeps the
    old segment for its ``client_ttl``, 10 s by default), with the updated state; :class:`StoreError` if no store is recorded or the
    process does not come up within ``timeout_s``.
    """
    sd = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
    with _locked(sd):
        st = read_state(sd)
        if st is None:
            raise StoreError(f"no store recorded in {sd}; start one with: lmcache-mooncake store up")
        if _pid_matches(st.client_pid, st.client_cmdline):
            _terminate(st.client_pid, st.client_cmdline, grace_s=timeout_s)
        env = dict(os.environ)
        env["MC_TCP_BIND_ADDRESS"] = st.host
        ports = {n: int(getattr(st, n)) for n in _PORT_NAMES}
        cpid = _spawn(st.client_cmdline, Path(st.client_log), env, sd)
        try:
            _wait_storage(st.host, cpid, Path(st.client_log), ports, st.memory_bytes, time.monotonic() + timeout_s,
                          timeout_s)
        except BaseException:
            _terminate(cpid, None, grace_s=3.0)
            raise
        st.client_pid = cpid
        st.write()
        # Until the master drops the dead process's segment (client_ttl after its
        # last heartbeat) it still places new objects there, and those writes fail.
        url = f"{st.metrics_url}/metrics"
        procs.wait_until(
            lambda: 0 < parse_prometheus(_http_text(url, 0.5)).get("master_total_capacity_bytes", 0)
            <= st.memory_bytes,
            alive=lambda: _pid_alive(cpid), deadline=time.monotonic() + timeout_s, interval_s=0.2,
            on_exit=lambda: _died(cpid, "mooncake_client (storage process)", Path(st.client_log), ports),
            on_timeout=lambda: StoreError(
                f"the master at {st.master_addr} still counts the old storage process's memory "
                f"{timeout_s:g} s after the restart; check {st.master_log}"),
        )
    log.info("Mooncake storage process in %s restarted (pid %d)", sd, cpid)
    return st


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------

_PORT_NAMES = ("master_port", "metadata_port", "metrics_port", "client_port")


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
            try:
                ports[name] = free_port(set(ports.values()))
            except OSError as e:
                raise StoreError(str(e)) from e
    return ports


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> int:
    if log_path.exists():
        with contextlib.suppress(OSError):
            os.replace(log_path, log_path.with_suffix(".log.prev"))
    try:
        proc = procs.spawn(cmd, log_path, env=env, cwd=cwd, mode="ab",
                           header=f"# {iso_time(time.time())} started: {' '.join(cmd)}\n")
    except OSError as e:
        raise StoreError(f"cannot start {cmd[0]}: {e}") from e
    # The Popen object is dropped on purpose: the process is detached and
    # outlives us. We reap it ourselves (see _reap) if we stop it.
    _CHILDREN.add(proc.pid)
    return proc.pid


_CHILDREN: set[int] = set()


def _died(pid: int, name: str, log_path: Path, ports: dict[str, int]) -> StoreError:
    tail = tail_log(log_path)
    hint = missing_library_hint(tail)
    if hint:
        return StoreError(f"{name} could not start: {hint}. Log {log_path}:\n{tail}")
    if re.search(r"address already in use|bind.*fail|failed to (listen|bind)", tail, re.I):
        taken = [f"{n}={p}" for n, p in ports.items() if port_in_use(p)]
        which = f" (in use now: {', '.join(taken)})" if taken else ""
        return StoreError(f"{name} could not bind a port{which}; pass free ports. Log {log_path}:\n{tail}")
    return StoreError(f"{name} (pid {pid}) exited during startup. Log {log_path}:\n{tail}")


def _wait_master(host: str, pid: int, log_path: Path, ports: dict[str, int], deadline: float,
                 wait_s: float) -> None:
    url = f"http://{host}:{ports['metrics_port']}/health"

    def ready() -> bool:
        h = _http_json(url, 0.5)
        return (
            isinstance(h, dict)
            and bool(h.get("service_ready"))
            and procs.can_connect(host, ports["master_port"], 0.5)
            and procs.can_connect(host, ports["metadata_port"], 0.5)
        )

    _wait_ready(pid, "mooncake_master", log_path, ports, deadline, ready, lambda: (
        f"mooncake_master (pid {pid}) did not answer within {wait_s:g} s "
        f"(health {url}, rpc port {ports['master_port']}, metadata port {ports['metadata_port']})"
    ))


def _wait_storage(
    host: str, pid: int, log_path: Path, ports: dict[str, int], memory: int, deadline: float, wait_s: float
) -> None:
    url = f"http://{host}:{ports['metrics_port']}/metrics"
    cap = 0

    def ready() -> bool:
        nonlocal cap
        text = _http_text(url, 0.5)
        cap = int(parse_prometheus(text).get("master_total_capacity_bytes", 0)) if text else 0
        return cap >= memory and procs.can_connect(host, ports["client_port"], 0.5)

    _wait_ready(pid, "mooncake_client (storage process)", log_path, ports, deadline, ready, lambda: (
        f"storage process mooncake_client (pid {pid}) did not mount its {format_bytes(memory)} "
        f"segment within {wait_s:g} s (master reports capacity {cap})"
    ))


def _wait_ready(pid: int, name: str, log_path: Path, ports: dict[str, int], deadline: float,
                ready: Callable[[], bool], not_ready: Callable[[], str]) -> None:
    """Poll ``ready`` every 0.1 s; a :class:`StoreError` with the log's tail if the process dies or
    ``deadline`` passes (``not_ready()`` says what was missing)."""
    procs.wait_until(
        ready, alive=lambda: _pid_alive(pid), deadline=deadline, interval_s=0.1,
        on_exit=lambda: _died(pid, name, log_path, ports),
        on_timeout=lambda: StoreError(f"{not_ready()}. Log {log_path}:\n{tail_log(log_path)}"),
    )


def _procs(st: StoreState) -> list[tuple[str, int, list[str]]]:
    return [("master", st.master_pid, st.master_cmdline), ("storage", st.client_pid, st.client_cmdline)]


def _log_of(st: StoreState, name: str) -> str:
    return st.master_log if name == "master" else st.client_log


def _reap(pid: int) -> None:
    if pid in _CHILDREN:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                _CHILDREN.discard(pid)
        except ChildProcessError:
            _CHILDREN.discard(pid)


def _pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie child of ours is reaped here)."""
    state = procs.pid_status(pid)
    if state is None:
        _CHILDREN.discard(pid)
        return False
    if state in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        if pid in _CHILDREN:
            # Our child: reap it. waitpid reports nothing until every thread of a
            # multi-threaded process has exited, so until then it counts as alive.
            _reap(pid)
            return pid in _CHILDREN
        return False
    return True


def _pid_matches(pid: int, cmd: list[str]) -> bool:
    return _pid_alive(pid) and procs.pid_cmdline(pid) == list(cmd)


def _terminate(pid: int, cmd: list[str] | None, grace_s: float) -> None:
    """SIGTERM, wait ``grace_s``, SIGKILL; re-checks the command line before each signal."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _pid_alive(pid) or (cmd is not None and procs.pid_cmdline(pid) != list(cmd)):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if not _pid_alive(pid):
                return
            time.sleep(0.05)


def _locked(sd: Path) -> contextlib.AbstractContextManager[None]:
    return procs.file_lock(sd / LOCK_FILE)


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
    """Unlabelled samples of a Prometheus text exposition: ``{name: value}``.

    Parsed with ``prometheus_client``'s parser; text it cannot parse gives the
    samples read before the bad line. The parser names every counter sample
    ``<family>_total``; Mooncake exposes some counters without that suffix
    (``master_evicted_key_count``), so a counter is also found under its family
    name.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    with contextlib.suppress(ValueError, TypeError, IndexError):
        for family in text_string_to_metric_families(text or ""):
            for sample in family.samples:
                if sample.labels:
                    continue
                out[sample.name] = float(sample.value)
                if family.type == "counter" and sample.name == f"{family.name}_total":
                    out.setdefault(family.name, float(sample.value))
    return out
