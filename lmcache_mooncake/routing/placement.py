"""Which instance of a role should serve a request.

A :class:`Placement` ranks instances for a prompt given its chunk keys (the
digests :func:`lmcache_mooncake.chunks.keys.chunk_keys` gives, in order; empty when
the proxy could not tokenize the request). :func:`choose` then applies health
and the load bound. Two placements exist:

- :class:`RendezvousPlacement` (``--routing prefix``): highest-random-weight
  hashing of the prompt's first chunk key with each instance's URL. Prompts
  that share their first chunk (a system prompt) go to the same instance, so
  its CPU tier already holds their prefix; when an instance is down only its
  own prompts move, to their second-ranked instance.
- :class:`RoundRobinPlacement` (``--routing round-robin``).

An index fed by vLLM's KV events (which instance holds which chunk) can
replace the hash: it only has to implement :meth:`Placement.rank` and may use
every key, not just the first.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Protocol

from lmcache_mooncake.routing.pool import Instance


class Placement(Protocol):
    """Ranks instances for one request, best first."""

    name: str

    def rank(self, keys: Sequence[bytes], instances: Sequence[Instance]) -> list[Instance]:
        """All of ``instances``, most likely to hold the prompt's prefix first."""
        ...


class RoundRobinPlacement:
    """Each request starts one instance further along."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, keys: Sequence[bytes], instances: Sequence[Instance]) -> list[Instance]:
        if not instances:
            return []
        i = next(self._turn) % len(instances)
        return list(instances[i:]) + list(instances[:i])


class RendezvousPlacement:
    """Rendezvous (highest-random-weight) hashing of the first chunk key; round-robin without keys."""

    name = "prefix"

    def __init__(self) -> None:
        self._fallback = RoundRobinPlacement()

    @staticmethod
    def weight(key: bytes, url: str) -> int:
        return int.from_bytes(hashlib.sha256(b"lmcm-route\0" + key + url.encode()).digest()[:8], "big")

    def rank(self, keys: Sequence[bytes], instances: Sequence[Instance]) -> list[Instance]:
        if not keys:
            return self._fallback.rank(keys, instances)
        first = keys[0]
        return sorted(instances, key=lambda inst: self.weight(first, inst.url), reverse=True)


def make_placement(name: str) -> Placement:
    """The placement called ``name`` (``prefix`` or ``round-robin``)."""
    if name == "prefix":
        return RendezvousPlacement()
    if name == "round-robin":
        return RoundRobinPlacement()
    raise ValueError(f"routing {name!r} is not one of 'prefix', 'round-robin'")


def choose(ranked: Sequence[Instance], max_outstanding: int) -> list[Instance]:
    """The order in which to try instances: the best-ranked up instance, unless it already has
    ``max_outstanding`` requests in flight, then the least loaded up one (the load bound);
    then the other up ones by rank; then those that are down (a last resort, in rank order)."""
    up = [i for i in ranked if i.up]
    down = [i for i in ranked if not i.up]
    if not up:
        return down
    first = up[0]
    if first.outstanding >= max_outstanding:
        first = min(up, key=lambda i: i.outstanding)  # min keeps the rank order among ties
    return [first, *(i for i in up if i is not first), *down]
