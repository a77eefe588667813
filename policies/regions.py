"""Regions: distance priced in seconds, the bounded failover ladder and data residency (pure, no I/O).

A fleet spans regions; each replica has one (``Candidate.region``), KV caches are per region and never fetched
across regions (a replica's match is its own cache's). The client is in a region too (``RouteRequest.client_region``:
an edge header the router verified, else the router's own region), and the round trip between the two regions
(``LatencyMatrix``, seconds) is part of the TTFT the client sees: ``ladder`` sets ``Candidate.rtt_s`` and ``ttft``
adds it to the predicted TTFT.

The failover ladder (``plan_ladder``, ``RegionLadderPolicy``):

* rungs: the regions allowed to process the request (``RouteRequest.allowed_regions``; None = any) that have
  routable replicas, nearest first; a region is on the ladder only if its round trip exceeds the *home* region's
  (the nearest allowed region, up or not: where the client is normally served) by at most ``max_extra_rtt_s``
  seconds, and at most ``max_regions`` regions are on it (a region known down is skipped, not counted);
* local first: while the home region is up, a replica elsewhere is chosen only when its predicted TTFT including
  the round trip is lower than the best home replica's by more than ``margin_s`` seconds; when the home region
  has no routable replica (down, or every replica at its limit), the rungs compete on predicted TTFT alone;
* retries walk the ladder: the ranking gives each region at most ``attempts_per_region`` consecutive places
  before the next region's best, so a router retrying after connection failures leaves a dead region quickly;
* otherwise a refusal (``RegionRefused``, with ``retry_after_s``): the router answers 503 with Retry-After.

Residency is a hard filter, applied before anything else and on every rung: a replica outside the allowed set,
or whose region is unknown or unpriced, is never on the ladder, so failover can never violate it (the request is
refused instead). Every outcome is counted (``RegionLadderPolicy.counts``) and explained (``last_plan``).

Baselines for the simulator (same inner policy inside a region, so only the regional layer differs):
``RegionLocalPolicy`` (each region serves its own clients only, as independent per-region deployments do) and
``RegionNearestPolicy`` (the nearest region with capacity, as GeoDNS with health checks and a shed-load
threshold does; DNS does not see the request, so it does not know its residency).

Units: seconds, tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from policies.admission_slo import best_predicted_ttft_s, predicted_ttft_s
from policies.base import Candidate, Decision, Observation, Policy, RouteRequest
from policies.ttft import TTFTPolicy

RefusalReason = Literal["unknown_client_region", "residency_empty", "no_allowed_region_up", "beyond_ladder"]
#: why a region was left off a request's ladder
SkipReason = Literal["down", "residency", "unpriced", "too_far", "max_regions"]


class RegionRefused(Exception):
    """No region may serve the request: the router answers 503 with ``Retry-After: retry_after_s`` (400 for
    ``unknown_client_region``, a header the router should have rejected at intake).

    Attributes:
        reason: ``unknown_client_region`` (not in the latency matrix), ``residency_empty`` (the allowed set is
            empty), ``no_allowed_region_up`` (no allowed region has a routable replica), ``beyond_ladder``
            (allowed regions are up, but none within the ladder's bounds).
        retry_after_s: seconds the client should wait before retrying.
        plan: the ladder as far as it was built (skipped regions and why), None before it started.
    """

    def __init__(
        self, reason: RefusalReason, message: str, retry_after_s: float, plan: LadderPlan | None = None
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: RefusalReason = reason
        self.retry_after_s = retry_after_s
        self.plan = plan


@dataclass(frozen=True, slots=True)
class LatencyMatrix:
    """Round trips between regions, seconds (symmetric; the diagonal is the round trip within a region).

    Attributes:
        rtt: ``(region a, region b) -> seconds``, both orders present.
        regions: every region named in the matrix.
    """

    rtt: Mapping[tuple[str, str], float]
    regions: frozenset[str]

    @classmethod
    def from_pairs(cls, pairs: Mapping[str, Mapping[str, float]], intra_s: float = 0.0) -> LatencyMatrix:
        """A matrix from nested ``{a: {b: seconds}}`` (either order of a pair is enough; a pair given both ways must
        agree); a region's own round trip defaults to ``intra_s`` seconds.

        Raises:
            ValueError: a round trip that is not a finite non-negative number, or a pair given twice differently.
        """
        rtt: dict[tuple[str, str], float] = {}
        regions: set[str] = set()
        for a, row in pairs.items():
            regions.add(a)
            for b, value in row.items():
                regions.add(b)
                v = float(value)
                if not (math.isfinite(v) and v >= 0.0):
                    raise ValueError(f"round trip {a} <-> {b} must be a finite number >= 0 s, got {value!r}")
                if rtt.get((a, b), v) != v:
                    raise ValueError(f"round trip {a} <-> {b} given twice: {rtt[(a, b)]} and {v} s")
                rtt[(a, b)] = rtt[(b, a)] = v
        if not (math.isfinite(intra_s) and intra_s >= 0.0):
            raise ValueError(f"intra_s must be a finite number >= 0 s, got {intra_s!r}")
        for r in regions:
            rtt.setdefault((r, r), intra_s)
        return cls(rtt=rtt, regions=frozenset(regions))

    def rtt_s(self, a: str, b: str) -> float | None:
        """Round trip between regions ``a`` and ``b``, seconds; None when the pair is unknown."""
        return self.rtt.get((a, b))

    def missing_pairs(self) -> list[tuple[str, str]]:
        """Pairs of distinct regions with no round trip (sorted; each pair once)."""
        names = sorted(self.regions)
        return [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if (a, b) not in self.rtt]


@dataclass(frozen=True, slots=True)
class LadderParams:
    """The ladder's bounds (defaults are the documented ones, docs/regions.md).

    Attributes:
        margin_s: while the home region is up, another region is chosen only when its best predicted TTFT
            (round trip included) is lower than the home region's best by more than this, seconds.
        max_regions: most regions on one request's ladder (regions known down are skipped, not counted).
        max_extra_rtt_s: a region is on the ladder only if its round trip exceeds the home region's by at most
            this, seconds.
        attempts_per_region: consecutive places a region gets in the ranking before the next region's best
            (retries after connection failures step down the ladder).
        retry_after_s: ``Retry-After`` of a refusal, seconds.
    """

    margin_s: float = 0.1
    max_regions: int = 2
    max_extra_rtt_s: float = 0.3
    attempts_per_region: int = 2
    retry_after_s: float = 5.0

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a bound out of range (a configuration error)."""
        for name in ("margin_s", "max_extra_rtt_s", "retry_after_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.max_regions < 1 or self.attempts_per_region < 1:
            raise ValueError("max_regions and attempts_per_region must be >= 1")


@dataclass(frozen=True, slots=True)
class Rung:
    """One region on a request's ladder.

    Attributes:
        region: the region.
        rtt_s: round trip between the client's region and it, seconds.
        extra_s: round trip beyond the home region's, seconds.
    """

    region: str
    rtt_s: float
    extra_s: float


@dataclass(frozen=True, slots=True)
class LadderPlan:
    """The regions a request may be served in, nearest first, and why the others are not.

    Attributes:
        client_region: the client's region (the request's, else the router's home region).
        home: the nearest allowed region, up or not (where the client is normally served).
        home_up: whether the home region has routable replicas (else the rungs are failover rungs).
        rungs: the regions on the ladder, nearest first.
        skipped: ``(region, reason)`` of each region left off (``SkipReason``), nearest first.
    """

    client_region: str
    home: str
    home_up: bool
    rungs: tuple[Rung, ...]
    skipped: tuple[tuple[str, SkipReason], ...] = ()


def plan_ladder(
    client_region: str,
    allowed: frozenset[str] | None,
    up_regions: Iterable[str],
    matrix: LatencyMatrix,
    params: LadderParams,
) -> LadderPlan:
    """The ladder of one request: the allowed regions with routable replicas (``up_regions``), nearest first,
    within ``max_extra_rtt_s`` of the home region and at most ``max_regions`` of them.

    Raises:
        RegionRefused: see its reasons; the plan so far is attached.
    """
    retry = params.retry_after_s
    if client_region not in matrix.regions:
        raise RegionRefused(
            "unknown_client_region", f"client region {client_region!r} is not configured", retry
        )
    if allowed is not None and not allowed:
        raise RegionRefused("residency_empty", "the request allows no region", retry)
    up = set(up_regions)
    skipped: list[tuple[str, SkipReason]] = []
    permitted = matrix.regions if allowed is None else matrix.regions & allowed
    priced: list[tuple[float, str]] = []
    for r in sorted(permitted):
        rtt = matrix.rtt_s(client_region, r)
        if rtt is None:
            skipped.append((r, "unpriced"))
        else:
            priced.append((rtt, r))
    priced.sort()
    for r in sorted(up - matrix.regions):
        skipped.append((r, "unpriced"))  # replicas of a region the matrix does not know (or with none)
    for r in sorted((up & matrix.regions) - permitted):
        skipped.append((r, "residency"))
    if not priced:
        plan = LadderPlan(client_region, "", False, (), tuple(skipped))
        raise RegionRefused(
            "no_allowed_region_up", f"no allowed region is known: {_names(allowed)}", retry, plan
        )
    home_rtt, home = priced[0]
    rungs: list[Rung] = []
    for rtt, r in priced:
        if r not in up:
            skipped.append((r, "down"))
        elif rtt - home_rtt > params.max_extra_rtt_s:
            skipped.append((r, "too_far"))
        elif len(rungs) >= params.max_regions:
            skipped.append((r, "max_regions"))
        else:
            rungs.append(Rung(r, rtt, rtt - home_rtt))
    plan = LadderPlan(client_region, home, home in up, tuple(rungs), tuple(skipped))
    if not rungs:
        if up & {r for _, r in priced}:
            raise RegionRefused(
                "beyond_ladder", "no allowed region up within the ladder's bounds", retry, plan
            )
        raise RegionRefused(
            "no_allowed_region_up", f"no allowed region is up: {_names(allowed)}", retry, plan
        )
    return plan


def _names(allowed: frozenset[str] | None) -> str:
    return "any" if allowed is None else ",".join(sorted(allowed)) or "none"


def with_round_trips(candidates: Sequence[Candidate], rtt_by_region: Mapping[str, float]) -> list[Candidate]:
    """Copies of the candidates whose region is in ``rtt_by_region``, each with that region's round trip as its
    ``rtt_s`` (seconds); the others are left out. The caller's candidates are not changed."""
    return [replace(c, rtt_s=rtt_by_region[c.region]) for c in candidates if c.region in rtt_by_region]


def ladder_ranking(
    candidates: Sequence[Candidate],
    decision: Decision,
    home: str | None,
    margin_s: float,
    attempts_per_region: int,
) -> list[int]:
    """Replica indices, best first, for the ladder: the inner decision's scores plus ``margin_s`` for a replica
    outside the ``home`` region (None: no home region up, no margin), each region at most ``attempts_per_region``
    consecutive places before the next region's best.

    While home is up, a replica elsewhere goes ahead of home's replicas only when it is also *faster*: its
    predicted TTFT (``E``, round trip included) plus ``margin_s`` below the best home replica's. The score alone
    would let the work term (the prefill seconds a candidate's cached prefix saves its engines) carry another
    region whose predicted TTFT is the higher one (a busy region holding the prompt). A replica elsewhere that is
    not faster follows the home replicas (it stays on the ladder for retries).

    Candidates the inner decision ranked but did not score (a pruned decision) follow the scored ones in the inner
    ranking's order; candidates it left out of its ranking (excluded) are left out here too.
    """
    region = {c.index: c.region for c in candidates}
    score = {s.index: s.score for s in decision.scores}
    ranked = decision.ranking
    place = {idx: k for k, idx in enumerate(ranked)}
    best_home = _best_home_ttft(decision, region, home)
    ttft = {s.index: predicted_ttft_s(s) for s in decision.scores}

    def key(idx: int) -> tuple[int, float, int]:
        s = score.get(idx)
        if s is None or not math.isfinite(s):
            return 2, math.inf, place[idx]
        if home is None or region[idx] == home:
            return 0, s, place[idx]
        faster = best_home is None or ttft.get(idx, math.inf) + margin_s < best_home
        return (0 if faster else 1), s + margin_s, place[idx]

    order = sorted(ranked, key=key)
    seen: dict[str, int] = {}
    rounds: list[tuple[int, tuple[int, float, int], int]] = []
    for idx in order:
        k = seen.get(region[idx], 0)
        seen[region[idx]] = k + 1
        rounds.append((k // attempts_per_region, key(idx), idx))
    rounds.sort()
    return [idx for _, _, idx in rounds]


def _best_home_ttft(decision: Decision, region: Mapping[int, str], home: str | None) -> float | None:
    """The lowest finite predicted TTFT among the home region's scored replicas, seconds (None: none)."""
    if home is None:
        return None
    return best_predicted_ttft_s(decision.scores, [i for i in decision.ranking if region.get(i) == home])


@dataclass(slots=True)
class RegionLoad:
    """What one region publishes about its load (the peer summary's load part; ``region_load``).

    Attributes:
        replicas: routable replicas.
        queue_s_min: the shortest predicted queue wait among them, seconds (a new request's best case).
        queue_s_mean: the mean predicted queue wait, seconds.
        kv_free: the mean free KV fraction (1 - KV usage; unknown usage counts as full), 0..1.
    """

    replicas: int = 0
    queue_s_min: float = math.inf
    queue_s_mean: float = math.inf
    kv_free: float = 0.0


def queue_seconds(candidate: Candidate, mean_prefill_tokens: float) -> float:
    """Predicted queue wait of one replica, seconds: (scraped queued prefill tokens, else queued requests x
    ``mean_prefill_tokens``, else 0) + the router's in-flight prefill tokens, over the profile's prefill rate. A
    broken gauge or rate gives ``inf`` (a region is never made to look idle by bad data)."""
    load = candidate.load
    qt, qr = load.queued_prefill_tokens, load.queued_requests
    rate = candidate.profile.prefill_tokens_per_s
    try:
        backlog = float(qt) if qt is not None else (0.0 if qr is None else qr * mean_prefill_tokens)
        q = (backlog + float(load.inflight_prefill_tokens)) / rate
    except (ArithmeticError, ValueError, TypeError):
        return math.inf
    return q if q >= 0.0 and math.isfinite(q) else math.inf


def region_load(candidates: Iterable[Candidate], mean_prefill_tokens: float) -> RegionLoad:
    """The ``RegionLoad`` of the given (one region's routable) replicas."""
    waits: list[float] = []
    free = 0.0
    for c in candidates:
        waits.append(queue_seconds(c, mean_prefill_tokens))
        kv = c.load.kv_usage
        free += 1.0 - kv if kv is not None and 0.0 <= kv <= 1.0 else 0.0
    if not waits:
        return RegionLoad()
    return RegionLoad(len(waits), min(waits), sum(waits) / len(waits), free / len(waits))


def _by_region(candidates: Iterable[Candidate]) -> dict[str, list[Candidate]]:
    out: dict[str, list[Candidate]] = {}
    for c in candidates:
        out.setdefault(c.region, []).append(c)
    return out


@dataclass(slots=True)
class _Counted:
    """Outcome counts of a regional policy (the router exports them as metrics)."""

    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


class RegionLadderPolicy:
    """kvroute's regional policy: the failover ladder around an inner policy (``ttft``) that prices distance.

    One inner decision over every replica on the ladder (their ``rtt_s`` set), so the inner policy's state (the
    migration penalty's popularity counts, calibration) sees each request once and a move away from the home
    region's cached copy is charged like any other move. The inner policy must score every candidate it ranks
    (``ttft`` with ``prune=False``: ``with_ttft``); a candidate it ranks without a score follows the scored ones.

    Branches: ``home`` (served in the home region), ``faster_region`` (another region predicted faster by more
    than the margin), ``failover`` (the home region has no routable replica). Refusals raise ``RegionRefused``.

    Args:
        inner: the policy deciding among the ladder's replicas.
        matrix: round trips between regions, seconds.
        home_region: the router's own region (the client's when the request names none).
        params: the ladder's bounds.
    """

    name = "region_ladder"

    def __init__(
        self, inner: Policy, matrix: LatencyMatrix, home_region: str, params: LadderParams | None = None
    ) -> None:
        self.inner = inner
        self.matrix = matrix
        self.home_region = home_region
        self.params = params or LadderParams()
        self._counted = _Counted()
        #: the last request's ladder (for logs: rungs, skipped regions and why), None after a refusal before it
        self.last_plan: LadderPlan | None = None

    @classmethod
    def with_ttft(
        cls,
        matrix: LatencyMatrix,
        home_region: str,
        params: LadderParams | None = None,
        **ttft_params: Any,
    ) -> RegionLadderPolicy:
        """The ladder around a full-scoring ``ttft`` (``TTFTPolicy(prune=False, **ttft_params)``)."""
        return cls(TTFTPolicy(prune=False, **ttft_params), matrix, home_region, params)

    @property
    def counts(self) -> dict[str, int]:
        """Decisions per branch and refusals per reason (``refused_<reason>``), cumulative."""
        return self._counted.counts

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The ladder's decision (module docstring); raises ``RegionRefused`` when no region may serve it."""
        client = request.client_region or self.home_region
        self.last_plan = None
        try:
            plan = plan_ladder(
                client, request.allowed_regions, {c.region for c in candidates}, self.matrix, self.params
            )
        except RegionRefused as refusal:
            self.last_plan = refusal.plan
            self._counted.count(f"refused_{refusal.reason}")
            raise
        self.last_plan = plan
        on = with_round_trips(candidates, {r.region: r.rtt_s for r in plan.rungs})
        inner = self.inner.choose(request, on)
        home = plan.home if plan.home_up else None
        p = self.params
        ranking = ladder_ranking(on, inner, home, p.margin_s, p.attempts_per_region)
        if not ranking:  # nothing the inner policy could rank (it always ranks someone): keep its choice
            ranking = [inner.chosen]
        chosen = ranking[0]
        region = next(c.region for c in on if c.index == chosen)
        branch = "failover" if home is None else ("home" if region == home else "faster_region")
        self._counted.count(branch)
        return Decision(chosen=chosen, ranking=ranking, scores=inner.scores, policy=self.name, branch=branch)

    def observe(self, observation: Observation) -> None:
        """Feedback to the inner policy (engine-side times: the caller takes the round trip out of the TTFT)."""
        self.inner.observe(observation)


class RegionLocalPolicy:
    """Baseline: each region serves its own clients only (independent per-region deployments behind per-region
    endpoints). The inner policy decides among the client region's replicas; none routable -> ``RegionRefused``
    (``no_allowed_region_up``). It does not read the request's residency (the client picks the endpoint)."""

    name = "region_local"

    def __init__(self, inner: Policy, matrix: LatencyMatrix, home_region: str, retry_after_s: float = 5.0):
        self.inner = inner
        self.matrix = matrix
        self.home_region = home_region
        self.retry_after_s = retry_after_s

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The inner decision among the client region's replicas."""
        client = request.client_region or self.home_region
        rtt = self.matrix.rtt_s(client, client)
        local = with_round_trips(candidates, {client: rtt or 0.0})
        if not local:
            raise RegionRefused(
                "no_allowed_region_up", f"region {client} has no routable replica", self.retry_after_s
            )
        d = self.inner.choose(request, local)
        d.policy = self.name
        return d

    def observe(self, observation: Observation) -> None:
        """Feedback to the inner policy."""
        self.inner.observe(observation)


class RegionNearestPolicy:
    """Baseline: the nearest region with capacity, as GeoDNS does (latency-based records, health checks, a
    shed-load threshold): regions with routable replicas by round trip from the client; the first whose shortest
    predicted queue wait (``region_load``) is at most ``shed_queue_s`` seconds, else the nearest. The inner policy
    decides within it. DNS answers before the request exists, so residency is not read.

    Args:
        inner, matrix, home_region: as ``RegionLadderPolicy``.
        shed_queue_s: a region whose best replica would queue longer than this sheds new clients, seconds.
        mean_prefill_tokens: uncached tokens per queued request when only the count is known, tokens.
    """

    name = "region_nearest"

    def __init__(
        self,
        inner: Policy,
        matrix: LatencyMatrix,
        home_region: str,
        shed_queue_s: float = 2.0,
        mean_prefill_tokens: float = 1024.0,
        retry_after_s: float = 5.0,
    ) -> None:
        self.inner = inner
        self.matrix = matrix
        self.home_region = home_region
        self.shed_queue_s = shed_queue_s
        self.mean_prefill_tokens = mean_prefill_tokens
        self.retry_after_s = retry_after_s

    def region_for(self, client: str, candidates: Sequence[Candidate]) -> str | None:
        """The region GeoDNS answers for a client in ``client``: the nearest with capacity, else the nearest;
        None when no priced region has a routable replica."""
        groups = _by_region(candidates)
        near: list[tuple[float, str]] = []
        for r in groups:
            rtt = self.matrix.rtt_s(client, r)
            if rtt is not None:
                near.append((rtt, r))
        near.sort()
        for _, r in near:
            if region_load(groups[r], self.mean_prefill_tokens).queue_s_min <= self.shed_queue_s:
                return r
        return near[0][1] if near else None

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The inner decision among the replicas of ``region_for``."""
        client = request.client_region or self.home_region
        region = self.region_for(client, candidates)
        if region is None:
            raise RegionRefused(
                "no_allowed_region_up", "no region has a routable replica", self.retry_after_s
            )
        rtt = self.matrix.rtt_s(client, region) or 0.0
        d = self.inner.choose(request, with_round_trips(candidates, {region: rtt}))
        d.policy = self.name
        return d

    def observe(self, observation: Observation) -> None:
        """Feedback to the inner policy."""
        self.inner.observe(observation)
