"""The store client's call thread: a call its caller gave up on says when it did end; a slow one
is reported while it runs, with what the process's threads are doing."""

from __future__ import annotations

import logging
import time

from lmcache_mooncake.store import stalls
from lmcache_mooncake.store.calls import _Worker


def test_an_abandoned_call_that_ends_is_logged_with_how_late(caplog, monkeypatch):
    # Our package logger stops propagation once logs.py has set it up (earlier tests may have).
    monkeypatch.setattr(logging.getLogger("lmcache_mooncake"), "propagate", True)
    worker = _Worker("test-store-calls")
    try:
        job = worker.submit(lambda: time.sleep(0.3))
        assert not job.done.wait(0.05)  # the caller's timeout
        job.abandon("batch_put_from")
        with caplog.at_level(logging.WARNING, logger="lmcache_mooncake.store.calls"):
            assert job.done.wait(5)
            time.sleep(0.05)  # the log line follows done.set()
        lines = [r.getMessage() for r in caplog.records if "after its caller gave up" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("Mooncake batch_put_from ended"), lines
        assert "returned" in lines[0]
        # Control: a call that is waited for to its end logs nothing.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmcache_mooncake.store.calls"):
            assert worker.submit(lambda: None).done.wait(5)
            time.sleep(0.05)
        assert not [r for r in caplog.records if "gave up" in r.getMessage()]
    finally:
        worker.stop()


def slow_call_for_the_dump() -> None:
    time.sleep(1.2)


def test_a_slow_call_is_reported_while_it_runs_with_what_the_threads_do(caplog, monkeypatch, tmp_path):
    monkeypatch.setattr(logging.getLogger("lmcache_mooncake"), "propagate", True)
    monkeypatch.setenv("LMCACHE_MOONCAKE_SLOW_CALL_S", "0.5")
    monkeypatch.setenv("LMCACHE_MOONCAKE_STALL_DUMP", str(tmp_path))
    monkeypatch.setattr(stalls.shutil, "which", lambda name: None)  # gdb would stop this test process
    worker = _Worker("test-slow-call")
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache_mooncake.store.calls"):
            job = worker.submit(slow_call_for_the_dump, "batch_put_from", 10.0)
            time.sleep(0.9)
            assert not job.done.is_set()  # reported while it still runs, not after
            lines = [r.getMessage() for r in caplog.records]
            assert job.done.wait(5)
        slow = [m for m in lines if m.startswith("Mooncake batch_put_from has run")]
        assert len(slow) == 1 and "its caller waits 10 s" in slow[0] and "threads: " in slow[0], lines
        (dump,) = tmp_path.glob("stall-*.txt")
        text = dump.read_text()
        assert text.startswith("Mooncake batch_put_from running") and "state S" in text
        assert "slow_call_for_the_dump" in text  # the Python stack of the call thread
        # Control: a call that ends within the limit is not reported.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmcache_mooncake.store.calls"):
            assert worker.submit(lambda: time.sleep(0.1), "batch_get_into", 10.0).done.wait(5)
            time.sleep(0.6)
        assert not [r for r in caplog.records if "has run" in r.getMessage()]
    finally:
        worker.stop()


def test_a_call_whose_caller_waits_less_than_the_threshold_is_reported_at_half_its_limit(caplog, monkeypatch):
    # A store get's caller waits mooncake.timeout (2 s by default), as long as the threshold:
    # reported at the threshold, such a call would only be seen after its caller gave up.
    monkeypatch.setattr(logging.getLogger("lmcache_mooncake"), "propagate", True)
    monkeypatch.setenv("LMCACHE_MOONCAKE_SLOW_CALL_S", "5")
    worker = _Worker("test-short-limit")
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache_mooncake.store.calls"):
            job = worker.submit(lambda: time.sleep(1.2), "batch_get_into_multi_buffers", 1.0)
            time.sleep(0.9)
            lines = [r.getMessage() for r in caplog.records]
            assert job.done.wait(5)
        slow = [m for m in lines if m.startswith("Mooncake batch_get_into_multi_buffers has run")]
        assert len(slow) == 1 and "its caller waits 1 s" in slow[0], lines
        # Control: without a caller limit the threshold (5 s) holds, and 1.2 s is not reported.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmcache_mooncake.store.calls"):
            assert worker.submit(lambda: time.sleep(1.2), "batch_get_into").done.wait(5)
        assert not [r for r in caplog.records if "has run" in r.getMessage()]
    finally:
        worker.stop()


def test_thread_summary_counts_this_process_threads():
    line = stalls.thread_summary()
    assert line.split(" ", 1)[0].isdigit() and int(line.split(" ", 1)[0]) >= 1 and "load " in line, line
