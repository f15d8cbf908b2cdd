"""Our threads leave the core vLLM's OpenMP binding gave the thread that started them."""

from __future__ import annotations

import os
import threading

import pytest

from lmcache_mooncake.runtime import affinity

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")


def _in_thread(fn, pin: set[int]):
    """Run ``fn`` on a new thread bound to ``pin`` (as vLLM binds its worker's main thread),
    while this thread keeps every core; return what ``fn`` returned."""
    out = {}

    def run():
        os.sched_setaffinity(0, pin)
        out["v"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["v"]


def test_a_pinned_thread_is_widened_to_the_cores_of_the_process(monkeypatch):
    monkeypatch.delenv(affinity.KEEP_ENV, raising=False)
    every = os.sched_getaffinity(0)
    one = {min(every)}

    def widen():
        before = os.sched_getaffinity(0)
        affinity.widen_current_thread("test")
        return before, os.sched_getaffinity(0)

    before, after = _in_thread(widen, one)
    assert before == one
    assert after == every  # the union of this process's threads: this one keeps every core


def test_keep_env_leaves_the_binding(monkeypatch):
    monkeypatch.setenv(affinity.KEEP_ENV, "1")
    one = {min(os.sched_getaffinity(0))}

    def widen():
        affinity.widen_current_thread("test")
        return os.sched_getaffinity(0)

    assert _in_thread(widen, one) == one


def test_threads_started_by_a_widened_thread_inherit_its_cores(monkeypatch):
    """What Mooncake's transfer threads, started by ``setup`` on our call thread, get."""
    monkeypatch.delenv(affinity.KEEP_ENV, raising=False)
    every = os.sched_getaffinity(0)

    def widen_then_start():
        affinity.widen_current_thread("test")
        seen = {}
        child = threading.Thread(target=lambda: seen.update(cpus=os.sched_getaffinity(0)))
        child.start()
        child.join()
        return seen["cpus"]

    assert _in_thread(widen_then_start, {min(every)}) == every
