"""Types shared by the prefill/decode (PD) plan policies, and their registry.

A *plan* says how one request is served on a disaggregated fleet:

* ``in_place``: one replica (role ``both``, or a ``decode`` replica that prefills itself) does prefill and decode;
* ``disaggregated``: a ``prefill`` (or ``both``) replica computes the prompt's KV, hands it over the P->D link
  to a ``decode`` (or ``both``) replica, which produces the first token and the rest.

Everything here is pure, like ``policies.base``: no I/O, no clock reads. The router (``router/``) and the
simulator build the same ``RouteRequest`` / ``PdCandidate`` objects and call the same ``PdPolicy.choose_plan``.

Units: tokens are counts, times seconds, sizes bytes, bandwidths bytes per second (``GB`` = 1e9 bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from policies.base import Candidate, Observation, Reuse, RouteRequest

#: A replica's role on a PD fleet.
Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")

#: How a plan serves the request.
PlanKind = Literal["in_place", "disaggregated"]
PLAN_KINDS: tuple[PlanKind, ...] = ("in_place", "disaggregated")


@dataclass(frozen=True, slots=True)
class HandoffLink:
    """The P->D KV transfer link of a fleet (one value per fleet; learned online where engines report it).

    Attributes:
        bandwidth_bytes_per_s: sustained transfer bandwidth, bytes per second (25 GB/s = 25e9).
        latency_s: fixed cost of one handoff (connection, setup, metadata), seconds.
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to hand ``nbytes`` of KV over this link (TV-14: 1.125 GiB at 25 GB/s -> 0.0483 s)."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """A disaggregated request planned onto a decode replica whose first token has not come from it yet.

    Attributes:
        eta_s: seconds until its KV is expected on the decode replica: the plan's predicted prefill end plus
            handoff, counted from now; 0 once handed over (waiting there to be admitted or for its first round),
            or when the prediction has passed.
        tokens: KV tokens it will hold there (its prompt), tokens.
    """

    eta_s: float
    tokens: int


@dataclass(slots=True)
class PdCandidate:
    """One replica on a PD fleet: the co-located ``Candidate`` plus its role.

    Attributes:
        candidate: load view, prefix hit, profile, as for co-located routing.
        role: ``both``, ``prefill`` or ``decode``.
        dp_rank_count: data-parallel ranks the engine exposes (1 = not data-parallel); a plan may pin one.
        link_busy_s: seconds until this replica's outgoing KV link has sent the handoffs already queued on it
            (the router's own estimate from the handoffs it dispatched; 0 when unknown or idle). Handoffs from
            one prefill replica are serialised on its link (seeds 000 §9.2: one NIC carries ~20.7 states/s).
        serves_alone: the engine answers a request without a handoff (False for an SGLang server in
            ``--disaggregation-mode decode``, which waits for the KV of its bootstrap room): no in-place plan.
        decode_legs: the disaggregated requests this router planned onto the replica as their decode leg whose
            first token has not come from it yet (the router's own record, like ``link_busy_s``; empty when
            unknown). What a plan waits for and takes on a decode replica (``policies.pd_decode``) reads them.
    """

    candidate: Candidate
    role: Role = "both"
    dp_rank_count: int = 1
    link_busy_s: float = 0.0
    serves_alone: bool = True
    decode_legs: tuple[DecodeLeg, ...] = ()

    @property
    def index(self) -> int:
        """The replica's stable small integer index."""
        return self.candidate.index

    @property
    def name(self) -> str:
        """The replica's name."""
        return self.candidate.name


@dataclass(slots=True)
class Plan:
    """One way to serve a request, with its predicted TTFT broken into terms.

    Attributes:
        kind: ``in_place`` or ``disaggregated``.
        decode: index of the replica that produces the tokens (the only replica for ``in_place``).
        prefill: index of the prefill replica (``disaggregated``), None for ``in_place``.
        predicted_ttft_s: the plan's predicted time to first token, seconds (``inf`` when infeasible).
        terms: named parts of the prediction, seconds unless the name says tokens/bytes; at least ``Q_p``,
            ``R_p``, ``C_p`` (prefill replica's queue, fetch, recompute), ``handoff`` and ``decode_first``
            (first decode step on D, including D's queue) for ``disaggregated``; ``Q``, ``R``, ``C`` for
            ``in_place``.
        dp_rank: data-parallel rank to pin on the decode replica (None = let the engine pick).
        prefill_tokens: uncached prompt tokens the prefilling replica (``prefill``, or ``decode`` in place) is
            predicted to compute, tokens. The caller charges them to that replica's ``inflight_prefill_tokens``
            at dispatch (see ``plan_charges``).
        handoff_tokens: prompt tokens whose KV moves over the P->D link (the whole prompt unless the decode
            replica already holds a prefix), tokens; 0 for ``in_place``.
    """

    kind: PlanKind
    decode: int
    prefill: int | None = None
    predicted_ttft_s: float = 0.0
    terms: dict[str, float] = field(default_factory=dict)
    dp_rank: int | None = None
    prefill_tokens: int = 0
    handoff_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LegCharge:
    """What the caller adds to one replica's in-flight load when it dispatches a plan (before any leg runs).

    Attributes:
        index: the replica charged.
        requests: added to ``LoadView.inflight_requests`` (removed when that replica's leg ends: the prefill
            leg's response for P, the request's end for D or in place).
        prefill_tokens: added to ``LoadView.inflight_prefill_tokens`` (removed at the prefill's end: P's
            response, or the first token in place), tokens.
    """

    index: int
    requests: int
    prefill_tokens: int


def handoff_end_s(plan: Plan) -> float:
    """Seconds from dispatch until a disaggregated ``plan``'s KV is predicted on its decode replica: its prefill's
    queue, fetch and compute plus the handoff (``Q_p + R_p + C_p + handoff``, each at least 0); 0 for a policy
    that predicts none of them. The router's link backlog and decode legs and the simulator's use this sum."""
    t = plan.terms
    return sum(max(0.0, t.get(k, 0.0)) for k in ("Q_p", "R_p", "C_p", "handoff"))


def plan_charges(plan: Plan) -> list[LegCharge]:
    """The in-flight load to charge for ``plan`` at dispatch, one entry per replica the plan uses.

    Both legs are charged *before* dispatch: the prefill replica gets the request and its uncached tokens, the
    decode replica the request (it will hold the KV and a slot of its running batch). Charging the decode leg
    only when it returns is the known bug class that sends every request to prefill #0 (sglang #27547, smg
    #1714). ``in_place``: one charge on ``decode`` with the request and its uncached tokens.
    """
    if plan.kind == "in_place" or plan.prefill is None:
        return [LegCharge(plan.decode, 1, plan.prefill_tokens)]
    return [LegCharge(plan.prefill, 1, plan.prefill_tokens), LegCharge(plan.decode, 1, 0)]


@dataclass(slots=True)
class PlanDecision:
    """The outcome of ``PdPolicy.choose_plan``.

    Attributes:
        chosen: the plan to dispatch.
        plans: every plan evaluated, best first (the chosen one first); retries and fall-backs walk it.
        policy: name of the policy that decided.
        branch: which branch decided (e.g. ``short_prompt_in_place``), for metrics.
        reuse: available vs achieved cached prompt tokens on the replica that prefills, set by the router.
    """

    chosen: Plan
    plans: list[Plan]
    policy: str
    branch: str = "default"
    reuse: Reuse | None = None


@runtime_checkable
class PdPolicy(Protocol):
    """A PD plan policy: picks in place or a prefill/decode pair for a request."""

    name: str

    def choose_plan(
        self, request: RouteRequest, candidates: Sequence[PdCandidate], link: HandoffLink
    ) -> PlanDecision:
        """Return the plan for ``request`` among ``candidates`` (non-empty, all routable)."""
        ...

    def observe(self, observation: Observation) -> None:
        """Take feedback about a finished prefill (calibration); may do nothing."""
        ...


PdPolicyFactory = Callable[..., PdPolicy]

_PD_REGISTRY: dict[str, PdPolicyFactory] = {}


def register_pd(name: str) -> Callable[[PdPolicyFactory], PdPolicyFactory]:
    """Class decorator: register a PD plan policy factory under ``name`` (names start with ``pd_``)."""

    def deco(factory: PdPolicyFactory) -> PdPolicyFactory:
        if not name.startswith("pd_"):
            raise ValueError(f"PD policy names start with 'pd_': {name!r}")
        if name in _PD_REGISTRY:
            raise ValueError(f"PD policy {name!r} registered twice")
        _PD_REGISTRY[name] = factory
        return factory

    return deco


def pd_policy_names() -> list[str]:
    """Names of every registered PD plan policy, sorted."""
    return sorted(_PD_REGISTRY)


def pd_policy_factory(name: str) -> PdPolicyFactory:
    """The factory (class) registered as PD plan policy ``name`` (to read its parameters).

    Raises:
        KeyError: when ``name`` is unknown.
    """
    return _PD_REGISTRY[name]


def make_pd_policy(name: str, **params: Any) -> PdPolicy:
    """Build the PD plan policy registered as ``name`` with keyword ``params``.

    Raises:
        KeyError: with the list of known names when ``name`` is unknown.
    """
    try:
        factory = _PD_REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown PD policy {name!r}; known: {', '.join(sorted(_PD_REGISTRY))}") from None
    return factory(**params)
