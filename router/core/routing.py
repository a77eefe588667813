"""The routing glue: request -> token ids -> block keys -> index match -> candidates -> policy -> Decision.

Also owns what the proxy needs around a decision: in-flight accounting on ``Replica.load`` (taken BEFORE the
request is dispatched, released at the end), predicted index entries for replicas without KV events, the
replica profiles used by the cost model, and the errors the HTTP layer turns into 4xx / 5xx answers.

Everything here runs on the event loop thread; the index and the replica table are only mutated from it (or
under their own locks).

Units: tokens, blocks (``block_size`` tokens), seconds.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from index.hashing import block_keys, root_seed
from index.prefix_index import PrefixIndex
from membership.engine_metrics import EngineSnapshot
from membership.replicas import REGION_LABEL, Replica, ReplicaState, ReplicaTable
from policies.adapters import AdapterResidency
from policies.base import (
    NO_HIT,
    Candidate,
    CandidateScore,
    Decision,
    LoadView,
    Observation,
    Policy,
    PrefixHit,
    ReplicaProfile,
    RouteRequest,
    TierLink,
    prompt_blocks_read,
    reuse_of,
)
from policies.candidates import FactsRow, ReplicaFacts, build_pd_candidates, candidates_from, rows_of
from policies.hits import hit_from_match, usable_cached_tokens  # noqa: F401  (re-exported)
from policies.pd_base import (
    ROLES,
    DecodeLeg,
    HandoffLink,
    PdCandidate,
    PdPolicy,
    Plan,
    PlanDecision,
    handoff_end_s,
)
from policies.pd_common import plan_request
from policies.pd_link import LinkEstimator, TransferTotals, transfer_sample
from policies.regions import RegionRefused
from policies.ttft_columns import ColumnCandidates
from router.core.fleet_columns import FleetColumns
from router.core.regions import PeerViews
from router.errors import KvrouteError

log = logging.getLogger("kvroute.routing")
#: handles of recorded decode legs (``Router.note_handoff``): unique in the process
_LEG_HANDLES = itertools.count(1)

#: Built-in replica profiles by name, matching the stand-in engine's hardware profiles
#: (``fakes.engine_model.PROFILES[name].replica_profile()``; a unit test checks they agree).
BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "a100": {
        "prefill_tokens_per_s": 11231.10151187905,
        "fixed_overhead_s": 0.0,
        "attention_s_per_token2": 3.780923076923077e-09,
        "bytes_per_token": 147456.0,
        "decode_interference_s": 8.903846153846154e-05,
    },
    "h20": {
        "prefill_tokens_per_s": 5327.573794096472,
        "fixed_overhead_s": 0.0,
        "attention_s_per_token2": 7.970594594594595e-09,
        "bytes_per_token": 147456.0,
        "decode_interference_s": 0.0001877027027027027,
    },
    "rtx6000": {
        "prefill_tokens_per_s": 32894.73684210526,
        "fixed_overhead_s": 0.02622,
        "attention_s_per_token2": 3e-09,
        "bytes_per_token": 147456.0,
        "decode_interference_s": 3.04e-05,
    },
}

_PROFILE_FIELDS = {f.name for f in fields(ReplicaProfile)}


def build_profile(
    name: str | None,
    overrides: dict[str, dict[str, Any]] | None = None,
    default: str = "a100",
    tier_links: dict[str, TierLink] | None = None,
) -> ReplicaProfile:
    """The ReplicaProfile called ``name`` (built-in, updated by ``overrides[name]``; ``default`` when None).
    ``tier_links``: the fleet's fetch link per non-GPU tier (Settings ``kv_tier_bandwidth_gbps`` /
    ``kv_tier_latency_s``: ``tier_links_of``), the default of every profile's ``tiers`` (a profile's own win).

    Raises:
        ValueError: unknown profile name or unknown profile field (message lists the known ones).
    """
    name = (name or default).lower()
    overrides = overrides or {}
    if name not in BUILTIN_PROFILES and name not in overrides:
        known = sorted(set(BUILTIN_PROFILES) | set(overrides))
        raise ValueError(f"unknown replica profile {name!r}; known: {', '.join(known)}")
    params: dict[str, Any] = dict(BUILTIN_PROFILES.get(name, {}))
    params.update(overrides.get(name, {}))
    unknown = set(params) - _PROFILE_FIELDS
    if unknown:
        raise ValueError(
            f"profile {name!r}: unknown fields {sorted(unknown)}; known: {sorted(_PROFILE_FIELDS)}"
        )
    tiers = params.pop("tiers", {}) or {}
    prof = ReplicaProfile(**params)
    own = {t: v if isinstance(v, TierLink) else TierLink(**v) for t, v in tiers.items()}
    prof.tiers = {**{t: replace(link) for t, link in (tier_links or {}).items()}, **own}
    return prof


def tier_links_of(bandwidth_gbps: dict[str, float], latency_s: dict[str, float]) -> dict[str, TierLink]:
    """The fetch link per non-GPU tier from the Settings tier table: bandwidth in GB/s (1e9 bytes/s), latency in
    seconds (absent: 0). A tier of bandwidth 0 has no link (its matched tokens are not reused)."""
    return {
        t: TierLink(bandwidth_bytes_per_s=gbps * 1e9, lookup_latency_s=latency_s.get(t, 0.0))
        for t, gbps in bandwidth_gbps.items()
        if t != "gpu" and gbps > 0
    }


# ---------------------------------------------------------------------------------------------------------
# errors (the kvroute family: router/errors.py)
# ---------------------------------------------------------------------------------------------------------


class RoutingError(KvrouteError):
    """A request cannot be routed. ``status`` is the HTTP status, ``code`` a stable machine-readable reason;
    503 and 429 are answered with ``Retry-After``."""

    status = 503
    code = "routing_error"
    retry = True

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param)


class UnknownModel(RoutingError):
    """No known replica serves the requested model / LoRA adapter (404)."""

    status = 404
    code = "model_not_found"
    retry = False


class NoReplica(RoutingError):
    """Replicas serve the model but none is routable right now (503)."""

    status = 503
    code = "no_routable_replica"


class RegionUnavailable(RoutingError):
    """No region the request may use can serve it within the failover ladder's bounds (``policies.regions``
    ``RegionRefused``): 503 with the ladder's ``Retry-After`` (400 for a client region the matrix does not know)."""

    status = 503
    code = "region_unavailable"

    def __init__(self, refusal: RegionRefused) -> None:
        super().__init__(str(refusal))
        self.wire_reason = f"region_{refusal.reason}"
        self.retry_after_s = refusal.retry_after_s
        if refusal.reason == "unknown_client_region":
            self.status, self.retry = 400, False


class Overloaded(RoutingError):
    """Every candidate (or the router) is at its in-flight limit (429, with Retry-After)."""

    status = 429
    code = "overloaded"


class FleetColumnsStale(AssertionError):
    """``check_columns``: a kept fleet column differs from the replica it copies (a writer did not call
    ``ReplicaTable.touch``). Never raised unless the check is on."""


class BadRequest(RoutingError):
    """The request is well-formed JSON but cannot be served (400), e.g. a prompt longer than any context."""

    status = 400
    code = "invalid_request"
    retry = False


# ---------------------------------------------------------------------------------------------------------
# decisions
# ---------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RoutingInput:
    """What a request contributes to a decision.

    Attributes:
        model: the model id as requested (a LoRA adapter name when ``lora`` is set).
        lora: the LoRA adapter requested, or None.
        token_ids: the prompt's token ids.
        keys: chained block keys of the prompt's full blocks.
        seed: the root seed used for ``keys``.
        session_id, request_id: from headers.
        expected_output_tokens: ``max_tokens`` when given, else 0, times ``copies``, tokens.
        copies: sequences the engine generates for it (OpenAI ``n`` / vLLM ``best_of``, at least 1): it counts
            as this many requests in flight on its replica.
        ttft_target_s: the request's TTFT target, seconds (None: none); priority: its class priority;
            identity: its ``router.core.tenants.Identity``.
        trace: its ``router.tracing.RequestTrace`` (set by the pipeline; None when tracing is off).
        estimated_tokens: set when ``token_ids`` are only a prefix of the prompt's ids (cache-frontier
            tokenization, ``router.tokens.frontier``): the estimated length of the whole prompt, tokens; None
            when the ids are complete.
        hop: the request came from another region's router (``router.core.regions``): it is served by this
            region's engines or refused, never forwarded to a peer region again.
        allowed_regions: data residency, the regions allowed to process it (None = any; ``router.core.regions``).
        client_region: the client's region named by an edge (None: the router's own region).
        pinned_to: the only replica that may serve it (no retry elsewhere, no re-decision); None: any.
    """

    model: str
    lora: str | None
    token_ids: list[int]
    keys: list[int]
    seed: int
    session_id: str | None = None
    request_id: str = ""
    expected_output_tokens: int = 0
    copies: int = 1
    ttft_target_s: float | None = None
    priority: int = 0
    identity: Any = None  # router.core.tenants.Identity of the request (set by the front door)
    estimated_tokens: int | None = None
    hop: bool = False
    allowed_regions: frozenset[str] | None = None
    client_region: str | None = None
    #: the index of the only replica that may serve it (it holds the request's state: a Responses API chain)
    pinned_to: int | None = None
    #: the request's ``router.tracing.RequestTrace`` (None: tracing off, or not a served request)
    trace: Any = None

    @property
    def ids_partial(self) -> bool:
        """True when ``token_ids`` hold only a prefix of the prompt (never forward them to an engine)."""
        return self.estimated_tokens is not None

    @property
    def prompt_tokens(self) -> int:
        """Prompt length, tokens: ``len(token_ids)``, or the estimate when the ids are partial."""
        return len(self.token_ids) if self.estimated_tokens is None else self.estimated_tokens


def _position(idx: Any, index: int) -> int | None:
    """Position of replica ``index`` in the ascending index array ``idx``, or None."""
    p = int(idx.searchsorted(index))
    return p if p < len(idx) and int(idx[p]) == index else None


def candidate_indices(cands: Sequence[Candidate]) -> list[int]:
    """The replica index of every candidate, in order (column candidates: without building them)."""
    if isinstance(cands, ColumnCandidates):
        out: list[int] = cands.columns.index.tolist()
        return out
    return [c.index for c in cands]


def candidates_by_index(cands: Sequence[Candidate], wanted: Iterable[int]) -> dict[int, Candidate]:
    """The candidates of replicas ``wanted`` (those among ``cands``) by replica index; column candidates build
    only those."""
    if isinstance(cands, ColumnCandidates):
        out = {}
        for i in wanted:
            p = _position(cands.columns.index, i)
            if p is not None:
                out[i] = cands[p]
        return out
    want = set(wanted)
    return {c.index: c for c in cands if c.index in want}


def cached_tokens(cands: Sequence[Candidate]) -> dict[int, int]:
    """``Routed.cached_tokens`` of ``cands``: the matched tokens of every candidate holding part of the prompt;
    the candidates with the shared empty hit (most of a large fleet's) are left out (0 tokens: read with
    ``.get(index, 0)``), so neither this nor each request's copy of it (``router.engine.proxy``) grows with the
    fleet."""
    no_hit = NO_HIT
    return {c.index: h.total for c in cands if (h := c.hit) is not no_hit}


@dataclass(slots=True)
class Routed:
    """A decision plus what the proxy and /route need to act on it and explain it.

    Attributes:
        inp: the routing input.
        decision: the policy's decision.
        candidates: the candidates given to the policy (routable replicas serving the model).
        cached_tokens: per candidate index, prompt tokens the engine is expected to reuse there, tokens; a
            candidate holding nothing of the prompt may be absent (read with ``.get(index, 0)``).
        decision_s: time spent tokenizing + hashing + matching + choosing, seconds.
    """

    inp: RoutingInput
    decision: Decision
    candidates: Sequence[Candidate]
    cached_tokens: dict[int, int]
    decision_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: the PD plan decision on a prefill/decode fleet (``Router.decide_plan``); None on co-located fleets
    plan: PlanDecision | None = None

    @property
    def disaggregated(self) -> bool:
        """True when the chosen plan prefills on one replica and decodes on another."""
        return (
            self.plan is not None
            and self.plan.chosen.kind == "disaggregated"
            and self.plan.chosen.prefill is not None
        )


class Router:
    """Makes routing decisions and keeps the per-replica accounting around them.

    Args:
        table: the replica table (membership).
        index: the prefix index.
        policy: the routing policy.
        block_size: tokens per block.
        seed_model: model id folded into the root seed instead of the request's (None = the request's).
        seed_include_lora: fold the LoRA adapter into the root seed.
        objective: ``mean`` or ``tail``.
        predict_mode: ``auto`` (predicted entries only for replicas without healthy events), ``always``, ``never``.
        events_healthy: ``f(replica) -> bool``: True when the replica's KV events feed the index reliably.
        max_inflight_per_replica: replicas at this many in-flight requests are skipped.
        panic_routing: when no replica is ready, route to the unhealthy ones instead of answering 503.
        columns_min_candidates: base-model decisions over at least this many routable replicas run on the kept
            fleet columns (``router.core.fleet_columns``) when the policy accepts columns; 0: never.
        check_columns: compare the kept columns with the replicas at every decision (``FleetColumnsStale`` if stale).
        clock: seconds (monotonic) for ``RouteRequest.now``.
    """

    def __init__(
        self,
        table: ReplicaTable,
        index: PrefixIndex,
        policy: Policy,
        *,
        block_size: int = 16,
        seed_model: str | None = None,
        seed_include_lora: bool = True,
        objective: str = "mean",
        predict_mode: str = "auto",
        events_healthy: Callable[[Replica], bool] | None = None,
        max_inflight_per_replica: int = 512,
        panic_routing: bool = True,
        columns_min_candidates: int = 0,
        check_columns: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.index = index
        self.policy = policy
        self.block_size = block_size
        self.seed_model = seed_model
        self.seed_include_lora = seed_include_lora
        self.objective = objective
        self.predict_mode = predict_mode
        self.events_healthy = events_healthy or (lambda rep: False)
        self.max_inflight_per_replica = max_inflight_per_replica
        self.clock = clock
        self._seed_cache: dict[tuple[str, str | None, str | None], int] = {}
        self._pending: dict[int, int] = {}  # replica index -> prefill tokens dispatched, first byte pending
        #: True: a request's prefill tokens stop counting at its first byte. False when an engine-metrics
        #: scraper owns ``inflight_prefill_tokens`` (it subtracts what was dispatched before each scrape).
        self.prefill_release_on_first_byte = True
        #: route to unhealthy replicas when none is ready (counted in ``panic_decisions``)
        self.panic_routing = panic_routing
        self.panic_decisions = 0
        #: called with (replica, keys) after predicted entries are recorded (membership broadcasts them to peers)
        self.on_prediction: list[Callable[[Replica, Sequence[int]], None]] = []
        #: called with every observation after the policy (per-tenant / per-class TTFT metrics)
        self.on_observation: list[Callable[[Observation], None]] = []
        #: prefill/decode disaggregation: builds the PD plan policy on first use (``router.services``
        #: sets it from ``Settings.pd_policy``); None: every fleet is routed co-located
        self.pd_policy_factory: Callable[[], PdPolicy] | None = None
        self._pd_policy: PdPolicy | None = None
        #: the P->D KV link of the fleet (``Settings.pd_link_bandwidth_gbps`` / ``pd_link_latency_s``)
        self.pd_link = HandoffLink(bandwidth_bytes_per_s=25e9)
        #: learns ``pd_link``'s bandwidth from observed handoffs (``Settings.pd_link_learn``); None: fixed link
        self.pd_link_estimator: LinkEstimator | None = None
        #: prefill replica index -> when (``clock``) the last handoff dispatched from it is predicted to have
        #: left its link: handoffs from one replica are serialised on its NIC (``PdCandidate.link_busy_s``)
        self._link_free_at: dict[int, float] = {}
        #: decode replica index -> leg handle -> (``clock`` time its KV is due there, prompt tokens): dispatched
        #: decode legs without their first byte yet (``note_handoff``; ``PdCandidate.decode_legs``)
        self._decode_legs: dict[int, dict[int, tuple[float, int]]] = {}
        #: replica index -> its last reported cumulative KV transfers (``observe_engine_transfers``)
        self._transfer_totals: dict[int, TransferTotals] = {}
        #: True once an engine-reported transfer was accepted: the relay's own samples are then not fed
        self.link_from_engines = False
        #: this router's region (``Settings.region``): the region of a replica without a region label (Kubernetes
        #: puts the topology labels on nodes, so a region's own pods often carry none); "" = regions off
        self.home_region = ""
        #: round trip to each peer region's router, seconds (``region_rtt_ms``): taken out of a TTFT observed
        #: through a peer, so the calibration sees the peer's own time (the ladder adds the round trip again)
        self.peer_rtt_s: dict[str, float] = {}
        #: every replica's LoRA adapters: residency predicted from this router's dispatches, corrected by the
        #: engines' ``vllm:lora_requests_info`` and deferred gauge (``observe_adapters``); prices a LoRA
        #: request's adapter on each candidate (``Candidate.adapter``)
        self.adapters = AdapterResidency()
        #: replica index -> requests the engine last reported waiting for an adapter slot (its deferred gauge)
        self.adapter_deferred: dict[int, int] = {}
        #: LoRA requests dispatched, by the adapter's predicted tier on the chosen replica (gpu, cpu, storage)
        self.adapter_dispatches: dict[str, int] = {"gpu": 0, "cpu": 0, "storage": 0}
        #: the peer regions' published summaries (queue seconds, prefix filter) and measured round trips; None
        #: without peers (a peer candidate is then only what this router sent it)
        self.peer_views: PeerViews | None = None
        #: the fleet's load and profiles as columns by replica index, for decisions over many replicas
        self.columns = FleetColumns(table, self.load_view)
        self.columns_min_candidates = columns_min_candidates
        self.check_columns = check_columns

    # -- models ----------------------------------------------------------------------------------------
    def resolve_model(self, model: str) -> tuple[str, str | None, str]:
        """Split a requested model id into (model, lora, base model).

        A name listed only as a LoRA adapter is a LoRA request; its base model (the first model of a replica
        holding the adapter) is what the root seed uses, as the KV-event side does.

        Raises:
            UnknownModel: no known replica (any state) serves ``model``.
        """
        reps = self.table.all()
        if not reps:
            raise NoReplica("no replicas are configured")
        if any(model in r.models for r in reps):
            return model, None, model
        holders = [r for r in reps if model in r.loras]
        if holders:
            base = next((r.models[0] for r in holders if r.models), model)
            return model, model, base
        if any(not r.models for r in reps):  # a replica whose models are unknown may serve it
            return model, None, model
        known = sorted({m for r in reps for m in (*r.models, *r.loras)})
        raise UnknownModel(
            f"model {model!r} is not served by any replica; known: {', '.join(known)}", param="model"
        )

    def served_models(self) -> list[dict[str, Any]]:
        """The union of the replicas' models and LoRA adapters, OpenAI ``/v1/models`` entries."""
        seen: dict[str, dict[str, Any]] = {}
        for r in self.table.all():
            for m in r.models:
                seen.setdefault(
                    m, {"id": m, "object": "model", "owned_by": "kvroute", "root": m, "parent": None}
                )
            for lo in r.loras:
                parent = r.models[0] if r.models else None
                seen.setdefault(
                    lo, {"id": lo, "object": "model", "owned_by": "kvroute", "root": lo, "parent": parent}
                )
        return list(seen.values())

    # -- keys ------------------------------------------------------------------------------------------
    def seed_for(
        self, model: str, lora: str | None = None, cache_salt: str | None = None, namespace: str | None = None
    ) -> int:
        """The root seed of prompts for ``model`` / ``lora`` / ``cache_salt`` (cached). ``namespace`` (a tenant
        with its own cache namespace) folds into the salt, so its prompts never match another namespace's."""
        if namespace is not None:
            cache_salt = f"{cache_salt or ''}\x1fkvroute-tenant={namespace}"
        key = (model, lora, cache_salt)
        seed = self._seed_cache.get(key)
        if seed is None:
            if len(self._seed_cache) > 10_000:
                self._seed_cache.clear()
            seed = root_seed(self.seed_model or model, lora if self.seed_include_lora else None, cache_salt)
            self._seed_cache[key] = seed
        return seed

    def make_input(
        self,
        model: str,
        lora: str | None,
        token_ids: list[int],
        *,
        base_model: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        request_id: str = "",
        expected_output_tokens: int = 0,
        copies: int = 1,
        namespace: str | None = None,
        ttft_target_s: float | None = None,
        priority: int = 0,
        keys: list[int] | None = None,
        estimated_tokens: int | None = None,
    ) -> RoutingInput:
        """Hash ``token_ids`` into block keys and bundle the routing input (``copies``: see ``RoutingInput``;
        ``expected_output_tokens`` is per sequence; ``namespace``: see ``seed_for``). ``keys``: the ids' block
        keys when the caller hashed them already (with ``seed_for`` of the same arguments); ``estimated_tokens``:
        the ids are a prefix of the prompt, whose length is estimated at this many tokens (``RoutingInput``)."""
        seed = self.seed_for(base_model or model, lora, cache_salt, namespace)
        if keys is None:
            keys = block_keys(token_ids, self.block_size, seed)
        copies = max(1, copies)
        return RoutingInput(
            model=model,
            lora=lora,
            token_ids=token_ids,
            keys=keys,
            seed=seed,
            session_id=session_id,
            request_id=request_id,
            expected_output_tokens=expected_output_tokens * copies,
            copies=copies,
            ttft_target_s=ttft_target_s,
            priority=priority,
            estimated_tokens=estimated_tokens,
        )

    # -- decisions -------------------------------------------------------------------------------------
    def candidates_for(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> list[Replica]:
        """Routable replicas serving the request's model / LoRA, minus ``exclude``.

        Raises:
            NoReplica: none is routable; Overloaded: all are at their in-flight limit;
            BadRequest: the prompt exceeds every candidate's context length.
        """
        reps = self.table.routable(None if inp.lora else inp.model, inp.lora, exclude)
        if inp.hop:  # hop limit 1: a request from another region's router is never handed to a peer again
            reps = [r for r in reps if not r.is_peer]
        if not reps and self.panic_routing:
            # every replica failed its health checks: rather than refusing all traffic on what may be false
            # positives (overloaded engines answer probes late), try the unhealthy ones (Envoy's panic mode)
            ex = set(exclude)
            reps = [
                r
                for r in self.table.all()
                if r.state == ReplicaState.UNHEALTHY
                and r.index not in ex
                and not r.is_peer
                and r.serves(None if inp.lora else inp.model, inp.lora)
            ]
            if reps:
                self.panic_decisions += 1
        if not reps:
            states = {
                r.name: r.state.value
                for r in self.table.all()
                if r.serves(None if inp.lora else inp.model, inp.lora)
            }
            raise NoReplica(
                f"no routable replica for model {inp.model!r} (replica states: {states or 'none'})"
            )
        n = inp.prompt_tokens
        limit = self.max_inflight_per_replica
        # one pass for both conditions (the errors tell them apart only when nothing is left)
        free = [
            r
            for r in reps
            if r.load.inflight_requests < limit and (not (mc := r.profile.max_context_tokens) or n <= mc)
        ]
        if free:
            return free
        if not any(not r.profile.max_context_tokens or n <= r.profile.max_context_tokens for r in reps):
            longest = max(r.profile.max_context_tokens for r in reps)
            raise BadRequest(
                f"prompt of {n} tokens is longer than any replica's context ({longest} tokens)",
                param="prompt",
            )
        raise Overloaded(f"every replica for model {inp.model!r} has {limit} requests in flight")

    def decide(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> Routed:
        """Match the prompt in the index, build candidates and ask the policy (the PD plan policy when the
        model's replicas have prefill/decode roles: ``decide_plan``).

        Raises:
            RoutingError subclasses (see ``candidates_for``).
        """
        if self.pd_policy_factory is not None and self.is_disaggregated(inp):
            return self.decide_plan(inp, exclude)
        t0 = time.perf_counter()
        cc = self.column_candidates(inp, exclude) if self._columnar(inp) else None
        cands: Sequence[Candidate]
        if cc is not None:
            cands = cc
            held: Sequence[Candidate] = list(cc.holders.values())  # every other candidate holds nothing
        else:
            reps = self.candidates_for(inp, exclude)
            if self.check_columns:
                self._check_columns(reps)
            cands = held = self.build_candidates(inp, self.fact_rows(inp, reps))
        req = self.route_request(inp)
        try:
            decision = self.policy.choose(req, cands)
        except RegionRefused as refusal:
            raise RegionUnavailable(refusal) from None
        decision.reuse = reuse_of(decision.chosen, held)  # available vs achieved cached tokens
        return Routed(
            inp=inp,
            decision=decision,
            candidates=cands,
            cached_tokens=cached_tokens(held),
            decision_s=time.perf_counter() - t0,
        )

    def _columnar(self, inp: RoutingInput) -> bool:
        """Whether ``inp``'s decision may run on the fleet columns: a base-model request, a policy that takes
        columns (``ttft``), no peer regions to price, and the columns switched on."""
        return bool(
            self.columns_min_candidates
            and not inp.lora
            and self.peer_views is None
            and getattr(self.policy, "accepts_columns", False)
        )

    def column_candidates(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> ColumnCandidates | None:
        """The candidates of a base-model decision as the fleet's columns (``router.core.fleet_columns``): the
        same replicas, in the same order, as ``candidates_for``; a ``Candidate`` built in advance for each replica
        holding part of the prompt, any other only when the policy reads it. None when fewer than
        ``columns_min_candidates`` are left (the object path then decides, or says why there is none)."""
        cols = self.columns
        cols.fresh()
        n = inp.prompt_tokens
        idx = cols.routable(inp.model, exclude, self.max_inflight_per_replica, n, inp.hop)
        if len(idx) < max(1, self.columns_min_candidates):
            return None
        if self.check_columns:
            self._check_columns(self.candidates_for(inp, exclude), idx.tolist())
        bc = cols.gather(idx)
        matches = self.index.match(inp.keys) if inp.keys else {}
        holders: dict[int, Candidate] = {}
        if matches:  # the holders' candidates as objects, their matches into the columns
            held = np.fromiter(matches, dtype=np.int64, count=len(matches))
            held.sort()
            at = np.minimum(np.searchsorted(idx, held), len(idx) - 1)
            ok = idx[at] == held
            pos, held = at[ok].tolist(), held[ok].tolist()
            by_index = self.table.by_index
            reps = [by_index(i) for i in held]
            pos = [p for p, r in zip(pos, reps, strict=True) if r is not None]
            found = [r for r in reps if r is not None]
            cands = candidates_from(self.fact_rows(inp, found), matches, n, self.block_size)
            holders = dict(zip(pos, cands, strict=True))
            hits = [c.hit for c in cands]
            bc.gpu[pos] = [h.gpu for h in hits]
            bc.other[pos] = [h.cpu + h.disk + h.remote for h in hits]
            bc.hit_age[pos] = [h.age_s for h in hits]
            bad = [p for p, h in zip(pos, hits, strict=True) if min(h.cpu, h.disk, h.remote) < 0]
            if bad:
                bc.plain[bad] = False
        table, bs = self.table, self.block_size
        index = idx.tolist()

        def build(p: int) -> Candidate:
            rep = table.by_index(index[p])
            if rep is None:  # left the table since the filter: it is built from nothing known
                raise NoReplica(f"replica {index[p]} left the fleet during the decision")
            return candidates_from(self.fact_rows(inp, [rep]), {}, n, bs)[0]

        return ColumnCandidates(bc, holders, build)

    def _check_columns(self, reps: Sequence[Replica], selected: list[int] | None = None) -> None:
        """``check_columns``: the kept columns equal the replicas' values (and the columns' filter selected
        ``reps``); raises ``FleetColumnsStale`` otherwise."""
        self.columns.fresh()
        wrong = self.columns.stale_rows(reps)
        if selected is not None and selected != [r.index for r in reps]:
            wrong.append(f"the columns selected {selected}, the objects {[r.index for r in reps]}")
        if wrong:
            raise FleetColumnsStale("; ".join(wrong[:10]))

    def fact_rows(self, inp: RoutingInput, reps: Sequence[Replica]) -> list[FactsRow]:
        """What a policy may know of each of ``reps`` for a co-located decision on ``inp`` (``facts``, as the
        builder's ``FactsRow``s); a base-model request's in one loop of tuples: every decision builds them for
        every routable replica (at 4,096 replicas a ``ReplicaFacts`` per replica was ~1.7 ms of each decision,
        ``python -m loadtest.bench_router_decide``)."""
        if inp.lora:
            return list(rows_of([self.facts(r, lora=inp.lora) for r in reps]))
        pending = self._pending
        home = self.home_region
        label = REGION_LABEL
        # ``rep.region`` inlined (a property call per replica) and the state's ``_value_`` (``Enum.value`` is a
        # Python-level descriptor): together ~40 % of this step at 4,096 replicas
        return [
            (
                rep.index,
                rep.name,
                self.load_view(rep) if pending and pending.get(rep.index) else rep.load,
                rep.profile,
                rep.state._value_,
                rep.labels.get(label, "") or home,
                rep.load.engine_block_size,
                None,
            )
            for rep in reps
        ]

    def facts(self, rep: Replica, *, pd: bool = False, lora: str | None = None) -> ReplicaFacts:
        """What a policy may know about ``rep``: its load view (this router's in-flight counts included), profile,
        state and engine block size; with ``pd`` also its role, DP ranks, link backlog and whether it serves
        alone (a co-located decision does not need them: not computed on that hot path); for a request for LoRA
        adapter ``lora``, the replica's adapters (``LoadView.adapters``) and the adapter's cost there."""
        load = rep.load
        view = self.load_view(rep)
        cost = None
        if lora is not None:
            view = replace(view, adapters=self.adapters.slots(rep.index))
            cost = self.adapters.cost(rep.index, lora, self.clock())
        facts = ReplicaFacts(
            rep.index,
            rep.name,
            view,
            rep.profile,
            rep.state._value_,
            load.engine_block_size,
            region=rep.region or self.home_region,
            adapter=cost,
        )
        if pd:
            facts.role = rep.role if rep.role in ROLES else "both"
            facts.dp_rank_count = max(1, rep.dp_size)
            facts.link_busy_s = self.link_busy_s(rep.index)
            facts.decode_legs = self.decode_legs(rep.index)
            facts.serves_alone = serves_alone(rep)
        return facts

    def build_candidates(self, inp: RoutingInput, rows: Iterable[FactsRow]) -> list[Candidate]:
        """The candidates for ``inp``: the prompt matched in the index over the ``rows``' replicas
        (``policies.candidates.candidates_from``)."""
        # every replica's match (the index's own set): the builder reads those of ``rows`` only, and building
        # the set of thousands of candidates' indices cost more than the few extra entries
        matches = self.index.match(inp.keys) if inp.keys else {}
        cands = candidates_from(rows, matches, inp.prompt_tokens, self.block_size)
        views = self.peer_views
        if views is None:
            return cands
        return [self._priced_peer(views, c, inp) for c in cands]

    def _priced_peer(self, views: PeerViews, cand: Candidate, inp: RoutingInput) -> Candidate:
        """A peer region's router priced from its published summary (``PeerViews.price``); others unchanged."""
        rep = self.table.by_index(cand.index)
        if rep is None or not rep.is_peer:
            return cand
        rate = self._priced_rate(cand.index)
        return views.price(cand, inp.model, inp.keys, self.block_size, inp.prompt_tokens, rate)

    def _priced_rate(self, index: int) -> float | None:
        """The prefill rate (tokens/s) the policy (inside the ladder or not) prices replica ``index`` at once it
        calibrated one (``ttft``'s ``calibrated``); None: its profile's."""
        inner = getattr(self.policy, "inner", self.policy)
        calibrated = getattr(inner, "calibrated", None)
        got = calibrated(index) if callable(calibrated) else None
        return float(got[0]) if got else None

    def route_request(self, inp: RoutingInput) -> RouteRequest:
        """The request as every policy sees it, co-located or PD: one builder, so no field is dropped on one
        path (the SLO target, the priority and the sequences reach PD plans too)."""
        return RouteRequest(
            model=inp.model,
            prompt_tokens=inp.prompt_tokens,
            block_keys=inp.keys,
            block_size=self.block_size,
            now=self.clock(),
            lora=inp.lora,
            session_id=inp.session_id,
            objective=self.objective,  # type: ignore[arg-type]
            expected_output_tokens=inp.expected_output_tokens,
            request_id=inp.request_id,
            ttft_target_s=inp.ttft_target_s,
            priority=inp.priority,
            sequences=inp.copies,
            allowed_regions=inp.allowed_regions,
            client_region=inp.client_region,
        )

    # -- prefill/decode disaggregation ----------------------------------------------------------------
    def is_disaggregated(self, inp: RoutingInput) -> bool:
        """True when a replica serving the request's model (any state) has the ``prefill`` or ``decode`` role:
        the model's requests are then planned by the PD plan policy. Co-located fleets never are."""
        model = None if inp.lora else inp.model
        return any(r.role in ("prefill", "decode") and r.serves(model, inp.lora) for r in self.table.all())

    def pd_policy(self) -> PdPolicy:
        """The PD plan policy (built on first use).

        Raises:
            NoReplica: no PD policy is configured, or its name is unknown (the message says which).
        """
        if self._pd_policy is None:
            if self.pd_policy_factory is None:
                raise NoReplica("prefill/decode replicas are configured but no PD plan policy is")
            try:
                self._pd_policy = self.pd_policy_factory()
            except (KeyError, TypeError, ValueError) as exc:
                raise NoReplica(f"cannot build the PD plan policy: {exc}") from None
        return self._pd_policy

    def decide_plan(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> Routed:
        """The PD plan for a request: in place on one replica, or prefill on P and decode on D.

        Candidates are the routable replicas serving the model (every role), each with its prefix hit, load
        view (this router's in-flight counts included: both legs of earlier plans are charged at dispatch) and
        role. The returned ``Routed`` carries the plan decision (``plan``) and, for the proxy's attempt
        machinery, a co-located ``Decision`` over the replicas that can serve in place (``both`` / ``decode``),
        best plan first.

        Raises:
            RoutingError subclasses (see ``candidates_for``); NoReplica when no plan is feasible.
        """
        t0 = time.perf_counter()
        facts = [self.facts(r, pd=True, lora=inp.lora) for r in self.candidates_for(inp, exclude)]
        cands = self.build_candidates(inp, rows_of(facts))
        pd_cands = build_pd_candidates(facts, cands)
        req = self.route_request(inp)
        try:
            plan = plan_request(self.pd_policy(), req, pd_cands, self.pd_link)
        except ValueError as exc:  # no feasible plan (e.g. only prefill replicas are routable)
            raise NoReplica(f"no feasible prefill/decode plan for model {inp.model!r}: {exc}") from None
        self.pin_dp_rank(plan.chosen, inp)
        decision = plan_as_decision(plan, pd_cands)
        prefiller = plan.chosen.prefill if plan.chosen.prefill is not None else plan.chosen.decode
        plan.reuse = decision.reuse = reuse_of(prefiller, cands)
        return Routed(
            inp=inp,
            decision=decision,
            candidates=cands,
            cached_tokens=cached_tokens(cands),
            decision_s=time.perf_counter() - t0,
            plan=plan,
        )

    def link_busy_s(self, index: int) -> float:
        """Seconds until replica ``index``'s outgoing KV link has sent the handoffs this router dispatched."""
        free_at = self._link_free_at.get(index)
        if free_at is None:
            return 0.0
        busy = free_at - self.clock()
        if busy <= 0:
            del self._link_free_at[index]
            return 0.0
        return busy

    def note_handoff(self, plan: Plan, decode_tokens: int | None = None) -> int | None:
        """A disaggregated ``plan`` is being dispatched: its prefill replica's link is busy until the predicted
        end of this handoff (now + the prefill's predicted time + the handoff term, which includes the wait for
        earlier handoffs: ``handoff_end_s``). With ``decode_tokens`` (the prompt, when this router sends the decode
        leg itself) the decode leg waits on the decode replica from then on, its KV due at that end
        (``decode_legs``), until ``decode_leg_started`` with the returned handle. None: nothing recorded for the
        decode side (an in-place plan, or no ``decode_tokens``)."""
        if plan.kind != "disaggregated" or plan.prefill is None:
            return None
        end = self.clock() + handoff_end_s(plan)
        if end > self._link_free_at.get(plan.prefill, 0.0):
            self._link_free_at[plan.prefill] = end
        if decode_tokens is None:
            return None
        handle = next(_LEG_HANDLES)
        self._decode_legs.setdefault(plan.decode, {})[handle] = (end, decode_tokens)
        return handle

    def decode_leg_started(self, index: int, handle: int | None) -> None:
        """Decode leg ``handle`` (``note_handoff``) on replica ``index`` sent its first byte, or its try ended
        without one: it no longer waits there."""
        legs = self._decode_legs.get(index)
        if legs is None or handle is None:
            return
        legs.pop(handle, None)
        if not legs:
            del self._decode_legs[index]

    def pd_state(self, index: int) -> dict[str, float | int]:
        """What this router's PD plans left on replica ``index`` (``GET /replicas``): seconds of handoffs still
        queued on its link, and the decode legs waiting on it for their first byte (count, prompt tokens)."""
        legs = self._decode_legs.get(index, {})
        return {
            "link_busy_s": round(self.link_busy_s(index), 3),
            "decode_legs": len(legs),
            "decode_leg_tokens": sum(tokens for _, tokens in legs.values()),
        }

    def decode_legs(self, index: int) -> tuple[DecodeLeg, ...]:
        """The decode legs waiting on replica ``index`` (``PdCandidate.decode_legs``): each one's seconds until its
        KV is predicted there (0 once that time has passed) and its tokens."""
        legs = self._decode_legs.get(index)
        if not legs:
            return ()
        now = self.clock()
        return tuple(DecodeLeg(max(0.0, eta - now), tokens) for eta, tokens in legs.values())

    def observe_handoff(self, handoff_bytes: float, transfer_s: float) -> bool:
        """A disaggregated request's observed handoff: ``handoff_bytes`` of KV moved in ``transfer_s`` seconds
        (measured handoff minus the plan's predicted ``decode_first``; see ``policies.pd_link``). Feeds the link
        estimator; the next decisions use its link. Returns whether the sample was accepted."""
        est = self.pd_link_estimator
        if est is None:
            return False
        accepted = est.observe(handoff_bytes, transfer_s)
        self.pd_link = est.link()
        return accepted

    def observe_engine_transfers(self, index: int, totals: TransferTotals) -> bool | None:
        """Replica ``index`` reported its cumulative KV transfers (its NIXL histograms, at a scrape): the
        transfers since its previous report feed the link estimator (``policies.pd_link.transfer_sample``).
        Returns whether that sample was accepted, or None when there was none (first report, nothing new,
        an engine restart)."""
        prev = self._transfer_totals.get(index)
        self._transfer_totals[index] = totals
        sample = transfer_sample(prev, totals)
        if sample is None:
            return None
        accepted = self.observe_handoff(*sample)
        self.link_from_engines = self.link_from_engines or accepted
        return accepted

    def pin_dp_rank(self, plan: Plan, inp: RoutingInput) -> None:
        """Pin a data-parallel rank on a disaggregated plan's decode replica when the policy left it open and
        the replica has several ranks (each rank owns its own KV cache): the prompt's first block key modulo the
        rank count, so a prefix keeps meeting the same rank and ``/route`` predicts what the request gets."""
        if plan.dp_rank is not None or plan.kind != "disaggregated":
            return
        rep = self.table.by_index(plan.decode)
        if rep is not None and rep.dp_size > 1:
            plan.dp_rank = (inp.keys[0] if inp.keys else 0) % rep.dp_size

    # -- LoRA adapters ---------------------------------------------------------------------------------
    def observe_adapters(self, rep: Replica, snap: EngineSnapshot) -> None:
        """A scrape of ``rep``: its ``vllm:lora_requests_info`` (adapters per batch, the adapters with requests)
        corrects the adapter model; its deferred gauge is kept for ``kvroute_replica_lora_deferred_requests``."""
        if snap.lora_deferred is not None:
            self.adapter_deferred[rep.index] = snap.lora_deferred
        if snap.lora_running is None:
            return
        self.adapters.scraped(
            rep.index, snap.lora_running, snap.lora_waiting or (), snap.lora_max, snap.lora_deferred
        )

    def forget_adapters(self, rep: Replica) -> None:
        """``rep`` left the fleet: forget its adapters."""
        self.adapters.forget(rep.index)
        self.adapter_deferred.pop(rep.index, None)

    # -- accounting ------------------------------------------------------------------------------------
    def acquire(self, rep: Replica, uncached_tokens: int, copies: int = 1, lora: str | None = None) -> None:
        """Count a request as in flight on ``rep`` BEFORE it is dispatched (uncached prefill tokens; ``copies``
        sequences, each counted as a request: the prompt is prefilled once; ``lora``: its adapter, which the
        adapter model makes the replica's most recently used)."""
        tokens = max(0, uncached_tokens)
        rep.load.inflight_requests += max(1, copies)
        rep.load.inflight_prefill_tokens += tokens
        self._pending[rep.index] = self._pending.get(rep.index, 0) + tokens
        self.table.touch(rep.index)
        if lora is not None:
            tier = self.adapters.cost(rep.index, lora, self.clock()).tier
            self.adapter_dispatches[tier] = self.adapter_dispatches.get(tier, 0) + 1
            self.adapters.dispatched(rep.index, lora, self.clock())

    def prefill_done(self, rep: Replica, uncached_tokens: int) -> None:
        """The request's prefill finished (first byte) or failed: stop counting its prefill tokens."""
        tokens = max(0, uncached_tokens)
        self._pending[rep.index] = max(0, self._pending.get(rep.index, 0) - tokens)
        self.table.touch(rep.index)
        if not self.prefill_release_on_first_byte:
            return
        rep.load.inflight_prefill_tokens = max(0, rep.load.inflight_prefill_tokens - tokens)

    def pending_prefill_tokens(self, index: int) -> int:
        """Uncached prompt tokens this router sent to replica ``index`` whose first byte has not come back yet
        (exact, whatever the scrapes say), tokens."""
        return self._pending.get(index, 0)

    def load_view(self, rep: Replica) -> LoadView:
        """The load view a policy sees for ``rep``.

        The queue is never smaller than this router's own exact count of prefill tokens still pending on the
        replica: scraped engine queues are estimates (and arrive late), and an under-estimate makes a cache
        holder look idle while requests pile up on it (the "death spiral" peers suffered).
        """
        load = rep.load
        pending = self._pending.get(rep.index, 0)
        if pending and pending > (load.queued_prefill_tokens or 0) + load.inflight_prefill_tokens:
            return replace(load, queued_prefill_tokens=pending, inflight_prefill_tokens=0)
        return load

    def release(
        self, rep: Replica, copies: int = 1, lora: str | None = None, service_s: float | None = None
    ) -> None:
        """The request (of ``copies`` sequences, as acquired) finished on ``rep`` (any outcome); ``lora``: its
        adapter, ``service_s``: how long it held its adapter's batch slot (first byte to end), seconds."""
        rep.load.inflight_requests = max(0, rep.load.inflight_requests - max(1, copies))
        self.table.touch(rep.index)
        if lora is not None:
            self.adapters.finished(rep.index, lora, service_s)

    def frontier_floor_blocks(self) -> int | None:
        """Leading prompt blocks the routing policies read whatever the replicas hold
        (``policies.base.prompt_blocks_read`` of the policy and of the PD policy once made): the cache-frontier
        walk's floor; None = every block (tokenize prompts whole)."""
        need = prompt_blocks_read(self.policy)
        if need is None or self._pd_policy is None:
            return need
        pd = prompt_blocks_read(self._pd_policy)
        return None if pd is None else max(need, pd)

    def deepest_held(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` that anything a decision matches prompts against may hold: the index (every
        replica, every tier, predictions included) and the fresh summaries of the other regions
        (``PeerViews.frontier_depth``), blocks. The cache-frontier walk tokenizes on while this reaches the last
        tokenized block."""
        held = self.index.deepest_match(keys)
        views = self.peer_views
        if views is not None and held < len(keys):
            held = max(held, views.frontier_depth(keys, self.block_size))
        return held

    def wants_prediction(self, rep: Replica) -> bool:
        """True when routing to ``rep`` should record predicted index entries."""
        if self.predict_mode == "always":
            return True
        if self.predict_mode == "never":
            return False
        return not self.events_healthy(rep)

    def record_prediction(self, rep: Replica, keys: Sequence[int]) -> None:
        """Record that ``rep`` will hold ``keys`` (predicted entries, expire after the TTL unless confirmed)."""
        if keys and self.wants_prediction(rep):
            self.index.predict(rep.index, keys)
            for listener in self.on_prediction:
                listener(rep, keys)

    def observe_pd(self, obs: Observation) -> None:
        """Feed a PD plan's prefill observation to the PD policy (never raises): a disaggregated request's
        prefill leg on its prefill replica, or an in-place plan's answer. No-op before a PD policy exists."""
        if self._pd_policy is None:
            return
        try:
            self._pd_policy.observe(obs)
        except Exception:
            log.exception("pd_policy.observe failed")

    def observe(self, obs: Observation) -> None:
        """Feed an observation to the policy (never raises). Through another region's router, the round trip to
        it is taken out of the TTFT first (``peer_rtt_s``)."""
        rep = self.table.by_index(obs.index) if self.peer_rtt_s else None
        if rep is not None and rep.is_peer:
            obs = replace(obs, ttft_s=max(0.0, obs.ttft_s - self.peer_rtt_s.get(rep.region, 0.0)))
        try:
            self.policy.observe(obs)
        except Exception:
            log.exception("policy.observe failed")
        for listener in self.on_observation:
            try:
                listener(obs)
            except Exception:
                log.exception("observation listener failed")


def serves_alone(rep: Replica) -> bool:
    """Does ``rep``'s engine answer a request without a KV handoff? Not an SGLang server in
    ``--disaggregation-mode decode``: it waits for the KV of the request's bootstrap room from a prefill server
    (a request without one is not served), so no plan or fallback serves in place there."""
    return not (rep.role == "decode" and rep.dialect == "sglang")


def plan_as_decision(plan: PlanDecision, candidates: Sequence[PdCandidate]) -> Decision:
    """The co-located view of a PD plan decision, for what walks a ``Decision`` (the proxy's retries, session
    affinity, metrics): chosen = the chosen plan's decode replica; ranking = every replica that can serve in place
    (``both`` / ``decode``) in the order of the plans it appears in; one score per candidate = its best plan's
    predicted TTFT as decode replica (inf when it is in none, e.g. a prefill-only replica)."""
    in_place_ok = {c.index for c in candidates if c.role in ("both", "decode")}
    ranking: list[int] = []
    best: dict[int, Plan] = {}
    for p in [plan.chosen, *plan.plans]:
        if p.decode in in_place_ok and p.decode not in ranking:
            ranking.append(p.decode)
        if p.decode not in best or p.predicted_ttft_s < best[p.decode].predicted_ttft_s:
            best[p.decode] = p
    ranking.extend(i for i in sorted(in_place_ok) if i not in ranking)
    scores = []
    for c in candidates:
        top = best.get(c.index)
        parts = dict(top.terms) if top else {}
        if top:
            parts["T"] = top.predicted_ttft_s
        scores.append(
            CandidateScore(
                index=c.index, name=c.name, score=top.predicted_ttft_s if top else float("inf"), parts=parts
            )
        )
    return Decision(
        chosen=plan.chosen.decode,
        ranking=ranking or [plan.chosen.decode],
        scores=scores,
        policy=plan.policy,
        branch=plan.branch,
    )


def plan_json(routed: Routed, table: ReplicaTable, *, show_urls: bool = True) -> dict[str, Any] | None:
    """The JSON form of a PD plan decision for ``POST /route`` (None on co-located fleets): the chosen plan
    (kind, prefill and decode replicas, pinned DP rank, predicted TTFT) and every candidate plan's predicted TTFT
    broken into its terms (seconds; ``Q_p``/``R_p``/``C_p``, ``handoff``, ``decode_first`` for disaggregated
    plans, ``Q``/``R``/``C`` in place)."""
    if routed.plan is None:
        return None

    def rep_json(index: int | None) -> dict[str, Any] | None:
        if index is None:
            return None
        rep = table.by_index(index)
        return {
            "name": rep.name if rep else str(index),
            "index": index,
            "role": rep.role if rep else None,
            "url": rep.url if rep and show_urls else None,
        }

    def one(p: Plan) -> dict[str, Any]:
        return {
            "kind": p.kind,
            "prefill": rep_json(p.prefill),
            "decode": rep_json(p.decode),
            "dp_rank": p.dp_rank,
            "predicted_ttft_s": _finite(p.predicted_ttft_s),
            "terms": {k: _finite(v) for k, v in p.terms.items()},
        }

    d = routed.plan
    return {
        "policy": d.policy,
        "branch": d.branch,
        "chosen": one(d.chosen),
        "plans": [one(p) for p in d.plans],
    }


def decision_json(
    routed: Routed, table: ReplicaTable, block_size: int, *, show_urls: bool = True
) -> dict[str, Any]:
    """The JSON form of a decision for ``POST /route``: chosen replica, ranking, every candidate's parts.

    ``show_urls``: include the replicas' URLs (internal addresses: the router shows them to admins only); else
    every ``url`` is None.
    """
    d = routed.decision
    chosen = table.by_index(d.chosen)
    by_index = candidates_by_index(routed.candidates, (s.index for s in d.scores))
    cands = []
    for s in d.scores:
        c = by_index.get(s.index)
        rep = table.by_index(s.index)
        hit = c.hit if c else PrefixHit()
        cands.append(
            {
                "name": s.name,
                "index": s.index,
                "url": rep.url if rep and show_urls else None,
                "score": _finite(s.score),
                # the expected TTFT (hit and miss paths weighted by p) when the policy models it, else its T / score
                "predicted_ttft_s": _finite(s.parts.get("E", s.parts.get("T", s.score))),
                "Q": _finite(s.parts.get("Q")),
                "R": _finite(s.parts.get("R")),
                "C": _finite(s.parts.get("C")),
                "p": _finite(s.parts.get("p")),
                "parts": {k: _finite(v) for k, v in s.parts.items()},
                "matched_tokens": {
                    "gpu": hit.gpu,
                    "cpu": hit.cpu,
                    "disk": hit.disk,
                    "remote": hit.remote,
                    "predicted": hit.predicted,
                    "total": hit.total,
                },
                "cached_tokens": routed.cached_tokens.get(s.index, 0),
                "load": _load_json(c.load) if c else None,
            }
        )
    return {
        "chosen": {
            "name": chosen.name if chosen else None,
            "index": d.chosen,
            "url": chosen.url if chosen and show_urls else None,
        },
        "policy": d.policy,
        "branch": d.branch,
        "ranking": [_name(table, i) for i in d.ranking],
        "model": routed.inp.model,
        "lora": routed.inp.lora,
        "prompt_tokens": routed.inp.prompt_tokens,
        "blocks": len(routed.inp.keys),
        "prompt_tokens_estimated": routed.inp.ids_partial,
        "tokenized_tokens": len(routed.inp.token_ids),
        "block_size": block_size,
        "decision_s": routed.decision_s,
        "candidates": cands,
        "plan": plan_json(routed, table, show_urls=show_urls),
    }


def _name(table: ReplicaTable, index: int) -> str:
    rep = table.by_index(index)
    return rep.name if rep else str(index)


def _finite(v: float | None) -> float | None:
    if v is None:
        return None
    v = float(v)
    return v if v == v and v not in (float("inf"), float("-inf")) else None


def _load_json(load: Any) -> dict[str, Any]:
    return {f.name: getattr(load, f.name) for f in fields(load)}
