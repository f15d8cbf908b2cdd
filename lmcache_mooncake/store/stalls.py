"""What this process's threads are doing while a Mooncake call is slow.

Who calls: the store client's call watcher (``calls._Worker``), on its own
thread, once per call that has run ``LMCACHE_MOONCAKE_SLOW_CALL_S`` seconds
(default 2; 0 turns the watcher off). :func:`thread_summary` gives the one
line the warning carries; :func:`dump`, only where
``LMCACHE_MOONCAKE_STALL_DUMP`` names a folder, writes every thread's state,
kernel stack and Python stack there and starts ``gdb`` for the native stacks.

Everything is read from ``/proc/self``, which needs no lock of this process's
memory map (``ps`` blocks on ``/proc/<pid>/cmdline`` while that lock is held;
reading ``stat``, ``wchan`` and ``stack`` does not). Why it exists:
docs/reliability.md, "Mooncake's TCP stall".
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

_TASKS = Path("/proc/self/task")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError as e:
        return f"({e.strerror or e})"


def _threads() -> list[tuple[int, str, str, str]]:
    """(tid, name, state letter, kernel wait channel) of every thread of this process."""
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(_TASKS))
    except OSError:
        return out
    for tid in tids:
        stat = _read(_TASKS / str(tid) / "stat")
        name, _, rest = stat.partition(" (")[2].rpartition(") ")
        state = rest.split(" ", 1)[0] if rest else "?"
        wchan = _read(_TASKS / str(tid) / "wchan")
        out.append((tid, name, state, wchan if wchan not in ("0", "") else "-"))
    return out


def _pressure() -> str:
    """The last 10 s of CPU, memory and I/O pressure (PSI), where the kernel has it."""
    parts = []
    for what in ("cpu", "memory", "io"):
        text = _read(Path("/proc/pressure") / what)
        if text.startswith("some"):
            avg10 = text.split()[1].split("=")[1]
            parts.append(f"{what} {avg10}%")
    return ", ".join(parts)


def thread_summary() -> str:
    """One line: thread states, the commonest kernel waits, the load and pressure."""
    threads = _threads()
    states = collections.Counter(s for _, _, s, _ in threads)
    waits = collections.Counter(w for _, _, s, w in threads if s != "R")
    load = _read(Path("/proc/loadavg")).split(" ")[:3]
    pressure = _pressure()
    return (f"{len(threads)} ({', '.join(f'{s} {n}' for s, n in states.most_common())}); waiting in "
            f"{', '.join(f'{w} {n}' for w, n in waits.most_common(4)) or 'nothing'}; "
            f"load {' '.join(load)}" + (f"; pressure (10 s) {pressure}" if pressure else ""))


def dump(folder: Path, headline: str) -> Path:
    """Write what every thread is doing to ``folder/stall-<pid>-<time>.txt``; return its path.

    Then start ``gdb`` (when installed) to append every thread's native stack
    to ``<that path>.gdb``; it stops the process for a few seconds while it
    reads them, which is why the dump is only made where asked for.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"stall-{os.getpid()}-{time.strftime('%H%M%S')}-{time.monotonic_ns() % 10**6}.txt"
    lines = [headline, f"at {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}",
             f"loadavg {_read(Path('/proc/loadavg'))}"]
    for what in ("cpu", "memory", "io"):
        lines.append(f"pressure {what}: {_read(Path('/proc/pressure') / what)}".replace("\n", " | "))
    status = _read(Path("/proc/self/status")).splitlines()
    lines += [s for s in status if s.split(":")[0] in ("VmRSS", "VmSize", "Threads", "voluntary_ctxt_switches",
                                                       "nonvoluntary_ctxt_switches")]
    lines.append("")
    for tid, name, state, wchan in _threads():
        cpus = next((s.split(":", 1)[1].strip() for s in _read(_TASKS / str(tid) / "status").splitlines()
                     if s.startswith("Cpus_allowed_list")), "?")
        lines.append(f"thread {tid} {name!r} state {state} wchan {wchan} cpus {cpus}")
        stack = _read(_TASKS / str(tid) / "stack")
        lines += [f"    {s}" for s in stack.splitlines()]
    lines.append("")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        lines.append(f"python thread {names.get(ident, ident)}:")
        lines += [f"    {s.rstrip()}" for s in traceback.format_stack(frame)]
    path.write_text("\n".join(lines) + "\n")
    gdb = shutil.which("gdb")
    if gdb:
        with open(f"{path}.gdb", "wb") as out:
            subprocess.Popen([gdb, "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt"],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    return path
