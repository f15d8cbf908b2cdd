"""HeapTrimmer: freed heap memory goes back to the OS (glibc), and nothing happens when it is off."""

from __future__ import annotations

import gc
import time

import psutil
import pytest

from lmcache_mooncake.runtime.heap import HeapTrimmer, trim_due

MiB = 1 << 20


def _fragment() -> list[bytearray]:
    """Blocks that glibc serves from the heap (after one freed mmapped block raised its
    threshold), with every other one freed: holes a plain free() keeps resident."""
    big = bytearray(2 * MiB)
    del big  # freeing an mmapped block raises glibc's mmap threshold past it
    blocks = [bytearray(1 * MiB) for _ in range(128)]
    for b in blocks:
        b[::4096] = b"\1" * len(b[::4096])  # touch every page
    keep = blocks[1::2]
    del blocks
    gc.collect()
    return keep


def test_trim_gives_freed_heap_back():
    trimmer = HeapTrimmer(3600)  # the thread would wait an hour: trim by hand
    try:
        if not trimmer.active:
            pytest.skip("no glibc malloc_trim here (another allocator or libc)")
        keep = _fragment()
        before = psutil.Process().memory_info().rss
        assert trimmer.trim()
        after = psutil.Process().memory_info().rss
        assert before - after > 32 * MiB, (before / MiB, after / MiB)
        assert trimmer.trims == 1
        del keep
    finally:
        trimmer.close()


def test_interval_zero_never_trims():
    trimmer = HeapTrimmer(0)
    assert not trimmer.active and not trimmer.trim()
    trimmer.close()


def test_trim_is_due_after_an_idle_interval_or_a_long_busy_period():
    # last step 1 s ago, interval 5: busy, no trim; 6 s ago: idle after a step, trim.
    assert not trim_due(now=101, last_step=100, last_trim=50, interval_s=5, max_busy_s=100)
    assert trim_due(now=106, last_step=100, last_trim=50, interval_s=5, max_busy_s=100)
    # idle, but trimmed already after the last step: nothing new to give back.
    assert not trim_due(now=120, last_step=100, last_trim=106, interval_s=5, max_busy_s=100)
    # steps all the time, but the last trim is max_busy_s old.
    assert trim_due(now=160, last_step=159.9, last_trim=60, interval_s=5, max_busy_s=100)


def test_the_trimmer_waits_while_steps_run_and_trims_once_idle():
    calls = []
    trimmer = HeapTrimmer(0.5, max_busy_s=60)
    if not trimmer.active:
        pytest.skip("no glibc malloc_trim here (another allocator or libc)")
    trimmer._fn = lambda pad: calls.append(pad) or 1
    try:
        end = time.monotonic() + 1.2
        while time.monotonic() < end:  # a busy worker: a step every 10 ms
            trimmer.note_step()
            time.sleep(0.01)
        assert calls == []
        time.sleep(1.2)  # idle: one trim (0.5-1.0 s after the last step)
        assert calls == [0]
        time.sleep(1.2)  # still idle, nothing stepped since: no more
        assert calls == [0] and trimmer.trims == 1
    finally:
        trimmer.close()


# Run in a child: the threshold is process-wide, and the trim test above needs glibc's dynamic one.
_CHILD = """
import gc, sys, psutil
from lmcache_mooncake.runtime.heap import fix_mmap_threshold
fixed = fix_mmap_threshold(int(sys.argv[1]))
big = bytearray(2 << 20)
del big  # without a fixed threshold this raises glibc's past 1 MiB: the blocks below come from the heap
blocks = [bytearray(1 << 20) for _ in range(128)]
for b in blocks:
    b[::4096] = b"\\1" * len(b[::4096])
before = psutil.Process().memory_info().rss
del blocks[::2]
gc.collect()
print(int(fixed), before - psutil.Process().memory_info().rss)
"""


def _freed_after_free(threshold: int) -> tuple[bool, int]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CHILD, str(threshold)], capture_output=True, text=True, check=True)
    fixed, released = out.stdout.split()
    return fixed == "1", int(released)


def test_fixed_mmap_threshold_frees_large_blocks_at_once():
    fixed, released = _freed_after_free(256 * 1024)
    if not fixed:
        pytest.skip("no glibc mallopt here (another allocator or libc)")
    assert released > 48 * MiB, released / MiB  # 64 freed 1 MiB blocks went back without a trim
    # Control: glibc's dynamic threshold keeps the freed blocks in the heap, resident.
    fixed, released = _freed_after_free(0)
    assert not fixed and released < 16 * MiB, released / MiB
