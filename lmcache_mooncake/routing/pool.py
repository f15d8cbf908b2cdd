"""The instances of one role (prefill or decode): health, back-off, outstanding requests.

Contract:

- An instance starts *up*. It goes *down* when a request cannot connect to it
  (at once: the connection was refused or timed out) or when its ``/health``
  fails :attr:`HealthPolicy.failures_to_down` times in a row.
- A down instance gets no new request while another instance of the role is
  up; it is checked again after a back-off that doubles from
  :attr:`HealthPolicy.min_backoff_s` to :attr:`HealthPolicy.max_backoff_s`,
  and is *up* again as soon as its ``/health`` answers 200.
- When every instance of the role is down, requests still try them all (in
  the placement's order), so a role that comes back is used without waiting
  for the next check.
- :meth:`InstancePool.check_due` runs the checks that are due; the proxy calls
  it from one background task. Nothing here blocks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class HealthPolicy:
    """How instances are watched."""

    #: Seconds between checks of an instance that is up.
    interval_s: float = 2.0
    #: First wait before re-checking an instance that went down; doubles per failed check.
    min_backoff_s: float = 0.5
    #: Longest wait between checks of a down instance.
    max_backoff_s: float = 10.0
    #: Seconds one ``/health`` call may take.
    timeout_s: float = 5.0
    #: Failed checks in a row that take an up instance down (a refused connection from a
    #: request takes it down at once).
    failures_to_down: int = 2

    def __post_init__(self) -> None:
        for name in ("interval_s", "min_backoff_s", "max_backoff_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.max_backoff_s < self.min_backoff_s:
            raise ValueError(f"max_backoff_s={self.max_backoff_s} is below min_backoff_s={self.min_backoff_s}")
        if self.failures_to_down < 1:
            raise ValueError(f"failures_to_down={self.failures_to_down} must be at least 1")


@dataclass
class Instance:
    """One vLLM server of a role, as the proxy sees it."""

    url: str
    role: str
    up: bool = True
    #: Failed checks in a row.
    failures: int = 0
    backoff_s: float = 0.0
    next_check: float = 0.0
    #: Requests sent and not yet answered in full.
    outstanding: int = 0
    #: Requests this instance was chosen for.
    routed: int = 0
    last_error: str = ""
    checking: bool = field(default=False, repr=False)

    def describe(self) -> dict[str, Any]:
        return {"state": "ok" if self.up else f"down ({self.last_error})", "outstanding": self.outstanding,
                "routed": self.routed}


class InstancePool:
    """Instances of one role, with their health."""

    def __init__(self, role: str, urls: list[str], policy: HealthPolicy):
        if not urls:
            raise ValueError(f"at least one {role} URL is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"{role} URLs are given twice: {urls}")
        self.role = role
        self.policy = policy
        self.instances = [Instance(u, role) for u in urls]

    @property
    def urls(self) -> list[str]:
        return [i.url for i in self.instances]

    def get(self, url: str) -> Instance:
        for inst in self.instances:
            if inst.url == url:
                return inst
        raise KeyError(f"no {self.role} instance {url}")

    def up(self) -> list[Instance]:
        return [i for i in self.instances if i.up]

    def mark_down(self, inst: Instance, reason: str, now: float | None = None) -> None:
        """Take ``inst`` out of rotation until a check finds it healthy."""
        now = time.monotonic() if now is None else now
        if inst.up or not inst.backoff_s:
            inst.backoff_s = self.policy.min_backoff_s
        inst.up = False
        inst.last_error = reason
        inst.next_check = now + inst.backoff_s

    def mark_up(self, inst: Instance, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        inst.up, inst.failures, inst.backoff_s, inst.last_error = True, 0, 0.0, ""
        inst.next_check = now + self.policy.interval_s

    def record_check(self, inst: Instance, ok: bool, reason: str = "", now: float | None = None) -> None:
        """Apply one ``/health`` result."""
        now = time.monotonic() if now is None else now
        if ok:
            self.mark_up(inst, now)
            return
        inst.failures += 1
        if inst.up and inst.failures < self.policy.failures_to_down:
            inst.next_check = now + min(self.policy.min_backoff_s, self.policy.interval_s)
            return
        if not inst.up:
            inst.backoff_s = min(inst.backoff_s * 2, self.policy.max_backoff_s)
        self.mark_down(inst, reason, now)

    async def check(self, client: httpx.AsyncClient, inst: Instance) -> tuple[bool, str]:
        """One ``/health`` call: (answered 200, why not)."""
        try:
            resp = await client.get(inst.url + "/health", timeout=self.policy.timeout_s)
        except httpx.HTTPError as e:
            return False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return resp.status_code == 200, f"HTTP {resp.status_code}"

    async def check_due(self, client: httpx.AsyncClient) -> list[tuple[Instance, bool]]:
        """Check, at once, every instance whose check is due; returns those whose state changed
        (with the new state)."""
        now = time.monotonic()
        due = [i for i in self.instances if not i.checking and now >= i.next_check]
        for inst in due:
            inst.checking = True
        try:
            results = await asyncio.gather(*(self.check(client, inst) for inst in due))
        finally:
            for inst in due:
                inst.checking = False
        changed = []
        for inst, (ok, reason) in zip(due, results, strict=True):
            was = inst.up
            self.record_check(inst, ok, reason)
            if inst.up != was:
                changed.append((inst, inst.up))
        return changed

    def begin(self, inst: Instance) -> None:
        """Count one more request outstanding on ``inst`` (the proxy calls :meth:`end` when its
        answer, or stream, is over)."""
        inst.outstanding += 1
        inst.routed += 1

    def end(self, inst: Instance) -> None:
        inst.outstanding = max(inst.outstanding - 1, 0)
