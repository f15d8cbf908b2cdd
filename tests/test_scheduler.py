"""The connector's scheduler side without vLLM: what it answers after a load failed, and
which tier it says served a hit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.connector.lookup import LookupReply
from lmcache_mooncake.connector.scheduler import SchedulerSide

HOST, DISK, OTHER = CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED


class FixedLookup:
    """Always reports the whole prompt cached (as a store that lists objects it cannot serve),
    in the tiers ``runs`` name (``(tier, end)``; an ``end`` of -1 is the prompt's end)."""

    def __init__(self, runs: list[tuple[str, int]] | None = None) -> None:
        self.calls = 0
        self.runs = runs or []

    def ask(self, key: object, tokens: list[int], salt: str | None, lora: str | None, wait: float) -> LookupReply:
        self.calls += 1
        return LookupReply(hit=len(tokens), runs=[(t, len(tokens) if e == -1 else e) for t, e in self.runs])

    def is_open(self, key: object) -> bool:
        return False

    def cancel(self, key: object) -> None:
        return None

    def close(self) -> None:
        return None


def request(req_id: str, n: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(n)), cache_salt=None,
                           lora_request=None, kv_transfer_params=None)


def test_a_request_whose_load_failed_is_computed_not_reloaded(tmp_path):
    lookup = FixedLookup()
    side = SchedulerSide(CacheConfig(), 128, lookup, save=True, load=True, stats_path=tmp_path / "s.json")
    req, other = request("r1", 600), request("r2", 600)
    assert side.get_num_new_matched_tokens(req, 0) == (599, True)
    assert side.get_num_new_matched_tokens(other, 0) == (599, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],))
    side.update_state_after_alloc(req, blocks, 599)
    side._reqs["r1"].load_sent = True  # what build_connector_meta does when it sends the load
    side.update_connector_output(SimpleNamespace(invalid_block_ids=set()))
    side.update_connector_output(SimpleNamespace(invalid_block_ids={3}))
    # vLLM asks again for the rescheduled request: compute it, no lookup, no load.
    calls = lookup.calls
    assert side.get_num_new_matched_tokens(req, 256) == (0, False)
    assert lookup.calls == calls and side._reqs["r1"].load is None
    # Another request is not affected.
    assert side.get_num_new_matched_tokens(other, 0) == (599, True)
    assert side.stats.snapshot()["loads_failed_recomputed"] == 1


def test_hit_sources_split_the_loaded_tokens_by_tier(tmp_path):
    # Chunks 0-1 in the CPU tier, chunk 2 on disk, chunk 3 (the partial tail) in the store.
    lookup = FixedLookup([("cpu", 512), ("disk", 768), ("store", -1)])
    side = SchedulerSide(CacheConfig(), 128, lookup, save=True, load=True, stats_path=tmp_path / "s.json")
    req = request("r1", 900)
    # vLLM's own prefix cache holds the first 384 tokens: we load [384, 899).
    assert side.get_num_new_matched_tokens(req, 384) == (515, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7, 8],)), 515)
    before = side._reqs["r1"]
    snapshot = repr(before)
    sources = side.hit_sources(req, 515)
    assert sources == {HOST: 128, DISK: 256, OTHER: 131} and sum(sources.values()) == 515
    # Asked twice, the same answer; the record is unchanged.
    assert side.hit_sources(req, 515) == sources and repr(side._reqs["r1"]) == snapshot
    assert side.hit_sources(req, 0) == {}


@pytest.mark.parametrize(
    ("runs", "local", "want"),
    [
        ([("cpu", -1)], 0, {HOST: 599}),  # the control: one tier, all of it
        ([("disk", -1)], 256, {DISK: 343}),
        ([("cpu", 256), ("disk", -1)], 256, {DISK: 343}),  # vLLM's cache covers the CPU run
        ([], 0, {OTHER: 599}),  # a worker that did not say
        ([("cpu", 256)], 0, {HOST: 256, OTHER: 343}),  # runs short of the hit
        ([("LocalDiskBackend", -1)], 0, {OTHER: 599}),  # a tier we do not know
    ],
)
def test_hit_sources_cases(tmp_path, runs, local, want):
    side = SchedulerSide(CacheConfig(), 128, FixedLookup(runs), save=True, load=True, stats_path=tmp_path / "s.json")
    req = request("r", 600)
    new, _ = side.get_num_new_matched_tokens(req, local)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), new)
    assert side.hit_sources(req, new) == want and sum(want.values()) == new


def test_hit_sources_of_an_unknown_request_are_unspecified(tmp_path):
    side = SchedulerSide(CacheConfig(), 128, FixedLookup(), save=True, load=True, stats_path=tmp_path / "s.json")
    assert side.hit_sources(request("never-looked-up", 600), 100) == {OTHER: 100}


def test_a_second_lookup_keeps_the_tier_the_first_found_a_chunk_in(tmp_path):
    # First lookup: chunk 0 in the CPU tier, chunks 1-2 on disk (the lookup promotes them).
    lookup = FixedLookup([("cpu", 256), ("disk", -1)])
    side = SchedulerSide(CacheConfig(), 128, lookup, save=True, load=True, stats_path=tmp_path / "s.json")
    req = request("r", 600)
    side.get_num_new_matched_tokens(req, 0)
    # vLLM could not schedule it and asks again: now all of it is in the CPU tier.
    lookup.runs = [("cpu", -1)]
    new, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), new)
    assert side.hit_sources(req, new) == {HOST: 256, DISK: 343}


@pytest.mark.parametrize(
    ("old", "new", "want"),
    [
        ([], [("cpu", 600)], [("cpu", 600)]),
        ([("disk", 600)], [("cpu", 600)], [("disk", 600)]),
        ([("cpu", 256), ("disk", 600)], [("cpu", 600)], [("cpu", 256), ("disk", 600)]),
        ([("disk", 600)], [("cpu", 256)], [("disk", 256)]),  # the hit shrank: only its extent
        ([("cpu", 256)], [("cpu", 256), ("store", 600)], [("cpu", 256), ("store", 600)]),
        ([("disk", 600)], [], []),  # the latest lookup found nothing
        ([("odd", 300)], [("disk", 600)], [("odd", 300), ("disk", 600)]),  # unknown: the slowest
    ],
)
def test_outermost_runs(old, new, want):
    from lmcache_mooncake.connector.scheduler import outermost_runs

    assert outermost_runs(old, new) == want


def test_vllm_schedules_other_requests_while_a_long_lookup_runs(tmp_path):
    """A lookup the worker takes long to answer (a long prompt's disk reads) leaves vLLM's
    loop free: the scheduler side answers None (ask again) after LOOKUP_WAIT_S, a short
    request's lookup is answered meanwhile, and the long one's answer is used when it comes."""
    import threading
    import time

    from lmcache_mooncake.connector import scheduler as sched_mod
    from lmcache_mooncake.connector.lookup import LookupClient, LookupServer, lookup_socket_path

    release = threading.Event()

    def lookup(tokens, salt, lora):
        if len(tokens) > 1000:  # the long prompt: its chunks are being read
            release.wait(10)
            return LookupReply(hit=len(tokens), runs=[("disk", len(tokens))])
        return LookupReply(hit=0)

    path = lookup_socket_path(tmp_path, "sched-async")
    server = LookupServer(path, lookup)
    client = LookupClient(path, timeout=5.0)
    side = SchedulerSide(CacheConfig(), 128, client, save=True, load=True, stats_path=tmp_path / "s.json")
    long, short = request("long", 8193), request("short", 64)
    try:
        t0 = time.monotonic()
        assert side.get_num_new_matched_tokens(long, 0) == (None, False)
        assert time.monotonic() - t0 < sched_mod.LOOKUP_WAIT_S + 0.5  # waited one slice, not the lookup
        assert client.is_open("long")
        assert side.get_num_new_matched_tokens(short, 0) == (0, False)  # answered while the long one runs
        assert side.get_num_new_matched_tokens(long, 0) == (None, False)  # still reading
        release.set()
        deadline = time.monotonic() + 5
        answer = (None, False)
        while answer == (None, False) and time.monotonic() < deadline:
            answer = side.get_num_new_matched_tokens(long, 0)
        assert answer == (8192, True)
        assert not client.is_open("long")
    finally:
        release.set()
        client.close()
        server.close()
