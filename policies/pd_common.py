"""Helpers shared by the PD plan policies: which replica may play which part, load reading, decisions.

Pure functions, no I/O. Unknown load values (``None``) are never read as zero: as in ``policies.common`` they get
the worst value known among the candidates of the same decision.

Roles (``policies.pd_base.Role``):

* prefill leg of a disaggregated plan: a ``prefill`` replica (a ``both`` replica too when ``both_can_pair``);
* decode leg of a disaggregated plan: a ``decode`` replica (a ``both`` replica too when ``both_can_pair``);
* in place: a ``both`` replica, or a ``decode`` replica prefilling itself when ``decode_prefills``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from policies.base import Candidate, LoadView, Policy, RouteRequest
from policies.hits import usable_cached_tokens
from policies.pd_base import HandoffLink, PdCandidate, PdPolicy, Plan, PlanDecision, Role


@dataclass(frozen=True, slots=True)
class RoleRules:
    """Which replicas may play which part of a plan.

    Attributes:
        decode_prefills: a ``decode`` replica may serve a request in place (prefill itself), as llm-d's decode
            sidecar does when no prefiller is named.
        both_can_pair: ``both`` replicas may take the prefill or the decode leg of a disaggregated plan (their
            engines run a KV connector in both directions).
    """

    decode_prefills: bool = True
    both_can_pair: bool = False

    def can_prefill_leg(self, role: Role) -> bool:
        """May a replica of ``role`` take the prefill leg of a disaggregated plan?"""
        return role == "prefill" or (role == "both" and self.both_can_pair)

    def can_decode_leg(self, role: Role) -> bool:
        """May a replica of ``role`` take the decode leg of a disaggregated plan?"""
        return role == "decode" or (role == "both" and self.both_can_pair)

    def can_serve_in_place(self, role: Role) -> bool:
        """May a replica of ``role`` serve the whole request itself?"""
        return role == "both" or (role == "decode" and self.decode_prefills)


def positions(cands: Sequence[PdCandidate], ok: Callable[[Role], bool]) -> list[int]:
    """Positions of the candidates whose role satisfies ``ok`` (a ``RoleRules`` method)."""
    return [i for i, c in enumerate(cands) if ok(c.role)]


def in_place_positions(cands: Sequence[PdCandidate], rules: RoleRules) -> list[int]:
    """Positions of the candidates that may serve a request whole: their role allows it (``rules``) and their
    engine answers a request without a handoff (``PdCandidate.serves_alone``)."""
    return [i for i, c in enumerate(cands) if rules.can_serve_in_place(c.role) and c.serves_alone]


def require_pd_candidates(cands: Sequence[PdCandidate]) -> None:
    """Raise ``ValueError`` when there is nothing to choose from."""
    if not cands:
        raise ValueError("choose_plan() needs at least one candidate")


@dataclass(frozen=True, slots=True)
class Loads:
    """Per candidate (in candidate order) the load numbers the PD policies use, unknowns filled in.

    Attributes:
        backlog_tokens: uncached prefill tokens ahead of a new request: scraped ``queued_prefill_tokens`` (or
            ``queued_requests`` x ``mean_prefill_tokens``) + the router's ``inflight_prefill_tokens``, tokens.
        running: requests in the running batch: max(scraped, the router's in-flight requests), requests.
        requests: the router's in-flight requests + scraped waiting requests, requests (least-load's measure).
        kv_usage: KV-cache usage 0..1.
    """

    backlog_tokens: list[float]
    running: list[float]
    requests: list[float]
    kv_usage: list[float]


_INF = float("inf")


def gauge(value: float | None) -> float | None:
    """A scraped gauge as a float when it is a finite number >= 0, else None: a broken gauge (NaN, infinite,
    negative, too large for a float) counts as unknown, filled like a missing one with the worst known value, so
    it never makes a replica look idle (``max(0.0, nan)`` is 0.0) nor spreads to the replicas whose gauges are
    unknown (``max`` of a list holding NaN or infinity)."""
    if value is None:
        return None
    try:
        f = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return f if 0.0 <= f < _INF else None


def _scraped_backlog(load: LoadView, mean_prefill_tokens: int) -> float | None:
    """Scraped queued prefill tokens, or queued requests x ``mean_prefill_tokens``; None when neither is known
    (``gauge``: a broken one is unknown)."""
    queued = gauge(load.queued_prefill_tokens)
    if queued is not None:
        return queued
    waiting = gauge(load.queued_requests)
    return None if waiting is None else waiting * mean_prefill_tokens


def read_loads(cands: Sequence[PdCandidate], mean_prefill_tokens: int) -> Loads:
    """Fill the ``Loads`` of ``cands``; an unknown or broken gauge (``gauge``) becomes the largest valid known
    one (else 0)."""
    loads = [c.candidate.load for c in cands]
    scraped = [_scraped_backlog(v, mean_prefill_tokens) for v in loads]
    runs = [gauge(v.running_requests) for v in loads]
    waits = [gauge(v.queued_requests) for v in loads]
    kvs = [gauge(v.kv_usage) for v in loads]
    q_worst = max((q for q in scraped if q is not None), default=0.0)
    r_worst = max((r for r in runs if r is not None), default=0.0)
    w_worst = max((w for w in waits if w is not None), default=0.0)
    k_worst = max((k for k in kvs if k is not None), default=0.0)
    backlog, running, requests, kv = [], [], [], []
    for v, sq, sr, sw, sk in zip(loads, scraped, runs, waits, kvs, strict=True):
        backlog.append((q_worst if sq is None else sq) + max(0, v.inflight_prefill_tokens))
        running.append(max(r_worst if sr is None else sr, float(v.inflight_requests)))
        requests.append(float(v.inflight_requests) + (w_worst if sw is None else sw))
        kv.append(k_worst if sk is None else sk)
    return Loads(backlog, running, requests, kv)


def usable_hit_tokens(cand: Candidate, prompt_tokens: int, block_size: int) -> int:
    """Matched prompt tokens (any tier) the replica could reuse, capped as an engine would, tokens."""
    return usable_cached_tokens(cand.hit.total, prompt_tokens, block_size, cand.load.engine_block_size)


def gpu_hit_tokens(cand: Candidate, prompt_tokens: int, block_size: int) -> int:
    """Matched prompt tokens in the replica's GPU tier, capped as an engine would, tokens."""
    return usable_cached_tokens(cand.hit.gpu, prompt_tokens, block_size, cand.load.engine_block_size)


def in_place_plan(
    cands: Sequence[PdCandidate],
    pos: int,
    prompt_tokens: int,
    block_size: int,
    ttft_s: float = 0.0,
    terms: dict[str, float] | None = None,
) -> Plan:
    """An ``in_place`` plan on the candidate at ``pos``; charges its uncached tokens (``prefill_tokens``)."""
    c = cands[pos].candidate
    uncached = prompt_tokens - usable_hit_tokens(c, prompt_tokens, block_size)
    return Plan(
        kind="in_place",
        decode=c.index,
        predicted_ttft_s=ttft_s,
        terms=dict(terms or {}),
        prefill_tokens=uncached,
    )


def pd_plan(
    cands: Sequence[PdCandidate],
    p: int,
    d: int,
    prompt_tokens: int,
    block_size: int,
    ttft_s: float = 0.0,
    terms: dict[str, float] | None = None,
) -> Plan:
    """A ``disaggregated`` plan, prefill at position ``p``, decode at ``d``.

    ``prefill_tokens`` = the prompt tokens P does not hold; ``handoff_tokens`` = the prompt tokens D does not
    hold in GPU (the whole prompt's KV moves unless D already holds a prefix: vLLM's NIXL connector loads only
    the blocks the decode engine lacks).
    """
    pc = cands[p].candidate
    dc = cands[d].candidate
    uncached = prompt_tokens - usable_hit_tokens(pc, prompt_tokens, block_size)
    moved = prompt_tokens - gpu_hit_tokens(dc, prompt_tokens, block_size)
    return Plan(
        kind="disaggregated",
        decode=dc.index,
        prefill=pc.index,
        predicted_ttft_s=ttft_s,
        terms=dict(terms or {}),
        prefill_tokens=uncached,
        handoff_tokens=moved,
    )


def decision_of(policy: str, plans: list[Plan], branch: str) -> PlanDecision:
    """A ``PlanDecision`` choosing ``plans[0]`` (the list is kept in the given order: best first)."""
    return PlanDecision(chosen=plans[0], plans=plans, policy=policy, branch=branch)


def no_feasible_plan(cands: Sequence[PdCandidate]) -> ValueError:
    """The error for a fleet where no plan is feasible (e.g. only prefill replicas)."""
    roles = sorted({c.role for c in cands})
    return ValueError(
        f"no feasible PD plan: roles present {roles}; need a 'both' replica, a decode replica "
        "that prefills, or a prefill and a decode replica"
    )


def pick_in_pool(policy: Policy, request: RouteRequest, cands: Sequence[PdCandidate], pool: list[int]) -> int:
    """Run the co-located ``policy`` over the candidates at positions ``pool``; the chosen one's position."""
    sub = [cands[i].candidate for i in pool]
    chosen = policy.choose(request, sub).chosen
    for i in pool:
        if cands[i].candidate.index == chosen:
            return i
    raise ValueError(f"policy {policy.name!r} chose replica {chosen}, not one of its candidates")


def two_pool_plan(
    name: str,
    prefill: Policy,
    decode: Policy,
    rules: RoleRules,
    request: RouteRequest,
    cands: Sequence[PdCandidate],
    pair_branch: str,
) -> PlanDecision:
    """The baselines' two-pool choice: ``prefill`` picks the prefill leg in its pool, then ``decode`` the decode
    leg in its pool (another replica when it can); without such a pair, ``prefill`` picks a replica to serve
    the request in place. ``pair_branch`` names the disaggregated branch in the decision.

    Raises:
        ValueError: no candidates, or none that may serve the request in place when there is no pair.
    """
    require_pd_candidates(cands)
    n, bs = request.prompt_tokens, request.block_size
    ps = positions(cands, rules.can_prefill_leg)
    ds = positions(cands, rules.can_decode_leg)
    if ps and ds:
        p = pick_in_pool(prefill, request, cands, ps)
        d = pick_in_pool(decode, request, cands, [i for i in ds if i != p] or ds)
        if d != p:
            return decision_of(name, [pd_plan(cands, p, d, n, bs)], pair_branch)
    places = in_place_positions(cands, rules)
    if not places:
        raise no_feasible_plan(cands)
    x = pick_in_pool(prefill, request, cands, places)
    return decision_of(name, [in_place_plan(cands, x, n, bs)], "in_place")


def plan_request(
    policy: PdPolicy, request: RouteRequest, cands: Sequence[PdCandidate], link: HandoffLink
) -> PlanDecision:
    """The plan for ``request``: ``policy``'s, except that parallel sampling (``request.sequences > 1``: OpenAI
    ``n``, vLLM ``best_of``) is served in place. vLLM's prefill/decode disaggregation does not support it (the
    prefill's other samples hold their blocks until the abort timeout), so such a request is planned by ``policy``
    among the ``both`` and ``decode`` replicas that serve a request alone, all offered as ``both`` (in place
    only). Without any (an SGLang fleet, whose decode servers wait for a handoff) it is ``policy``'s own plan:
    SGLang expands a scalar bootstrap room to one room per sample. The router calls this for every request, so the
    plan is the same whichever front door or ``/route`` asks.
    """
    if request.sequences <= 1:
        return policy.choose_plan(request, cands, link)
    alone = [replace(c, role="both") for c in cands if c.serves_alone and c.role in ("both", "decode")]
    if not alone:
        return policy.choose_plan(request, cands, link)
    decision = policy.choose_plan(request, alone, link)
    plans = [p for p in decision.plans if p.kind == "in_place"]
    if not plans:  # the policy paired two of them (both_can_pair): serve in place where it would decode
        pos = next(i for i, c in enumerate(alone) if c.index == decision.chosen.decode)
        plans = [in_place_plan(alone, pos, request.prompt_tokens, request.block_size)]
    return PlanDecision(
        chosen=plans[0], plans=plans, policy=decision.policy, branch="parallel_sampling_in_place"
    )
