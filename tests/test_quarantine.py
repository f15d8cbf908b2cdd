"""Buffers of timed-out direct gets are held for good, counted, and bounded."""

from __future__ import annotations

import logging

import torch

from lmcache_mooncake.obs.stats import Stats
from lmcache_mooncake.tiers.quarantine import Quarantine


class _Obj:
    """Stands in for an LMCache memory object: only its tensor is read."""

    def __init__(self, nbytes: int):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)


def test_held_buffers_are_counted_and_the_limit_stops_direct_gets(caplog, monkeypatch):
    # logs.setup_logging (run by any earlier test that built a connector) stops propagation.
    monkeypatch.setattr(logging.getLogger("lmcache_mooncake"), "propagate", True)
    stats = Stats()
    q = Quarantine(stats, limit_bytes=3 << 20)
    objs = [_Obj(1 << 20), _Obj(1 << 20)]
    with caplog.at_level(logging.WARNING, logger="lmcache_mooncake.tiers.quarantine"):
        q.hold(objs, ["a", "b"])
        assert not q.full
        q.hold([_Obj(1 << 20)], ["c"])
        assert q.full
        q.hold([], [])  # nothing timed out: nothing said
    snap = stats.snapshot()
    assert snap["store_quarantined_chunks"] == 3 and snap["store_quarantined_bytes"] == 3 << 20
    lines = [r.getMessage() for r in caplog.records]
    # One line per timed-out get, with its bytes, and one when the limit is reached.
    assert len(lines) == 3, lines
    assert "2.0 MiB" in lines[0] and "a" in lines[0]
    assert "staging region" in lines[2]
    # Held means referenced: the buffers are still alive through the quarantine.
    assert all(o in q._held for o in objs)
