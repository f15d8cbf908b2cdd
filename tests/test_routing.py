"""Instance choice: rendezvous placement, the load bound, health states and back-off
(the proxy's use of them is in test_proxy.py)."""

from __future__ import annotations

import hashlib

import pytest

from lmcache_mooncake.routing.placement import (
    RendezvousPlacement,
    RoundRobinPlacement,
    choose,
    make_placement,
)
from lmcache_mooncake.routing.pool import HealthPolicy, Instance, InstancePool

pytestmark = pytest.mark.timeout(60)

URLS = [f"http://127.0.0.1:{8200 + i}" for i in range(3)]


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_rendezvous_is_stable_and_spreads_prefixes():
    pool = InstancePool("decode", URLS, HealthPolicy())
    placement = RendezvousPlacement()
    firsts = [placement.rank([key(i), key(10**6)], pool.instances)[0].url for i in range(300)]
    # Same first key, same instance, whatever follows it.
    assert firsts == [placement.rank([key(i)], pool.instances)[0].url for i in range(300)]
    counts = {u: firsts.count(u) for u in URLS}
    assert all(60 < c < 140 for c in counts.values()), counts


def test_rendezvous_moves_only_the_keys_of_a_lost_instance():
    placement = RendezvousPlacement()
    full = InstancePool("decode", URLS, HealthPolicy())
    without = InstancePool("decode", URLS[:2], HealthPolicy())
    for i in range(200):
        before = placement.rank([key(i)], full.instances)[0].url
        after = placement.rank([key(i)], without.instances)[0].url
        if before != URLS[2]:
            assert after == before


def test_choose_skips_down_instances_and_spills_past_the_load_bound():
    pool = InstancePool("decode", URLS, HealthPolicy())
    a, b, c = pool.instances
    assert choose([a, b, c], max_outstanding=2) == [a, b, c]
    pool.mark_down(a, "refused")
    assert choose([a, b, c], 2) == [b, c, a]  # down: last resort only
    pool.mark_up(a)
    a.outstanding, b.outstanding, c.outstanding = 2, 1, 0
    assert choose([a, b, c], 2)[0] is c  # preferred is full: the least loaded
    assert choose([a, b, c], 3)[0] is a
    for inst in (a, b, c):
        pool.mark_down(inst, "refused")
    assert choose([a, b, c], 2) == [a, b, c]


def test_health_back_off_doubles_and_resets():
    policy = HealthPolicy(interval_s=1.0, min_backoff_s=0.5, max_backoff_s=2.0, failures_to_down=2)
    pool = InstancePool("prefill", URLS[:1], policy)
    inst: Instance = pool.instances[0]
    pool.record_check(inst, False, "HTTP 503", now=0.0)
    assert inst.up  # one failed check is not enough
    pool.record_check(inst, False, "HTTP 503", now=0.5)
    assert not inst.up and inst.backoff_s == 0.5 and inst.next_check == 1.0
    pool.record_check(inst, False, "HTTP 503", now=1.0)
    assert inst.backoff_s == 1.0
    for t in (2.0, 4.0, 6.0):
        pool.record_check(inst, False, "HTTP 503", now=t)
    assert inst.backoff_s == 2.0  # capped
    pool.record_check(inst, True, now=8.0)
    assert inst.up and inst.failures == 0 and inst.next_check == 9.0


def test_round_robin_and_names():
    pool = InstancePool("decode", URLS, HealthPolicy())
    rr = RoundRobinPlacement()
    assert [rr.rank([], pool.instances)[0].url for _ in range(4)] == [URLS[0], URLS[1], URLS[2], URLS[0]]
    assert make_placement("prefix").name == "prefix"
    with pytest.raises(ValueError, match="round-robin"):
        make_placement("random")
    with pytest.raises(ValueError, match="twice"):
        InstancePool("decode", [URLS[0], URLS[0]], HealthPolicy())
