"""The connector's scheduler side without vLLM: what it answers after a load failed."""

from __future__ import annotations

from types import SimpleNamespace

from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.connector.scheduler import SchedulerSide


class FixedLookup:
    """Always reports the whole prompt cached (as a store that lists objects it cannot serve)."""

    def __init__(self) -> None:
        self.calls = 0

    def lookup(self, tokens: list[int], salt: str | None, lora: str | None) -> int:
        self.calls += 1
        return len(tokens)

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
