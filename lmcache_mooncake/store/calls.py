"""What the store client's calls are made of: caller buffers reduced to addresses, and
the one daemon thread that runs Mooncake calls, so a caller can stop waiting for one.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_mooncake.runtime import affinity
from lmcache_mooncake.store import stalls

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------


class _Buf:
    """A caller's buffer reduced to (address, size), or a torch device tensor, or parts."""

    __slots__ = ("ptr", "nbytes", "tensor", "keep", "parts")

    def __init__(self, ptr: int | None, nbytes: int, tensor: Any = None, keep: Any = None,
                 parts: list[_Buf] | None = None):
        self.ptr = ptr
        self.nbytes = nbytes
        self.tensor = tensor  # set only for non-CPU torch tensors (copied with torch)
        self.keep = keep
        self.parts = parts  # a put of several buffers stored back to back as one object


def _resolve(buf: Any, writable: bool) -> _Buf | None:
    if isinstance(buf, tuple) and not writable:
        parts = [_resolve(b, writable) for b in buf]
        if any(p is None for p in parts):
            return None
        return _Buf(None, sum(p.nbytes for p in parts), parts=parts)  # type: ignore[union-attr]
    return _resolve_one(buf, writable)


def _resolve_one(buf: Any, writable: bool) -> _Buf | None:
    mod = type(buf).__module__ or ""
    if mod.startswith("torch") and hasattr(buf, "data_ptr"):
        t = buf
        if not t.is_contiguous():
            return None
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu":
            return _Buf(t.data_ptr(), nbytes, keep=t)
        return _Buf(None, nbytes, tensor=t)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous or (writable and not buf.flags.writeable):
            return None
        return _Buf(int(buf.ctypes.data), int(buf.nbytes), keep=buf)
    try:
        mv = memoryview(buf)
    except TypeError:
        return None
    if not mv.c_contiguous or (writable and mv.readonly):
        return None
    if mv.nbytes == 0:
        return _Buf(0, 0, keep=mv)
    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    return _Buf(int(arr.ctypes.data), int(mv.nbytes), keep=(mv, arr))


# --------------------------------------------------------------------------
# Worker thread
# --------------------------------------------------------------------------


class _Job:
    __slots__ = ("fn", "what", "limit_s", "done", "result", "error", "started", "abandoned", "reported")

    def __init__(self, fn: Callable[[], Any], what: str = "call", limit_s: float | None = None):
        self.fn = fn
        #: The Mooncake call, as logs name it, and how long its caller waits for it.
        self.what, self.limit_s = what, limit_s
        #: The watcher reported it as slow.
        self.reported = False
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        #: ``time.monotonic()`` when the worker began the call (None: queued).
        self.started: float | None = None
        #: What the caller called it and when it stopped waiting, once it timed out.
        self.abandoned: tuple[str, float] | None = None

    def abandon(self, what: str) -> None:
        """The caller gave up waiting (timeout): when the call ends, the worker logs how late."""
        self.abandoned = (what, time.monotonic())


class _Worker:
    """One daemon thread running Mooncake calls one at a time.

    A daemon thread (not a ThreadPoolExecutor, whose threads are joined at
    interpreter exit) so a call hung inside Mooncake cannot block exit.
    """

    #: A call running this long is logged once, with what the process's threads are doing
    #: (or half its caller's limit, if that is sooner: see :meth:`report_after`).
    SLOW_S = 2.0

    def __init__(self, name: str):
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.current: _Job | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        slow = os.environ.get("LMCACHE_MOONCAKE_SLOW_CALL_S", "")
        self.slow_s = float(slow) if slow else self.SLOW_S
        self._watcher: threading.Thread | None = None
        if self.slow_s > 0:
            self._watcher = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)
            self._watcher.start()

    def report_after(self, job: _Job) -> float:
        """Seconds after which ``job`` is reported: ``slow_s``, or half its caller's limit when that
        is sooner, so a call is seen while it still runs even where the caller gives up at or
        before ``slow_s`` (a store get's default ``mooncake.timeout`` is 2 s, as ``slow_s``)."""
        return min(self.slow_s, job.limit_s / 2) if job.limit_s else self.slow_s

    def _watch(self) -> None:
        """Report a call that has run ``report_after(job)`` once, while it still runs (docs/reliability.md,
        "Mooncake's TCP stall"): the caller only learns of it at its timeout, and then the
        moment to see what the process was doing has passed."""
        tick = 0.25
        last = time.monotonic()
        while not self._stopped.wait(tick):
            now = time.monotonic()
            late, last = now - last - tick, now
            job = self.current
            if job is None or job.reported or job.started is None or job.done.is_set():
                continue
            if now - job.started < self.report_after(job):
                continue
            job.reported = True
            limit = f"its caller waits {job.limit_s:.3g} s" if job.limit_s else "no caller limit"
            woke = f"; this watcher woke {late:.1f} s late (the process did not run)" if late > 0.5 else ""
            log.warning("Mooncake %s has run %.1f s (%s)%s; threads: %s", job.what, now - job.started,
                        limit, woke, stalls.thread_summary())
            dump_dir = os.environ.get("LMCACHE_MOONCAKE_STALL_DUMP", "")
            if dump_dir:
                path = stalls.dump(Path(dump_dir), f"Mooncake {job.what} running {now - job.started:.1f} s"
                                   f"{woke}")
                log.warning("what every thread was doing: %s", path)

    def _loop(self) -> None:
        # Mooncake's transfer threads, started by ``setup`` on this thread, inherit its cores.
        affinity.widen_current_thread(self._thread.name)
        while True:
            job = self._q.get()
            if job is None:
                return
            job.started = time.monotonic()
            try:
                job.result = job.fn()
            except BaseException as e:  # noqa: BLE001 - reported to the caller as ERR_INTERNAL
                job.error = e
            finally:
                job.done.set()
                late = job.abandoned
                if late is not None:
                    # A timed-out call that did end: say so, with how long it really took
                    # (docs/reliability.md, "Mooncake's TCP stall").
                    now = time.monotonic()
                    log.warning("Mooncake %s ended %.1f s after its caller gave up (%.1f s in all, %s)",
                                late[0], now - late[1], now - job.started,
                                "raised" if job.error is not None else "returned")

    def busy(self) -> bool:
        job = self.current
        return job is not None and not job.done.is_set()

    def submit(self, fn: Callable[[], Any], what: str = "call", limit_s: float | None = None) -> _Job:
        job = _Job(fn, what, limit_s)
        self.current = job
        self._q.put(job)
        return job

    def stop(self) -> None:
        self._stopped.set()
        self._q.put(None)


class _Sized:
    """A get destination that is only a size: the bytes are handed to a visitor in staging."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)


# Resources that an abandoned Mooncake call may still use; kept alive for the process.
_ABANDONED: list[Any] = []


def _tensor_bytes(t: Any) -> Any:
    """A contiguous tensor's storage as a flat uint8 view (same memory)."""
    import torch

    return t.reshape(-1).view(torch.uint8)
