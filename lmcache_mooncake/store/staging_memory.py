"""The registered staging region of a store client: the memory every Mooncake call moves data through.

:class:`StagingMemory` is owned by one
:class:`~lmcache_mooncake.store.client.StoreClient` for its lifetime. The
client calls :meth:`StagingMemory.attach` on its worker thread after each
Mooncake setup and :meth:`StagingMemory.release` before it closes that
Mooncake client; :mod:`lmcache_mooncake.store.staging` and
:mod:`lmcache_mooncake.store.direct` read and write it through :attr:`ptr`,
:meth:`view` and :meth:`as_tensor`.

- ``tcp`` mode: private anonymous memory (``mmap``), made once and kept across
  reconnections (only its registration is redone).
- ``shm`` mode: shared memory from Mooncake's memfd pool, which the storage
  process maps; allocated anew at each attach, its pages given back
  (``madvise(MADV_REMOVE)``) at release, since Mooncake has no call to free it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import time
from typing import Any

log = logging.getLogger(__name__)

_MADV_REMOVE = 9


class StagingMemory:
    """``size`` bytes registered with the Mooncake client of a ``mode`` ("tcp" or "shm") store client.

    :attr:`ptr` is 0 while no region is attached (``shm`` mode before attach or after release).
    :attr:`mem` is the Python object that keeps the memory alive (an ``mmap`` or a ctypes array).
    """

    def __init__(self, size: int, mode: str):
        self.size = size
        self.mode = mode
        self.ptr = 0
        self.mem: Any = None
        self._tensor: Any = None

    def attach(self, store: Any, timeout_s: float) -> str | None:
        """Get (``shm``: allocate) the region, touch its pages and register it with ``store``.

        On the client's worker thread, during a setup. Returns None, or why it failed (the
        caller then closes ``store``). ``timeout_s``: the client's call timeout, which bounds
        the ``shm`` prefault (:meth:`prefault_for_storage`)."""
        size = self.size
        if self.mode == "shm":
            # Shared memory the storage process maps: Mooncake's memfd pool.
            ptr = int(store.alloc_from_mem_pool(size))
            if not ptr:
                return f"cannot allocate {size} bytes of shared memory (alloc_from_mem_pool)"
            mem = (ctypes.c_char * size).from_address(ptr)
        else:
            if self.mem is None:
                mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self.mem = mm
                self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            ptr, mem = self.ptr, self.mem
        # Touch every page now, at connect: a first load would otherwise pay the
        # page faults (about 3x a warm copy of the same bytes, measured).
        ctypes.memset(ptr, 0, size)
        rc = store.register_buffer(ptr, size)
        if rc != 0:
            return f"register_buffer of the {size}-byte staging region returned {rc}"
        self.ptr, self.mem, self._tensor = ptr, mem, None
        if self.mode == "shm":
            self.prefault_for_storage(store, ptr, size, timeout_s)
        return None

    def prefault_for_storage(self, store: Any, ptr: int, size: int, timeout_s: float) -> None:
        """Make the storage process write every page of our shared staging region once, now.

        In ``shm`` mode the storage process copies objects into the region through its own
        mapping of it, and its first write to each page is a page fault there: a first load
        of 192 MiB took 88-118 ms to arrive against 22-27 ms once the pages were mapped
        (``docs/performance.md``). Touching the pages ourselves does not map them in the
        other process, so one small object (at most 4 MiB of store memory, removed at once)
        is put from the region and got into each slice of it in turn. About 0.9 ms per MiB,
        at connect; best effort: anything failing only leaves the faults to the first loads.
        It stops after half the client's timeout (2 s at most): a reconnection runs it while
        a caller waits, and the setup around it must still fit that caller's timeout.
        """
        piece = min(4 << 20, size)
        key = f"lmcm/_prefault/{os.getpid()}-{id(self):x}-{time.monotonic_ns():x}"
        t0 = time.monotonic()
        budget = min(2.0, timeout_s / 2)
        try:
            if list(store.batch_put_from([key], [ptr], [piece])) != [0]:
                return
            try:
                for off in range(0, size - piece + 1, piece):
                    if store.batch_get_into([key], [ptr + off], [piece])[0] != piece or time.monotonic() - t0 > budget:
                        return
            finally:
                store.batch_remove([key], True)
        except Exception as e:  # noqa: BLE001 - an optimisation; never a reason not to connect
            log.debug("Mooncake store client: prefaulting the staging region failed: %s", e)
            return
        log.debug("Mooncake store client: the storage process mapped the %d-byte staging region in %.0f ms",
                  size, (time.monotonic() - t0) * 1e3)

    def release(self, store: Any) -> None:
        """Unregister the region from ``store`` (on the worker thread, before ``store`` is closed);
        in ``shm`` mode also give its pages back and forget it. Never raises."""
        if not self.ptr:
            return
        with contextlib.suppress(Exception):
            store.unregister_buffer(self.ptr)
        if self.mode == "shm":
            # Mooncake has no Python call to free pool memory; give its pages back.
            with contextlib.suppress(Exception):
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise(ctypes.c_void_p(self.ptr), ctypes.c_size_t(self.size), _MADV_REMOVE)
            self.ptr, self.mem, self._tensor = 0, None, None

    def view(self, off: int, n: int) -> memoryview:
        """``n`` bytes of the region from offset ``off`` (no copy; valid while the region is attached)."""
        return memoryview((ctypes.c_char * n).from_address(self.ptr + off)).cast("B")

    def as_tensor(self) -> Any:
        """The whole region as a 1-D ``torch.uint8`` tensor (no copy; made once per attach)."""
        import torch

        if self._tensor is None:
            mem = (ctypes.c_char * self.size).from_address(self.ptr)
            self._tensor = torch.frombuffer(mem, dtype=torch.uint8)
        return self._tensor
