"""Tenant token budgets shared by router replicas: one token bucket per tenant in Redis, taken atomically.

``TenantBudget.take(tenant, rate, burst, cost)`` spends ``cost`` tokens of the tenant's bucket (``rate`` tokens per
second, ``burst`` tokens) or says how long until it could. Modes:

* ``shared``: Redis reachable. The bucket is a hash ``<prefix>tb:<tenant>`` updated by one Lua script (refill with
  Redis' own clock, then take), so every router replica draws from the same budget and the fleet admits one
  quota in total, whatever the number of routers.
* ``local_fallback``: Redis configured but unreachable. Each router enforces its share of the quota
  (``rate / expected_routers``, ``burst / expected_routers``) in memory: the fleet stays near the quota, never
  fails open, never rejects everything. ``kvroute_tenant_budget_mode`` and ``/readyz`` say so; the next take after
  Redis is back (``SharedState`` reconnects by itself) is shared again.
* ``local``: no Redis configured (one router): the full quota in memory.

The arithmetic is ``policies.admission_fair.take`` (the simulator uses the same function); the Lua below is the
same formula. Units: tokens, tokens per second, seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from membership.shared_state import SharedState, SharedStateUnavailable
from policies.admission_fair import BucketState, refill, take

#: KEYS[1] bucket hash; ARGV rate (tokens/s), burst (tokens), cost (tokens). Returns {admitted, tokens, wait_s}
#: (numbers as strings: Lua numbers would be truncated to integers on the way out).
BUCKET_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(v[1])
local ts = tonumber(v[2])
if tokens == nil or ts == nil then tokens = burst; ts = now end
local elapsed = now - ts
if elapsed < 0 then elapsed = 0 end
tokens = math.min(burst, tokens + elapsed * rate)
local ok = 0
local wait = 0
if tokens >= cost then
  tokens = tokens - cost
  ok = 1
elseif cost > burst or rate <= 0 then
  wait = -1
else
  wait = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
local ttl = 60000
if rate > 0 then ttl = math.ceil(burst / rate * 1000) + 60000 end
redis.call('PEXPIRE', KEYS[1], ttl)
return {ok, tostring(tokens), tostring(wait)}
"""

#: KEYS[1] bucket hash; ARGV rate, burst. Returns the tokens the bucket holds now (a string), without taking any.
PEEK_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(v[1])
local ts = tonumber(v[2])
if tokens == nil or ts == nil then return tostring(burst) end
local elapsed = now - ts
if elapsed < 0 then elapsed = 0 end
return tostring(math.min(burst, tokens + elapsed * rate))
"""


@dataclass(frozen=True, slots=True)
class BudgetAnswer:
    """The outcome of a take.

    Attributes:
        admitted: the cost was taken.
        wait_s: when refused, seconds until the bucket could hold the cost (``inf``: never, cost > burst).
        mode: ``shared``, ``local_fallback`` or ``local`` (see the module docstring).
    """

    admitted: bool
    wait_s: float
    mode: str


@dataclass(slots=True)
class BudgetStats:
    """Counters since start."""

    shared_takes: int = 0
    fallback_takes: int = 0
    local_takes: int = 0
    refused: int = 0


class TenantBudget:
    """Token buckets per tenant, in Redis when reachable (see the module docstring).

    Args:
        shared: the router's Redis shared state, or None (no Redis: local mode).
        expected_routers: router replicas sharing the quotas (the local fallback enforces 1/this of each).
        clock: monotonic seconds for the in-memory buckets.
    """

    def __init__(
        self, shared: SharedState | None, expected_routers: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.shared = shared
        self.expected_routers = max(1, expected_routers)
        self.clock = clock
        self.stats = BudgetStats()
        self._local: dict[str, BucketState] = {}

    @property
    def mode(self) -> str:
        """``local`` (no Redis), ``shared`` (Redis reachable now) or ``local_fallback`` (unreachable)."""
        if self.shared is None:
            return "local"
        return "shared" if self.shared.available else "local_fallback"

    async def take(self, tenant: str, rate: float, burst: float, cost: float) -> BudgetAnswer:
        """Spend ``cost`` tokens of ``tenant``'s bucket (``rate`` tokens/s, ``burst`` tokens); never raises."""
        if self.shared is not None:
            try:
                raw = await self.shared.run_script(
                    BUCKET_SCRIPT,
                    [self.shared.key(f"tb:{tenant}")],
                    [repr(float(rate)), repr(float(burst)), repr(float(cost))],
                )
                self._local.clear()  # a later outage starts from fresh local shares
                self.stats.shared_takes += 1
                return self._answer(int(raw[0]) == 1, float(raw[2]), "shared")
            except SharedStateUnavailable:
                self.stats.fallback_takes += 1
                n = self.expected_routers
                return self._take_local(tenant, rate / n, burst / n, cost, "local_fallback")
        self.stats.local_takes += 1
        return self._take_local(tenant, rate, burst, cost, "local")

    async def peek(self, tenant: str, rate: float, burst: float) -> float:
        """Tokens ``tenant``'s bucket holds now (nothing taken; never raises): lets a caller refuse a request that
        cannot be paid before spending work on it (e.g. tokenizing its prompt)."""
        if self.shared is not None:
            try:
                raw = await self.shared.run_script(
                    PEEK_SCRIPT, [self.shared.key(f"tb:{tenant}")], [repr(float(rate)), repr(float(burst))]
                )
                return float(raw)
            except SharedStateUnavailable:
                n = self.expected_routers
                return refill(self._local.get(tenant), self.clock(), rate / n, burst / n).tokens
        return refill(self._local.get(tenant), self.clock(), rate, burst).tokens

    def _take_local(self, tenant: str, rate: float, burst: float, cost: float, mode: str) -> BudgetAnswer:
        state, out = take(self._local.get(tenant), self.clock(), rate, burst, cost)
        self._local[tenant] = state
        if len(self._local) > 100_000:  # bounded: forget the oldest buckets (they refill to full anyway)
            for key in list(self._local)[:10_000]:
                del self._local[key]
        return self._answer(out.admitted, out.wait_s, mode)

    def _answer(self, admitted: bool, wait_s: float, mode: str) -> BudgetAnswer:
        if not admitted:
            self.stats.refused += 1
        return BudgetAnswer(admitted, math.inf if wait_s < 0 else wait_s, mode)
