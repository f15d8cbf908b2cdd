"""HeapTrimmer: freed heap memory goes back to the OS (glibc), and nothing happens when it is off."""

from __future__ import annotations

import gc

import psutil
import pytest

from lmcache_mooncake.heap import HeapTrimmer

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
