"""The identity-and-admission step of the routing core (tenants, quotas, priority classes, SLOs), callable by every front door.

A front door (the HTTP proxy in ``router.http.app``, ``/route``, the gRPC endpoint picker) calls, with plain values
and no HTTP objects:

1. ``identify(headers, body_priority) -> Identity`` (``router.core.tenants``; ``BadIdentity`` -> 400);
2. ``check_slo(identity, best_predicted_s)`` when the request has a TTFT target and a decision was priced
   (``Rejected`` 429 ``slo_unattainable``: refused before it queues);
3. ``await admit(identity, prompt_tokens, max_output_tokens) -> Ticket``: the tenant's token quota
   (``membership.tenant_budget``: shared by router replicas through Redis; ``Rejected`` 429 ``quota`` with the
   seconds until the bucket refills), the tenant's share of the top priority class (a tenant already holding
   ``TenancyConfig.top_class_cap()`` top-class requests, in flight or queued, has the next one served at the
   class below, counted ``top_share``: one tenant flooding the top class cannot starve the others), then a slot
   of the router's in-flight limit (``router.core.admission``: the queue ordered by priority then weighted fair share;
   429 ``queue_full``, 503 ``queue_timeout`` / ``preempted``);
4. ``ticket.release()`` exactly once when the response is over (idempotent).

``admit_request(headers, summary)`` runs 1 and 3 in one call for doors that do not price a decision first.
A ``Rejected`` is a member of the kvroute error family (``router.errors``): the doors render it (JSON with
``error.reason``, a ``Retry-After`` header and ``x-kvroute-rejected-reason``).

Units: tokens, seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from membership.tenant_budget import TenantBudget
from policies.admission_slo import slo_unattainable
from policies.base import Observation
from router.core.admission import Admission, Rejected
from router.core.tenant_metrics import TenantMetrics
from router.core.tenants import BadIdentity, Identity, TenancyConfig, parse_identity, request_cost


@dataclass(frozen=True, slots=True)
class BodySummary:
    """What admission needs from a request body.

    Attributes:
        prompt_tokens: prompt length, tokens.
        max_output_tokens: ``max_tokens`` / ``max_completion_tokens`` (None when not given), tokens.
        priority: the value of the body's ``priority_body_field`` (None when absent).
    """

    prompt_tokens: int
    max_output_tokens: int | None = None
    priority: Any = None


@dataclass(slots=True)
class Ticket:
    """An admitted request: holds one in-flight slot until ``release``.

    Attributes:
        identity: who it is for.
        cost: tokens charged to the tenant's quota.
        waited_s: time spent in the router queue, seconds.
        budget_mode: the quota mode that admitted it (``shared``, ``local_fallback``, ``local``, ``none``).
    """

    identity: Identity
    cost: int
    waited_s: float
    budget_mode: str
    _slots: Admission | None = field(default=None, repr=False)
    _top: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the slot (and the tenant's top-class place, if it held one) back; once: later calls do nothing."""
        slots, self._slots = self._slots, None
        top, self._top = self._top, None
        if top is not None:
            top()
        if slots is not None:
            slots.release()


#: the identity and predicted TTFT of the request the current task serves (read by ``observe``)
_CURRENT: ContextVar[tuple[Identity, float | None] | None] = ContextVar(
    "kvroute_tenant_current", default=None
)


class TenantAdmission:
    """Identity, quotas, the fair queue and SLO rejection (see the module docstring).

    Args:
        cfg: the tenancy configuration (``TenancyConfig.from_settings``).
        budget: the token buckets (Redis-shared or local).
        slots: the router's in-flight limit and its queue.
        metrics: per-tenant / per-class metrics.
    """

    def __init__(
        self, cfg: TenancyConfig, budget: TenantBudget, slots: Admission, metrics: TenantMetrics
    ) -> None:
        self.cfg = cfg
        self.budget = budget
        self.slots = slots
        self.metrics = metrics
        #: tenant -> its top-class requests in flight or queued (only tenants holding some)
        self.top_held: dict[str, int] = {}

    # -- the steps -------------------------------------------------------------------------------------
    def identify(self, headers: Mapping[str, str], body_priority: Any = None) -> Identity:
        """Tenant, class and TTFT target (``headers`` with lower-case names).

        Raises:
            BadIdentity: a malformed header or body field (answer 400).
        """
        try:
            identity = parse_identity(headers, body_priority, self.cfg)
        except BadIdentity as exc:
            self.metrics.rejected("?", "bad_identity" if exc.status == 400 else exc.reason)
            raise
        if identity.unknown_priority_header:
            self.metrics.unknown_priority.labels(identity.unknown_priority_header).inc()
        if identity.demoted:
            self.metrics.demoted(identity.tenant, identity.demoted)
        return identity

    def check_slo(self, identity: Identity, best_predicted_s: float | None) -> None:
        """Refuse a request whose best predicted TTFT misses its target by more than ``slo_reject_factor``.

        Raises:
            Rejected: 429 ``slo_unattainable``.
        """
        target = identity.ttft_target_s
        if not slo_unattainable(best_predicted_s, target, self.cfg.slo_reject_factor):
            return
        self._count_reject(identity, "slo_unattainable")
        raise Rejected(
            429,
            "slo_unattainable",
            "slo_unattainable",
            f"best predicted TTFT {best_predicted_s:.3f}s exceeds the target {target:.3f}s x "
            f"{self.cfg.slo_reject_factor:g} (slo_reject_factor)",
            wire_reason="slo_unattainable",
            retry_after_s=best_predicted_s,
        )

    async def precheck(self, identity: Identity, max_output_tokens: int | None) -> None:
        """Refuse, before any work on the prompt (tokenizing), a request its tenant's bucket cannot pay now: the
        bucket holds less than the request's least possible cost (its max output tokens + 1 prompt token).

        Raises:
            Rejected: 429 ``quota``.
        """
        policy = identity.policy
        if policy.tokens_per_s <= 0:
            return
        least = request_cost(1, max_output_tokens, self.cfg)
        held = await self.budget.peek(identity.tenant, policy.tokens_per_s, policy.burst_tokens)
        if held >= least:
            return
        self._count_reject(identity, "quota")
        raise Rejected(
            429,
            "quota_exceeded",
            "tenant_quota",
            f"tenant {identity.tenant!r} is over its quota of {policy.tokens_per_s:g} tokens/s "
            f"({self.budget.mode}); its bucket holds {held:.0f} tokens",
            wire_reason="quota",
            retry_after_s=(least - held) / policy.tokens_per_s,
        )

    async def admit(self, identity: Identity, prompt_tokens: int, max_output_tokens: int | None) -> Ticket:
        """Charge the tenant's quota, then take an in-flight slot (maybe after a bounded, fair wait).

        Raises:
            Rejected: 429 ``quota`` / ``queue_full``, 503 ``queue_timeout`` / ``preempted``.
        """
        cost = request_cost(prompt_tokens, max_output_tokens, self.cfg)
        mode = await self._charge(identity, cost)
        identity, top = self._take_top_place(identity)
        try:
            waited = await self.slots.acquire(identity.tenant, identity.priority, identity.weight, cost)
        except BaseException as exc:
            if top is not None:
                top()
            if isinstance(exc, Rejected):
                self._count_reject(identity, exc.wire_reason)
            raise
        self.metrics.admitted(identity.tenant, identity.klass.name, cost)
        return Ticket(identity, cost, waited, mode, self.slots, top)

    def _take_top_place(self, identity: Identity) -> tuple[Identity, Callable[[], None] | None]:
        """A top-class request takes one of its tenant's top-class places (the returned callable gives it back),
        or, when the tenant holds ``top_class_cap()`` already, is served at the next class down (counted)."""
        cap = self.cfg.top_class_cap()
        if cap is None or identity.priority < self.cfg.top_priority:
            return identity, None
        tenant = identity.tenant
        held = self.top_held.get(tenant, 0)
        if held >= cap:
            self.metrics.demoted(tenant, "top_share")
            lower = self.cfg.next_class_down(identity.klass)
            return dataclasses.replace(identity, klass=lower, demoted="top_share"), None
        self.top_held[tenant] = held + 1

        def give_back() -> None:
            left = self.top_held.get(tenant, 1) - 1
            if left > 0:
                self.top_held[tenant] = left
            else:
                self.top_held.pop(tenant, None)

        return identity, give_back

    async def admit_request(self, headers: Mapping[str, str], summary: BodySummary) -> Ticket:
        """``identify`` + ``admit`` in one call (front doors without a priced decision, e.g. the EPP).

        Raises:
            BadIdentity, Rejected: see ``identify`` and ``admit``.
        """
        identity = self.identify(headers, summary.priority)
        return await self.admit(identity, summary.prompt_tokens, summary.max_output_tokens)

    async def _charge(self, identity: Identity, cost: int) -> str:
        policy = identity.policy
        if policy.tokens_per_s <= 0:
            return "none"
        answer = await self.budget.take(identity.tenant, policy.tokens_per_s, policy.burst_tokens, cost)
        if answer.admitted:
            return answer.mode
        self._count_reject(identity, "quota")
        if math.isinf(answer.wait_s):
            msg = (
                f"request needs {cost} tokens (prompt + max output), more than tenant {identity.tenant!r}'s "
                f"burst of {policy.burst_tokens:g} tokens"
            )
        else:
            msg = (
                f"tenant {identity.tenant!r} is over its quota of {policy.tokens_per_s:g} tokens/s "
                f"({answer.mode}); {cost} tokens free up in {answer.wait_s:.1f}s"
            )
        raise Rejected(
            429,
            "quota_exceeded",
            "tenant_quota",
            msg,
            wire_reason="quota",
            retry_after_s=None if math.isinf(answer.wait_s) else answer.wait_s,
        )

    def _count_reject(self, identity: Identity, reason: str) -> None:
        self.metrics.rejected(identity.tenant, reason)

    # -- feedback --------------------------------------------------------------------------------------
    def serving(self, identity: Identity, predicted_s: float | None, reused_tokens: int) -> None:
        """The request is about to be forwarded: remember it for ``observe`` (same task) and count its reuse."""
        _CURRENT.set((identity, predicted_s))
        self.metrics.reused(identity.tenant, reused_tokens)

    def observe(self, obs: Observation) -> None:
        """A TTFT observation of the request the current task serves (``Router.on_observation``)."""
        current = _CURRENT.get()
        if current is None:
            return
        identity, predicted = current
        self.metrics.ttft(identity.tenant, obs.ttft_s)
        if predicted is not None and math.isfinite(predicted):
            self.metrics.predicted.labels(identity.klass.name).observe(predicted)
            self.metrics.observed.labels(identity.klass.name).observe(obs.ttft_s)

    def readiness(self) -> dict[str, Any]:
        """The quota mode for ``/readyz`` detail."""
        mode = self.budget.mode
        out: dict[str, Any] = {"quotas": self.cfg.quotas_on, "budget_mode": mode}
        if mode == "local_fallback":
            out["detail"] = (
                f"Redis unreachable: each router enforces 1/{self.budget.expected_routers} of every "
                "tenant quota (tenant_expected_routers) until it is back"
            )
        return out
