"""Types shared by every routing policy, and the registry of policies by name.

Everything here is pure: no I/O, no clock reads (time arrives in ``RouteRequest.now``), and randomness only
through seeded generators owned by a policy. The router service and the simulator build the same
``RouteRequest`` / ``Candidate`` objects and call the same ``Policy.choose``.

Units: tokens are counts of prompt tokens, times are seconds, sizes are bytes, rates are per second.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from policies.adapters import AdapterCost, AdapterSlots

Objective = Literal["mean", "tail"]

#: Tier names, fastest first. ``gpu`` is the engine's HBM prefix cache (L1), ``cpu`` host memory (L2),
#: ``disk`` local SSD (L3), ``remote`` a shared store reached over the network (L4).
TIER_NAMES: tuple[str, ...] = ("gpu", "cpu", "disk", "remote")


@dataclass(slots=True)
class RouteRequest:
    """One request to place.

    Attributes:
        model: model id requested by the client.
        prompt_tokens: prompt length in tokens.
        block_keys: chained 64-bit block keys of the prompt's full blocks (``index.hashing``).
        block_size: tokens per block used for ``block_keys``.
        now: the caller's clock in seconds (policies never read a clock themselves).
        lora: LoRA adapter name, or None for the base model.
        session_id: client session id (``X-Session-Id``) when given.
        objective: ``mean`` (minimise expected TTFT) or ``tail`` (penalise uncertain hits, p99-aware).
        expected_output_tokens: expected decode length in tokens (0 when unknown).
        request_id: opaque id for logs.
        ttft_target_s: the request's TTFT target, seconds (None: no target; ``ttft`` then decides as always).
        priority: the request's priority (higher is more urgent; ``ttft`` gives urgent work the fastest replica
            meeting the target and packs the rest onto the replica with the least slack).
        sequences: sequences the engine generates for it (OpenAI ``n`` / vLLM ``best_of``, at least 1); PD plans
            serve parallel sampling in place (``policies.pd_common.plan_request``).
        client_region: the region the client is in (an edge header verified by the router, else the router's own
            region); None when regions are not configured. Read by ``policies.regions``.
        allowed_regions: data residency, the regions allowed to process this request; None = any region, an
            empty set = none (refused). ``policies.regions`` never picks a replica outside it.
    """

    model: str
    prompt_tokens: int
    block_keys: Sequence[int]
    block_size: int = 16
    now: float = 0.0
    lora: str | None = None
    session_id: str | None = None
    objective: Objective = "mean"
    expected_output_tokens: int = 0
    request_id: str = ""
    ttft_target_s: float | None = None
    priority: int = 0
    sequences: int = 1
    client_region: str | None = None
    allowed_regions: frozenset[str] | None = None


@dataclass(slots=True)
class LoadView:
    """What the router knows about a replica's load, and how fresh it is.

    ``None`` means unknown (a gauge the engine does not export, or no scrape yet), never zero.

    Attributes:
        queued_requests: requests waiting in the engine's queue (scraped).
        running_requests: requests in the engine's running batch (scraped).
        queued_prefill_tokens: uncached prompt tokens waiting to be prefilled (scraped or estimated), tokens.
        inflight_requests: requests this router dispatched to the replica and that have not completed.
        inflight_prefill_tokens: uncached prompt tokens this router dispatched since the last scrape, tokens.
        kv_usage: fraction of the replica's KV cache in use, 0..1.
        age_s: seconds since the scraped values were taken (None when never scraped).
        active_kv_blocks: KV blocks held by the replica's running requests (router-tracked or reported), blocks;
            None when unknown (``dynamo_kv`` then uses ``kv_usage * total_kv_blocks``).
        total_kv_blocks: the replica's KV-cache capacity (``cache_config_info``), blocks; None when unknown.
        engine_block_size: the replica's own KV block size (``cache_config_info``), tokens; None when unknown.
            The engine caches and reuses whole blocks of this size only, so matches are rounded down to it
            (``policies.hits.hit_from_match``) when it differs from the router's ``block_size``.
        inflight_prefill_elapsed_s: seconds the replica has been working through ``inflight_prefill_tokens``:
            since the later of the oldest of those dispatches and the last prefill completion (first token or
            prefill-leg response) this router saw from the replica; 0 when unknown. Lets a policy age the
            in-flight backlog (``pd_ttft``: minus rate x elapsed) so that, among replicas with equal backlogs,
            the one that started first is seen to finish first.
        adapters: the replica's LoRA adapters (GPU slots, running / waiting / resident adapters, the deferred
            gauge: ``policies.adapters.AdapterSlots``); None when the replica serves no adapters or nothing is
            known.
    """

    queued_requests: int | None = None
    running_requests: int | None = None
    queued_prefill_tokens: int | None = None
    inflight_requests: int = 0
    inflight_prefill_tokens: int = 0
    kv_usage: float | None = None
    age_s: float | None = None
    active_kv_blocks: int | None = None
    total_kv_blocks: int | None = None
    engine_block_size: int | None = None
    inflight_prefill_elapsed_s: float = 0.0
    adapters: AdapterSlots | None = None


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Leading prompt tokens a replica holds, split by tier (from ``PrefixIndex.match``).

    Each matched block is counted once, in the fastest tier that holds it. Immutable: the candidates of the
    replicas that hold nothing of a prompt (most of a large fleet's) share one empty hit (``policies.hits.NO_HIT``).

    Attributes:
        gpu, cpu, disk, remote: matched leading tokens per tier, tokens.
        predicted: of the matched tokens, how many are known only from this router's own routing decisions
            (no engine event confirmed them), tokens.
        age_s: seconds since the deepest matched block was last stored or confirmed.
    """

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    remote: int = 0
    predicted: int = 0
    age_s: float = 0.0

    @property
    def total(self) -> int:
        """All matched leading tokens, any tier."""
        return self.gpu + self.cpu + self.disk + self.remote


#: the hit of a replica that holds none of the prompt, shared by every such candidate (``PrefixHit`` is immutable)
NO_HIT = PrefixHit()


@dataclass(slots=True)
class TierLink:
    """How fast a replica can fetch reused KV from one non-GPU tier.

    Attributes:
        bandwidth_bytes_per_s: sustained fetch bandwidth, bytes per second.
        lookup_latency_s: fixed cost of a fetch (lookup, setup), seconds.
    """

    bandwidth_bytes_per_s: float
    lookup_latency_s: float = 0.0


@dataclass(slots=True)
class ReplicaProfile:
    """Performance profile of a replica (from config, refined online by calibration).

    Attributes:
        prefill_tokens_per_s: linear prefill throughput, tokens per second.
        fixed_overhead_s: fixed per-request cost before the first token (scheduling, sampling), seconds.
        attention_s_per_token2: quadratic attention cost, seconds per (new token x context token); 0 ignores it.
        bytes_per_token: KV-cache bytes per token (all layers), bytes.
        tiers: fetch links for non-GPU tiers by tier name (``cpu``, ``disk``, ``remote``).
        fetch_overlaps_queue: True when the engine fetches reused state while the request waits in its queue
            (then ``T = max(Q, R) + C``), else ``T = Q + R + C``.
        decode_interference_s: extra queueing per running request (decode steps interleaved with prefill),
            seconds.
        max_context_tokens: longest prompt the replica accepts, tokens (0 = unknown).
        decode_step_s: one decode round (every running request gets one token) at a batch of one, seconds;
            the first-token step of a request handed to a decode replica (PD plans). 0 = unknown (free).
        decode_step_s_per_request: extra seconds per decode round for each request in the running batch
            (TV-16: 26.26 ms at batch 1, 29.63 ms at batch 64 -> ~0.05 ms per request), seconds.
    """

    prefill_tokens_per_s: float = 10_000.0
    fixed_overhead_s: float = 0.0
    attention_s_per_token2: float = 0.0
    bytes_per_token: float = 147_456.0
    tiers: dict[str, TierLink] = field(default_factory=dict)
    fetch_overlaps_queue: bool = True
    decode_interference_s: float = 0.0
    max_context_tokens: int = 0
    decode_step_s: float = 0.0
    decode_step_s_per_request: float = 0.0


@dataclass(slots=True)
class Candidate:
    """One replica that could serve the request.

    Attributes:
        index: the replica's stable small integer index (the bit in index bitmaps).
        name: the replica's name (pod name or configured name).
        state: membership state (``ready``, ``draining``, ...); policies only see routable replicas.
        load: the replica's load view.
        hit: the prompt prefix the replica holds, per tier.
        profile: the replica's performance profile.
        region: the region the replica runs in (``topology.kubernetes.io/region`` or static config); "" when
            unknown. Read by ``policies.regions`` (residency, the failover ladder).
        rtt_s: network round trip between the client's region and this replica's, seconds (0 in one region).
            ``ttft`` adds it to the candidate's predicted TTFT (``E`` and the tail, so its score); it is set by
            ``policies.regions`` from the latency matrix. The replica's cache is its own region's: no cross-region
            KV fetch is ever assumed.
        adapter: the request's LoRA adapter on this replica, priced in seconds (``policies.adapters``: GPU-resident,
            CPU-resident, loadable, or waiting for a batch slot); None for a base-model request.
    """

    index: int
    name: str
    load: LoadView = field(default_factory=LoadView)
    hit: PrefixHit = field(default_factory=PrefixHit)
    profile: ReplicaProfile = field(default_factory=ReplicaProfile)
    state: str = "ready"
    region: str = ""
    rtt_s: float = 0.0
    adapter: AdapterCost | None = None


@dataclass(slots=True)
class CandidateScore:
    """A candidate's score in one decision (lower is better unless the policy says otherwise).

    Attributes:
        index: replica index.
        name: replica name.
        score: the policy's score for this candidate (``ttft``: expected TTFT in seconds).
        parts: named components, e.g. ``Q``, ``R``, ``C``, ``p``, ``T`` (seconds / probability) and matched
            tokens per tier, so the decision can be explained.
    """

    index: int
    name: str
    score: float
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reuse:
    """Prompt-cache reuse of one decision: what was available vs what the choice achieved, tokens.

    ``available_tokens`` is the most cached prompt tokens any eligible candidate held; ``achieved_tokens`` what
    the chosen one held. ``prompt - available`` is a workload miss (no replica could reuse more); ``available -
    achieved`` (``missed_tokens``) a router miss, or a trade of reuse for a shorter queue.
    """

    available_tokens: int
    achieved_tokens: int

    @property
    def missed_tokens(self) -> int:
        """Cached tokens a better-placed candidate held that the chosen one did not, tokens."""
        return self.available_tokens - self.achieved_tokens


def reuse_of(chosen: int, candidates: Sequence[Candidate]) -> Reuse:
    """The ``Reuse`` of choosing replica ``chosen`` among ``candidates`` (matched prompt tokens, every tier)."""
    available = 0
    achieved = 0
    no_hit = NO_HIT
    for c in candidates:  # every decision, every candidate: attributes, no property or ``max`` call
        hit = c.hit
        if hit is no_hit:  # most of a large fleet's candidates: nothing to count
            continue
        total = hit.gpu + hit.cpu + hit.disk + hit.remote
        if total > available:
            available = total
        if c.index == chosen:
            achieved = total
    return Reuse(available_tokens=available, achieved_tokens=achieved)


@dataclass(slots=True)
class Decision:
    """The outcome of ``Policy.choose``.

    Attributes:
        chosen: index of the chosen replica.
        ranking: replica indices, best first (the chosen one first); retries walk it in order.
        scores: one entry per candidate, in the order the candidates were given; a policy that prunes (``ttft``)
            gives entries for the candidates it scored in full only (the chosen one and the head of the ranking
            among them), still in candidate order.
        policy: name of the policy that decided.
        branch: which branch of the policy decided (e.g. ``cache_hit``, ``shortest_queue``), for metrics.
        reuse: available vs achieved cached tokens (``reuse_of``), set by whoever holds the candidates after
            ``choose`` (the router's ``Router.decide``); None until then.
    """

    chosen: int
    ranking: list[int]
    scores: list[CandidateScore]
    policy: str
    branch: str = "default"
    reuse: Reuse | None = None


@dataclass(slots=True)
class Observation:
    """Feedback after a request finished its prefill, for calibration and stateful policies.

    Attributes:
        index: replica index that served the request.
        prompt_tokens: prompt length, tokens.
        cached_tokens: tokens the engine reported as reused from cache (or the router's estimate), tokens.
        queue_wait_s: time the request waited before its prefill started, seconds (estimate when unknown).
        ttft_s: observed time to first token, seconds.
        now: the caller's clock, seconds.
    """

    index: int
    prompt_tokens: int
    cached_tokens: int
    queue_wait_s: float
    ttft_s: float
    now: float = 0.0


@runtime_checkable
class Policy(Protocol):
    """A routing policy: picks one candidate for a request."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Return the decision for ``request`` among ``candidates`` (non-empty, all routable)."""
        ...

    def observe(self, observation: Observation) -> None:
        """Take feedback about a finished prefill (calibration); may do nothing."""
        ...


def prompt_blocks_read(policy: object) -> int | None:
    """Leading blocks of a prompt's ``block_keys`` that ``policy`` reads whatever the replicas hold: its optional
    ``reads_prompt_blocks`` attribute, the largest along its ``inner`` wrappers' chain (``policies.regions``).
    0 (the default: every cost-model, load and index-scoring policy) = only blocks some replica matches; N = the
    first N blocks (``consistent_hash`` keys on them); None = every block (``sglang_cache_aware`` stores routed
    prompts in its own tree). The router's cache-frontier tokenization (``router.tokens.frontier``) tokenizes a
    long prompt at least that deep, and whole for None."""
    need = 0
    for _ in range(8):  # wrappers nest a level or two; the bound only guards against a cycle
        got = getattr(policy, "reads_prompt_blocks", 0)
        if got is None:
            return None
        need = max(need, int(got))
        policy = getattr(policy, "inner", None)
        if policy is None:
            break
    return need


PolicyFactory = Callable[..., Policy]

#: policy name -> factory. Full whenever this module is usable: importing ``policies.base`` imports the package
#: first, and ``policies/__init__.py`` imports every built-in policy module, each registering itself.
_REGISTRY: dict[str, PolicyFactory] = {}


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class decorator: register a policy factory under ``name``."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def policy_names() -> list[str]:
    """Names of every registered policy, sorted."""
    return sorted(_REGISTRY)


def policy_factory(name: str) -> PolicyFactory:
    """The factory (class) registered as ``name`` (to read its parameters).

    Raises:
        KeyError: when ``name`` is unknown.
    """
    return _REGISTRY[name]


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the type ``hint`` names: int, float (an int too), bool, str, ``X | None``, a
    ``Literal``; any other hint accepts every value (the constructor checks those)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _constructor(factory: Callable[..., Any]) -> Callable[..., Any]:
    """The function whose annotations type a factory's parameters: a class's ``__init__``, else the factory."""
    if isinstance(factory, type):
        return next(c.__dict__["__init__"] for c in factory.__mro__ if "__init__" in c.__dict__)  # type: ignore[no-any-return]
    return factory


def factory_param_names(factory: Callable[..., Any]) -> list[str]:
    """The keyword parameters a policy factory names (without a ``**kwargs`` catch-all), in order."""
    sig = inspect.signature(factory)
    return [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_factory_params(name: str, factory: Callable[..., Any], params: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first of ``params`` that the policy factory ``name`` does not accept, or
    whose value does not have the type of its annotation, with the parameters the policy accepts."""
    known = factory_param_names(factory)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(factory).parameters.values())
    names = ", ".join(known) or "no parameters"
    try:
        hints = typing.get_type_hints(_constructor(factory))
    except Exception:  # an annotation that does not resolve: leave the types to the constructor
        hints = {}
    for key, value in params.items():
        if key not in known and not takes_any:
            raise ValueError(f"policy {name!r} has no parameter {key!r}; it accepts: {names}")
        if key in hints and not _fits(value, hints[key]):
            hint = hints[key].__name__ if isinstance(hints[key], type) else str(hints[key])
            raise ValueError(
                f"policy {name!r} parameter {key!r} wants {hint.replace('typing.', '')}, got {value!r}; "
                f"it accepts: {names}"
            )


def make_policy(name: str, **params: Any) -> Policy:
    """Build the policy registered as ``name`` with keyword ``params``.

    Raises:
        KeyError: with the list of known names when ``name`` is unknown.
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(**params)
