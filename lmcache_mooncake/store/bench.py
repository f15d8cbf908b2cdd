"""Measure put/get bandwidth to an embedded store: ``tcp`` vs ``shm`` client mode vs memcpy.

Run: ``python -m lmcache_mooncake.store.bench [--memory-gib 4] [--sizes-mib 1,4,16]``.
It starts a store in a temporary folder, runs every mode in a fresh child
process (as a vLLM worker would be), prints one JSON line per result and
stops the store. The store's memory is written once first (see
:func:`_prefault`) and every run deletes its objects, so the numbers are for a
warm store. ``client`` numbers are through :class:`StoreClient` (including
its copy to/from the staging region); ``native`` numbers are the Mooncake call
alone on the registered staging region; ``memcpy`` is numpy copying the same
bytes in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

MiB = 1 << 20


def _check(call: str, results: list, expected: int, mode: str, size: int) -> None:
    """Raise RuntimeError unless every value of ``results`` (one per key of ``call``) is ``expected``."""
    wrong = [(i, r) for i, r in enumerate(results) if r != expected]
    if wrong:
        raise RuntimeError(
            f"{call} ({mode} mode, {size}-byte objects): {len(wrong)} of {len(results)} results are not "
            f"{expected}; first (index, result): {wrong[:4]}"
        )


def _child(state_dir: str, mode: str, size: int, batch_bytes: int, iters: int) -> None:
    from lmcache_mooncake.store.client import StoreClient

    n = max(batch_bytes // size, 1)
    c = StoreClient.from_state(state_dir, mode=mode, local_buffer_bytes=n * size, timeout_s=30)
    src = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(n)]
    dst = [np.empty(size, dtype=np.uint8) for _ in range(n)]
    big_src = np.random.randint(0, 255, n * size, dtype=np.uint8)
    big_dst = np.empty_like(big_src)
    np.copyto(big_dst, big_src)
    res: dict[str, list[float]] = {
        k: [] for k in ("client_put", "client_get", "native_put", "native_get", "memcpy")
    }
    gb = n * size / 1e9
    for _ in range(iters):
        keys = [f"bench-{uuid.uuid4().hex}-{i}" for i in range(n)]
        t = time.perf_counter()
        r = c.batch_put(keys, src)
        res["client_put"].append(gb / (time.perf_counter() - t))
        _check("StoreClient.batch_put", r, 0, mode, size)
        t = time.perf_counter()
        r = c.batch_get_into(keys, dst)
        res["client_get"].append(gb / (time.perf_counter() - t))
        _check("StoreClient.batch_get_into", r, size, mode, size)
        _check("StoreClient.batch_get_into (bytes equal to those put)",
               [bool((a == b).all()) for a, b in zip(src, dst, strict=True)], True, mode, size)
        # The Mooncake call alone, on the already registered staging region.
        store, base = c._store, c._staging.ptr
        keys2 = [f"bench-{uuid.uuid4().hex}-{i}" for i in range(n)]
        ptrs = [base + i * size for i in range(n)]
        t = time.perf_counter()
        r = store.batch_put_from(keys2, ptrs, [size] * n)
        res["native_put"].append(gb / (time.perf_counter() - t))
        _check("Mooncake batch_put_from", list(r), 0, mode, size)
        t = time.perf_counter()
        r = store.batch_get_into(keys2, ptrs, [size] * n)
        res["native_get"].append(gb / (time.perf_counter() - t))
        _check("Mooncake batch_get_into", list(r), size, mode, size)
        t = time.perf_counter()
        np.copyto(big_dst, big_src)
        res["memcpy"].append(gb / (time.perf_counter() - t))
    c._store.remove_all(True)  # free what we stored so the next run reuses touched pages
    c.close()
    out = {"mode": mode, "object_mib": size / MiB, "batch_mib": n * size / MiB, "iters": iters}
    out.update({k: round(statistics.median(v), 2) for k, v in res.items()})
    out["unit"] = "GB/s (median)"
    print(json.dumps(out), flush=True)


def _prefault(state_dir: str, nbytes: int) -> None:
    """Write ``nbytes`` once and delete it: Mooncake 0.3.13 does not pre-fault the
    storage segment, so the first write to each page pays a page fault (about
    1 GB/s here); a long-running store is past that. Without this the first
    puts measure the kernel, not the store."""
    from lmcache_mooncake.store.client import StoreClient

    c = StoreClient.from_state(state_dir, mode="shm", local_buffer_bytes=64 * MiB, timeout_s=60)
    buf = np.ones(64 * MiB, dtype=np.uint8)
    for i in range(nbytes // (64 * MiB)):
        c.batch_put([f"prefault-{i}"], [buf])
    c._store.remove_all(True)
    c.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmcache_mooncake.store.bench", description=__doc__)
    p.add_argument("--memory-gib", type=float, default=4.0)
    p.add_argument("--sizes-mib", default="1,4,16")
    p.add_argument("--batch-mib", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--modes", default="tcp,shm")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        sd, mode, size, batch, iters = a.child
        _child(sd, mode, int(size), int(batch), int(iters))
        return 0
    from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store

    with tempfile.TemporaryDirectory(prefix="mc-bench-") as td:
        start_store(StoreSpec(memory_bytes=int(a.memory_gib * (1 << 30)), state_dir=Path(td)))
        try:
            _prefault(td, int(a.memory_gib * 0.85 * (1 << 30)))
            for size_mib in (float(s) for s in a.sizes_mib.split(",")):
                for mode in a.modes.split(","):
                    args = [td, mode, str(int(size_mib * MiB)), str(a.batch_mib * MiB), str(a.iters)]
                    r = subprocess.run(
                        [sys.executable, "-m", "lmcache_mooncake.store.bench", "--child", *args],
                        capture_output=True,
                        text=True,
                    )
                    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                    print(lines[-1] if lines else f"{mode} {size_mib} MiB failed:\n{r.stderr[-2000:]}")
        finally:
            stop_store(td)
    return 0


if __name__ == "__main__":
    sys.exit(main())
