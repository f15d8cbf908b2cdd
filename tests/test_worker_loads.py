"""Where the worker runs a step's loads: asynchronous ones on its loader thread, except in a
step where vLLM scheduled nothing (then in the step, reported by the same step's
get_finished); synchronous ones in the step. No vLLM, the engine's load stubbed out."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.connector import worker
from lmcache_mooncake.connector.metadata import LoadOp, StepMetadata
from lmcache_mooncake.connector.scheduler import SchedulerSide


def _op(req_id: str, asynchronous: bool = True) -> LoadOp:
    return LoadOp(req_id=req_id, token_ids=list(range(8)), slots=list(range(8)), start=0, end=7,
                  block_ids=[0], cache_salt=None, lora=None, asynchronous=asynchronous)


@pytest.fixture
def side(tmp_path):
    s = worker.WorkerSide(CacheConfig(), "m", "FLASH_ATTN", 16, tmp_path, tmp_path / "lookup.sock", "test",
                          tp_rank=0, tp_size=1)
    ran: dict[str, str] = {}
    release = threading.Event()

    def load(op: LoadOp) -> set[int]:
        ran[op.req_id] = threading.current_thread().name
        if op.req_id.startswith("slow"):
            release.wait(10)
        return set()

    s._load = load  # type: ignore[method-assign]
    s.ran, s.release = ran, release  # type: ignore[attr-defined]
    yield s
    release.set()
    s.shutdown()


def test_an_asynchronous_load_in_an_idle_step_runs_in_the_step_and_is_reported_by_it(side):
    side.start_load_kv(StepMetadata(loads=[_op("a")], idle=True))
    assert side.ran["a"] == threading.current_thread().name
    assert side.get_finished(set()) == (None, {"a"})


def test_an_asynchronous_load_in_a_busy_step_runs_on_the_loader_thread(side):
    """The control: other requests run in this step, so the load must not hold it."""
    side.start_load_kv(StepMetadata(loads=[_op("a")], idle=False))
    side._loading["a"][0].result(10)
    assert side.ran["a"].startswith("lmcm-load")
    assert side.get_finished(set()) == (None, {"a"})


def test_an_idle_step_does_not_run_a_load_in_the_step_while_another_is_in_flight(side):
    side.start_load_kv(StepMetadata(loads=[_op("slow")], idle=False))
    side.start_load_kv(StepMetadata(loads=[_op("b")], idle=True))
    assert side.get_finished(set()) == (None, None)  # b waits behind slow on the loader thread
    side.release.set()
    side._loading["b"][0].result(10)
    assert side.ran["b"].startswith("lmcm-load")
    assert side.get_finished(set()) == (None, {"slow", "b"})


def test_a_synchronous_load_runs_in_the_step(side):
    side.start_load_kv(StepMetadata(loads=[_op("a", asynchronous=False)], idle=False))
    assert side.ran["a"] == threading.current_thread().name
    assert side.get_finished(set()) == (None, None)  # vLLM does not wait for it


@pytest.mark.parametrize(("scheduled", "idle"), [(0, True), (5, False)])
def test_the_scheduler_marks_a_step_idle_when_vllm_scheduled_no_tokens(tmp_path, scheduled, idle):
    sched = SchedulerSide(CacheConfig(), 16, lookup=None, save=True, load=True,  # type: ignore[arg-type]
                          stats_path=tmp_path / "s.json")
    out = SimpleNamespace(total_num_scheduled_tokens=scheduled, scheduled_new_reqs=[], num_scheduled_tokens={},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[]), finished_req_ids=set())
    assert sched.build_connector_meta(out).idle is idle  # type: ignore[arg-type]
