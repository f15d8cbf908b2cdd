"""What the store client's calls are made of: caller buffers reduced to addresses, and
the one daemon thread that runs Mooncake calls, so a caller can stop waiting for one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

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
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _Worker:
    """One daemon thread running Mooncake calls one at a time.

    A daemon thread (not a ThreadPoolExecutor, whose threads are joined at
    interpreter exit) so a call hung inside Mooncake cannot block exit.
    """

    def __init__(self, name: str):
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.current: _Job | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as e:  # noqa: BLE001 - reported to the caller as ERR_INTERNAL
                job.error = e
            finally:
                job.done.set()

    def busy(self) -> bool:
        job = self.current
        return job is not None and not job.done.is_set()

    def submit(self, fn: Callable[[], Any]) -> _Job:
        job = _Job(fn)
        self.current = job
        self._q.put(job)
        return job

    def stop(self) -> None:
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
