"""touch_pages: one write per page makes untouched memory resident (the engine-level check,
with LMCache's own CPU pool, is engine_checks.prefault_makes_the_cpu_pool_resident)."""

from __future__ import annotations

import psutil
import pytest
import torch

from lmcache_mooncake.runtime.prefault import PAGE, touch_pages

MiB = 1 << 20


def test_touch_pages_makes_untouched_memory_resident():
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    buf = torch.empty(128 * MiB, dtype=torch.uint8)  # mapped, not yet backed
    assert proc.memory_info().rss - rss0 < 32 * MiB  # the control: allocating alone faults nothing in
    done = touch_pages(buf)
    assert done.bytes == 128 * MiB
    assert done.newly_resident > 0.9 * 128 * MiB, done
    assert proc.memory_info().rss - rss0 > 0.9 * 128 * MiB


def test_touch_pages_writes_one_zero_per_page_and_takes_other_dtypes():
    buf = torch.full((PAGE * 8 // 4,), 0x01010101, dtype=torch.int32)  # no zero byte anywhere
    touch_pages(buf)
    as_bytes = buf.view(torch.uint8)
    page_starts = as_bytes[(-as_bytes.data_ptr()) % PAGE :: PAGE]
    assert bool((page_starts == 0).all()) and int((as_bytes == 0).sum()) <= 9


def test_touch_pages_refuses_strided_memory():
    with pytest.raises(ValueError, match="contiguous"):
        touch_pages(torch.empty(64, 64)[:, :8])
