"""The composition root: builds every component of the router from ``Settings`` and hands them back typed.

``build_services(settings)`` runs one named step per part, in dependency order, and returns ``Services``::

    telemetry, table (index allocator), index, policy, tokenizer
    -> membership (static replicas + Kubernetes discovery + health + Redis shared state)
    -> kv_events (subscriber feeding the index), engine_metrics (load views)
    -> router (decisions; asks kv_events whether a replica's events are healthy)
    -> token_ids, gate, edge (the engine hop; reports connection failures to membership)
    -> dispatcher (in place: the attempts behind the gate; disaggregated: the PD legs)
    -> admission, idempotency, loop-lag probe, guard, intake, tenants (the request front)
    -> tracing (only with ``otlp_traces_endpoint``), pipeline (the steps every front door calls), and with
       ``epp`` the endpoint picker's server
    -> index hygiene hooks and scrape-time gauges

Every step receives its concern's frozen sub-config (``settings.routing``, ``settings.pd``, ... from
``router.config``), or a component config the root assembles from several (``Settings.proxy``,
``_pipeline_config``, ``_epp_config``); no component receives the whole ``Settings``
(tests/unit/test_config_handout.py).

Nothing is started here: ``run(services)`` (the app's lifespan) starts the background parts and stops them in
reverse order. Every later reader (the HTTP door in ``router.http.app``, tests) reads typed fields; there is no
string-keyed bag and no object is looked up late.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from index.prefix_index import PrefixIndex
from index.summary import PrefixSummary, SummaryParams
from index.types import BlockKey
from membership import engine_tls
from membership.config import MembershipConfig
from membership.engine_metrics import EngineSnapshot, MetricsScraper
from membership.kv_events import KVEventSubscriber
from membership.replicas import Replica, ReplicaState, ReplicaTable
from membership.runtime import Membership, make_allocator
from membership.shared_state import ResponseMap
from membership.tenant_budget import TenantBudget
from membership.ticks import sleep_to_next_due
from policies.adapters import AdapterResidency
from policies.base import Candidate, Policy, ReplicaProfile, make_policy
from policies.candidates import build_candidates
from policies.pd_base import HandoffLink, make_pd_policy
from policies.pd_link import LinkEstimator
from policies.peer_summary import PublishedSummary, publish_summary, with_round_trip
from policies.regions import LadderParams, RegionLadderPolicy, RegionLoad, region_load
from router import signals
from router.config import (
    ClientEdgeSettings,
    EngineEdgeSettings,
    KvEventSettings,
    MembershipSettings,
    PdSettings,
    RegionSettings,
    RoutingSettings,
    Settings,
    SharedStateSettings,
    TenancySettings,
    TokenizerSettings,
    TracingSettings,
)
from router.core.admission import Admission
from router.core.dispatch import DispatchGate
from router.core.regions import PeerViews, latency_matrix, peer_specs
from router.core.routing import Router, build_profile, tier_links_of
from router.core.tenant_admission import TenantAdmission
from router.core.tenant_metrics import TenantMetrics
from router.core.tenants import TenancyConfig
from router.engine.attempt import EngineEdge
from router.engine.config import ProxyConfig
from router.engine.feedback import Feedback
from router.engine.gaps import EndpointGaps
from router.engine.peer_feed import PeerFeed, SummaryPublisher
from router.engine.proxy import Proxy
from router.engine.scrape import PooledScrapeClient
from router.epp.picker import EppConfig, EppServer
from router.pd.leg import PdConfig
from router.pd.legs import PdLegs
from router.serve.client_fields import ClientFields
from router.serve.dispatch import Dispatcher
from router.serve.guard import Auth, Guard, Shedder
from router.serve.idempotency import IdempotencyGuard
from router.serve.intake import InputLimits, Intake, model_contexts
from router.serve.loop_lag import LoopLag
from router.serve.pipeline import Pipeline, PipelineConfig
from router.serve.responses import ResponseChains
from router.telemetry import (
    Telemetry,
    adapter_gauges,
    admission_gauges,
    budget_gauges,
    dispatch_gauges,
    epp_gauges,
    image_render_gauges,
    index_gauges,
    kubernetes_metrics,
    lag_gauges,
    replica_gauges,
    router_gauges,
    shedder_gauges,
    tokenizer_cache_gauges,
)
from router.tokens.images import ImageRenderer
from router.tokens.token_ids import TokenIdsCheck
from router.tokens.tokenizer import HfTokenizer, Tokenizer, make_tokenizer
from router.tracing import Tracing, TracingConfig, build_tracing

log = logging.getLogger("kvroute.services")

#: A background component started with the app: ``start()`` / ``stop()`` coroutines.
StartStop = tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]


@dataclass
class Services:
    """Every component the routes use, built from Settings by ``build_services``."""

    settings: Settings
    telemetry: Telemetry
    table: ReplicaTable
    index: PrefixIndex
    policy: Policy
    tokenizer: Tokenizer
    membership: Membership
    kv_events: KVEventSubscriber | None
    engine_metrics: MetricsScraper
    router: Router
    token_ids: TokenIdsCheck
    #: the engine edge: the pool, open / payload / commit of one attempt, usage and TTFT feedback
    edge: EngineEdge
    gate: DispatchGate
    #: dispatch chosen from the plan: in place (the attempts) or through the PD legs
    dispatcher: Dispatcher
    admission: Admission
    idempotency: IdempotencyGuard
    loop_lag: LoopLag
    guard: Guard
    intake: Intake
    #: identity, tenant quotas, the fair queue and SLO rejection (wraps ``admission``)
    tenants: TenantAdmission
    #: the serving pipeline every front door calls (router/serve/pipeline.py)
    pipeline: Pipeline
    #: the endpoint picker (gRPC ext_proc front door, ``kvroute epp``); None: not served
    epp: EppServer | None = None
    #: what ``GET /region/summary`` serves (built on first use: ``region_summary``)
    summary: SummaryPublisher | None = None
    #: started in this order by ``run`` and stopped in reverse
    background: list[StartStop] = field(default_factory=list)

    @property
    def inflight(self) -> int:
        """Requests in flight through the router (admitted, not finished)."""
        return self.admission.inflight


# ---------------------------------------------------------------------------------------------------------
# the steps
# ---------------------------------------------------------------------------------------------------------


def _configure_engine_tls(engine: EngineEdgeSettings) -> None:
    """TLS to https:// engines (proxy, probes, scrapes, /tokenize): one verified context from the engine edge."""
    engine_tls.configure(
        engine_tls.EngineTLS(engine.engine_ca_bundle, engine.engine_client_cert, engine.engine_client_key)
    )


def _build_index(kv: KvEventSettings, block_size: int) -> PrefixIndex:
    return PrefixIndex(
        block_size=block_size,
        max_nodes=kv.index_max_nodes,
        max_bytes=kv.index_max_bytes,
        predicted_ttl_s=kv.predicted_ttl_s,
    )


def _build_tokenizer(tok: TokenizerSettings, headers: dict[str, str]) -> Tokenizer:
    return make_tokenizer(
        tok.tokenizer_mode,
        tok.tokenizer_path,
        tok.chat_template_path,
        tok.tokenize_timeout_s,
        headers,
        cache_bytes=int(tok.tokenizer_cache_mb * (1 << 20)),
        cache_verify_every=tok.tokenizer_cache_verify_every,
        parallel=tok.tokenizer_parallel,
    )


def _profile_factory(routing: RoutingSettings) -> Callable[[str | None], ReplicaProfile]:
    links = tier_links_of(routing.kv_tier_bandwidth_gbps, routing.kv_tier_latency_s)

    def profile_for(name: str | None) -> ReplicaProfile:
        return build_profile(name, routing.profiles, routing.default_profile, links)

    return profile_for


def _build_policy(routing: RoutingSettings, regions: RegionSettings) -> Policy:
    """The configured policy; with a region set, inside the failover ladder (``policies.regions``, the same code
    the simulator runs: distance priced in seconds, residency as a hard filter, bounded failover)."""
    policy = make_policy(routing.policy, **routing.policy_params)
    if not regions.region:
        return policy
    matrix = latency_matrix(regions.region_rtt_ms, regions.region_intra_rtt_ms, regions.region)
    params = LadderParams(
        margin_s=regions.region_margin_s,
        max_regions=regions.region_max_regions,
        max_extra_rtt_s=regions.region_max_extra_rtt_s,
        attempts_per_region=regions.region_attempts_per_region,
        retry_after_s=float(regions.region_retry_after_s),
    )
    return RegionLadderPolicy(policy, matrix, regions.region, params)


def _peer_round_trips(regions: RegionSettings, ladder: RegionLadderPolicy) -> dict[str, float]:
    """Round trip to each peer region's router, seconds.

    Raises:
        ValueError: a peer region without a round trip to this router's region in ``region_rtt_ms`` (it could
            never be on a ladder).
    """
    out: dict[str, float] = {}
    for region in regions.region_peers:
        rtt = ladder.matrix.rtt_s(regions.region, region)
        if rtt is None:
            raise ValueError(
                f"region_peers: {region!r} has no round trip to {regions.region!r} in region_rtt_ms"
            )
        out[region] = rtt
    return out


def _build_membership(
    config: MembershipConfig,
    members: MembershipSettings,
    regions: RegionSettings,
    routing: RoutingSettings,
    table: ReplicaTable,
    index: PrefixIndex,
    headers: dict[str, str],
) -> Membership:
    """Membership (``config`` spans concerns: ``Settings.membership_config``): static replicas and peer regions'
    routers as specs, priced with routing's profiles."""
    membership = Membership(
        config,
        table,
        index,
        specs=members.static_replicas() + peer_specs(regions.region_peers, regions.region_peer_health_path),
        profile_for=_profile_factory(routing),
        headers=headers,
    )
    membership.load()  # static replicas, joining until their first probe
    return membership


def _build_images(tokenizer: TokenizerSettings, headers: dict[str, str]) -> ImageRenderer:
    """Image chats rendered by engines, answers cached (router/tokens/images.py)."""
    return ImageRenderer(
        tokenizer.tokenize_timeout_s,
        tokenizer.image_render_cache_entries,
        tokenizer.image_render_cache_ttl_s,
        headers,
    )


def _build_intake(client: ClientEdgeSettings, table: ReplicaTable, telemetry: Telemetry) -> Intake:
    """The request front door: input limits, and router-controlled fields stripped (router/serve/client_fields.py)."""
    return Intake(
        InputLimits.from_settings(client),
        lambda: model_contexts(table.all()),
        ClientFields(telemetry.registry),
    )


def _probe_over_pool(membership: Membership, client: PooledScrapeClient) -> None:
    """Health probes through the proxy's engine pool (``router/engine/scrape.py``), not httpx (cheaper on
    the event loop; the pool sends the same engine API key and TLS context the probes would)."""
    for checker in (membership.static.health, membership.discovered_health):
        if checker is not None:
            checker.use_client(client)


def _build_router(
    routing: RoutingSettings,
    predict_mode: str,
    regions: RegionSettings,
    pd: PdSettings,
    table: ReplicaTable,
    index: PrefixIndex,
    policy: Policy,
    kv_events: KVEventSubscriber | None,
    membership: Membership,
) -> Router:
    """Decisions: routing's knobs, the KV events' ``predict_mode``, the PD plan and link, this router's region."""
    router = Router(
        table,
        index,
        policy,
        block_size=routing.block_size,
        seed_model=routing.seed_model,
        seed_include_lora=routing.seed_include_lora,
        objective=routing.objective,
        predict_mode=predict_mode,
        events_healthy=lambda rep: signals.events_healthy(kv_events, rep),
        max_inflight_per_replica=routing.max_inflight_per_replica,
        panic_routing=routing.panic_routing,
        columns_min_candidates=routing.columns_min_candidates,
        check_columns=routing.check_fleet_columns,
    )
    router.on_prediction.append(membership.publish_prediction)  # predicted entries reach peer routers
    router.adapters = AdapterResidency(routing.adapter_links())
    _configure_pd(pd, router)
    router.home_region = regions.region
    if isinstance(policy, RegionLadderPolicy):
        router.peer_rtt_s = _peer_round_trips(regions, policy)
    return router


def _configure_pd(pd: PdSettings, router: Router) -> None:
    """Prefill/decode disaggregation: the PD plan policy (built on the first PD decision, so a
    co-located fleet never needs one) and the fleet's P->D link."""
    router.pd_policy_factory = lambda: make_pd_policy(pd.pd_policy, **pd.pd_policy_params)
    router.pd_link = HandoffLink(
        bandwidth_bytes_per_s=pd.pd_link_bandwidth_gbps * 1e9, latency_s=pd.pd_link_latency_s
    )
    router.pd_link_estimator = LinkEstimator(router.pd_link, pd.pd_link_learning())


def _observe_snapshot(router: Router, dispatcher: Dispatcher, rep: Replica, snap: EngineSnapshot) -> None:
    """A scrape's LoRA adapter signals to the router's adapter model (``Router.observe_adapters``); its KV-transfer
    totals to the PD legs' link learning (``PdLegs.observe_engine_transfers``), and its engine start time to their
    restart detection (``PdLegs.observe_engine_start``)."""
    router.observe_adapters(rep, snap)
    if dispatcher.pd is not None:
        dispatcher.pd.observe_engine_start(rep, snap)
        dispatcher.pd.observe_engine_transfers(rep, snap)


def _build_edge(
    proxy: ProxyConfig, router: Router, telemetry: Telemetry, token_ids: TokenIdsCheck, membership: Membership
) -> EngineEdge:
    """The engine edge (pool, open / payload / commit), reporting connection failures to membership."""

    def on_connection_failure(rep: Replica, err: str) -> None:  # passive health
        membership.record_failure(rep.name, err)

    return EngineEdge(
        telemetry,
        proxy,
        Feedback(router, telemetry),
        token_ids=token_ids,
        on_connection_failure=on_connection_failure,
    )


def _build_dispatcher(
    config: ProxyConfig,
    engine: EngineEdgeSettings,
    pd_settings: PdSettings,
    router: Router,
    edge: EngineEdge,
    telemetry: Telemetry,
    gate: DispatchGate,
) -> Dispatcher:
    """Dispatch chosen from the plan: the in-place attempts (behind the cache-first gate) and the PD legs."""
    proxy = Proxy(router, edge, telemetry, config, EndpointGaps(engine.endpoint_gap_ttl_s))
    proxy.gate = gate
    pd = PdLegs(
        router,
        edge,
        proxy,
        telemetry,
        PdConfig(
            protocol=pd_settings.pd_protocol,
            default_bootstrap_port=pd_settings.pd_default_bootstrap_port,
            max_prefill_answer_bytes=pd_settings.pd_max_prefill_answer_bytes,
            max_transfer_params_bytes=pd_settings.pd_max_transfer_params_bytes,
            mooncake_query_timeout_s=pd_settings.pd_mooncake_query_timeout_s,
            mooncake_ids_ttl_s=pd_settings.pd_mooncake_ids_ttl_s,
        ),
    )
    return Dispatcher(proxy, pd, telemetry, engine.migration_limit, engine.migrate_non_streamed)


def _build_token_ids(
    tok: TokenizerSettings,
    probe_interval_s: float,
    headers: dict[str, str],
    tokenizer: Tokenizer,
    table: ReplicaTable,
) -> TokenIdsCheck:
    """Which replicas take prompts as the router's token ids (router/tokens/token_ids.py), checked when they join
    and every probe interval (membership's ``probe_interval_s``)."""
    return TokenIdsCheck(
        tokenizer,
        table,
        enabled=tok.forward_token_ids,
        timeout_s=tok.tokenize_timeout_s,
        interval_s=probe_interval_s,
        headers=headers,
    )


def _build_gate(routing: RoutingSettings, table: ReplicaTable, index: PrefixIndex) -> DispatchGate:
    def routable(i: int) -> bool:
        rep = table.by_index(i)
        return rep is not None and rep.routable

    return DispatchGate(routing.dispatch(), index, routing.block_size, routable=routable)


def _build_guard(
    client: ClientEdgeSettings,
    tenancy: TenancySettings,
    loop_lag: LoopLag,
    admission: Admission,
) -> Guard:
    """The front gate (``router.serve.guard``): auth and loop-lag shedding from the headers, before any body."""
    keys = [k.get_secret_value() for k in client.api_keys]
    if keys:  # keys that name a tenant, or may name any tenant, are client keys too
        keys += [e.get_secret_value().partition("=")[2].strip() for e in tenancy.tenant_api_keys]
        keys += [k.get_secret_value() for k in tenancy.tenant_header_keys]
    auth = Auth(keys, client.admin_token.get_secret_value() if client.admin_token else None)
    guard = Guard(auth, None)
    guard.shedder = _build_shedder(client, loop_lag, admission, guard)
    return guard


def _build_shedder(
    client: ClientEdgeSettings, loop_lag: LoopLag, admission: Admission, guard: Guard
) -> Shedder:
    """The overload decision: the router's request work is its HTTP data-plane requests in progress, the
    requests holding or queued for an in-flight slot (either door) and those waiting at the gate (an HTTP request
    holding a slot counts twice: only whether the sum shrinks matters)."""

    def work() -> int:
        return guard.in_progress + admission.inflight + admission.waiting + shedder.waiting

    shedder = Shedder(
        loop_lag,
        client.max_event_loop_lag_s,
        client.event_loop_lag_sustain_s,
        client.event_loop_lag_max_wait_s,
        work,
    )
    loop_lag.work = work  # idle (no request work): the probe may wait for its idle period
    return shedder


def _build_tenants(
    tenancy: TenancySettings,
    client: ClientEdgeSettings,
    membership: Membership,
    admission: Admission,
    telemetry: Telemetry,
    router: Router,
) -> TenantAdmission:
    """Identity and admission: quotas in Redis when configured (else in memory), the fair queue of
    ``admission``, per-tenant metrics fed by the router's observations."""
    budget = TenantBudget(membership.shared, tenancy.tenant_expected_routers)
    config = TenancyConfig.from_settings(
        tenancy, client_keys_required=bool(client.api_keys), inflight_limit=client.max_inflight_total
    )
    tenants = TenantAdmission(
        config,
        budget,
        admission,
        TenantMetrics(telemetry.registry, tenancy.tenant_metrics_max_labels, tenancy.tenant_metrics_idle_s),
    )
    telemetry.add_text(tenants.metrics.render_chunks)
    router.on_observation.append(tenants.observe)
    return tenants


def _keep_index_honest(
    table: ReplicaTable, index: PrefixIndex, kv_events: KVEventSubscriber | None, router: Router
) -> None:
    """A replica that leaves is cleared from the index (and from the router's adapter model); so is one that turns
    unhealthy without KV events (its predicted entries would be stale when it comes back)."""

    def on_change(rep: Replica) -> None:
        if rep.state == ReplicaState.UNHEALTHY and not signals.events_healthy(kv_events, rep):
            index.clear(rep.index)

    table.on_change(on_change)
    table.on_remove(lambda rep: index.clear(rep.index))
    table.on_remove(router.forget_adapters)


def _register_metrics(svc: Services) -> None:
    """Scrape-time metrics: each component's stats, rendered by ``router.telemetry`` (and the collectors the
    membership signal modules own)."""
    t = svc.telemetry
    t.add_gauges(lambda: index_gauges(svc.index.stats()))
    t.add_gauges(lambda: replica_gauges(svc.table.all(), svc.token_ids.accepts))
    t.add_gauges(lambda: _router_gauges(svc))
    t.add_gauges(lambda: _adapter_gauges(svc))
    images = svc.pipeline.images
    if images is not None:
        t.add_gauges(lambda: image_render_gauges(images.calls, images.cache.lookups, len(images.cache)))
    if isinstance(svc.tokenizer, HfTokenizer):
        cache = svc.tokenizer.cache
        t.add_gauges(lambda: tokenizer_cache_gauges(cache.stats()))
    t.add_gauges(lambda: kubernetes_metrics(svc.membership.watcher))
    t.add_gauges(lambda: dispatch_gauges(svc.gate))
    t.add_gauges(lambda: admission_gauges(svc.admission))
    t.add_gauges(lambda: budget_gauges(svc.tenants.budget))
    t.add_gauges(lambda: lag_gauges(svc.loop_lag))
    if svc.guard.shedder is not None:
        shedder = svc.guard.shedder
        t.add_gauges(lambda: shedder_gauges(shedder))
    if svc.membership.shared is not None:
        svc.membership.shared.register_metrics(t.registry)
    if svc.kv_events is not None:
        svc.kv_events.register_metrics(t.registry)
    svc.engine_metrics.register_metrics(t.registry)
    if svc.epp is not None:
        picker = svc.epp.picker
        t.add_gauges(lambda: epp_gauges(picker.active))


def _router_gauges(svc: Services) -> Iterator[Metric]:
    """The router's own scrape-time values (rendered by ``router.telemetry.router_gauges``)."""
    policy = svc.router.policy
    if isinstance(policy, RegionLadderPolicy):  # the ladder decides around the configured policy
        policy = policy.inner
    excluded = getattr(policy, "excluded_candidates", None)
    return router_gauges(
        svc.inflight,
        excluded if isinstance(excluded, int) else None,
        svc.router.panic_decisions,
        svc.token_ids.audited,
        svc.token_ids.audit_mismatches,
    )


def _adapter_gauges(svc: Services) -> Iterator[Metric]:
    """The router's LoRA adapter values (rendered by ``router.telemetry.adapter_gauges``)."""
    r = svc.router
    reps = svc.table.all()
    deferred = {rep.name: r.adapter_deferred[rep.index] for rep in reps if rep.index in r.adapter_deferred}
    resident = {rep.name: len(r.adapters.resident(rep.index)) for rep in reps if rep.loras}
    return adapter_gauges(deferred, r.adapter_dispatches, resident)


def _build_peer_feed(
    regions: RegionSettings,
    members: MembershipSettings,
    headers: dict[str, str],
    telemetry: Telemetry,
    router: Router,
    policy: Policy,
) -> PeerFeed | None:
    """With peer regions: their summaries and measured round trips (``PeerViews``), fed every probe interval
    (membership's probe period and timeout); a measured round trip replaces the configured one in the ladder's
    matrix and in ``peer_rtt_s``."""
    if not (regions.region_peers and isinstance(policy, RegionLadderPolicy)):
        return None
    views = PeerViews(
        regions.region_summary_stale_after_s,
        regions.region_rtt_ewma_alpha,
        regions.region_rtt_min_samples,
        time.monotonic,
    )
    views.on_fallback.append(lambda peer, why: telemetry.region_summary_fallbacks.labels(peer, why).inc())
    router.peer_views = views
    home = regions.region

    def measured(peer: str, rtt_s: float) -> None:
        policy.matrix = with_round_trip(policy.matrix, home, peer, rtt_s)
        router.peer_rtt_s[peer] = rtt_s
        telemetry.region_rtt.labels(peer).set(rtt_s)

    return PeerFeed(
        views,
        regions.region_peers,
        regions.region_peer_health_path,
        members.probe_interval_s,
        headers,
        members.probe_timeout_s,
        measured,
        lambda peer, what: telemetry.region_feed_errors.labels(peer, what).inc(),
        lambda peer, outcome, size: _count_fetch(telemetry, peer, outcome, size),
    )


def _count_fetch(telemetry: Telemetry, peer: str, outcome: str, size: int) -> None:
    """One summary fetch from ``peer``: its outcome and body bytes."""
    telemetry.region_summary_fetches.labels(peer, outcome).inc()
    telemetry.region_summary_bytes.labels(peer).inc(size)


async def region_summary(svc: Services) -> PublishedSummary:
    """What this router publishes on ``GET /region/summary`` (``policies.peer_summary.publish_summary``): per
    model its own routable engines' load (peers left out) and the prefix filter of the blocks they hold (GPU tier),
    rebuilt at most every ``region_summary_refresh_s``; the filter and the encoding off the event loop."""
    if svc.summary is None:
        s, block_size = svc.settings.regions, svc.settings.routing.block_size
        params = SummaryParams(s.region_summary_bits_per_key, s.region_summary_sample_every)

        def build(loads: dict[str, RegionLoad], keys: list[BlockKey]) -> PublishedSummary:
            return publish_summary(s.region, loads, block_size, PrefixSummary.from_keys(keys, params))

        svc.summary = SummaryPublisher(
            lambda: _summary_snapshot(svc, params), build, s.region_summary_refresh_s, time.monotonic
        )
    return await svc.summary.current()


def _summary_snapshot(svc: Services, params: SummaryParams) -> tuple[dict[str, RegionLoad], list[BlockKey]]:
    """The loads of this region's own routable engines per model and the block keys they hold (on the loop)."""
    own = [r for r in svc.table.all() if r.routable and not r.is_peer]
    cands = build_candidates([svc.router.facts(r) for r in own], {}, 0, svc.settings.routing.block_size)
    by_model: dict[str, list[Candidate]] = {}
    for rep, cand in zip(own, cands, strict=True):
        for model in rep.models:
            by_model.setdefault(model, []).append(cand)
    mean_tokens = _mean_prefill_tokens(svc.policy)
    loads = {m: region_load(cs, mean_tokens) for m, cs in by_model.items()}
    return loads, svc.index.held_keys(params.tiers, {r.index for r in own})


def _mean_prefill_tokens(policy: Policy) -> float:
    """Uncached tokens per queued request when an engine reports only a request count: the ``ttft`` policy's
    (learned) mean, inside the ladder or not; 0 for a policy without one."""
    inner = getattr(policy, "inner", policy)
    mean = getattr(inner, "mean_uncached_tokens", None)
    return float(mean()) if callable(mean) else 0.0


def _background(svc: Services) -> list[StartStop]:
    """The start/stop pairs of the background parts, in start order (tracing first: stopped last, the spans
    of the last requests leave)."""
    tracing = svc.pipeline.tracing
    out: list[StartStop] = [] if tracing is None else [_tracing_pair(tracing)]
    out += [
        (svc.membership.start, svc.membership.stop),  # static, kubernetes, health, redis
        (svc.token_ids.start, svc.token_ids.stop),
    ]  # which replicas take token ids
    sub = svc.kv_events
    if sub is not None:

        async def start_events() -> None:
            await sub.start()
            sub.watch_table(svc.table)

        out.append((start_events, sub.stop))
    out.append((svc.engine_metrics.start, svc.engine_metrics.stop))
    lag = svc.loop_lag

    async def start_lag() -> None:
        lag.start()

    async def stop_lag() -> None:
        lag.stop()

    out.append((start_lag, stop_lag))  # the event-loop lag probe the guard sheds on
    s = svc.settings
    feed = _build_peer_feed(s.regions, s.membership, s.peer_headers(), svc.telemetry, svc.router, svc.policy)
    if feed is not None:
        out.append((feed.start, feed.stop))  # peer regions' summaries and round trips
    return out


def _build_chains(shared: SharedStateSettings, membership: Membership) -> ResponseChains:
    """The Responses API's response id -> replica and conversation maps (shared through Redis when configured)."""
    owners = ResponseMap(
        membership.shared,
        ttl_s=shared.response_map_ttl_s,
        local_max=shared.response_map_local_entries,
    )
    conversations = ResponseMap(
        membership.shared,
        ttl_s=shared.response_map_ttl_s,
        local_max=shared.response_history_local_entries,
        namespace="resp-conv",
    )
    return ResponseChains(owners, conversations, shared.response_history_max_bytes)


def lag_idle_interval_s(members: MembershipSettings) -> float:
    """The loop-lag probe's period while the router is idle (``router.serve.loop_lag``): the shorter of the scrape
    and health-probe periods, s. Its due times are then due times of that work too (``membership.ticks``), so an
    idle loop does not wake for the probe alone."""
    return min(members.scrape_interval_s, members.probe_interval_s)


def _build_front(
    client: ClientEdgeSettings,
    tenancy: TenancySettings,
    telemetry: Telemetry,
    table: ReplicaTable,
    membership: Membership,
    router: Router,
    members: MembershipSettings,
) -> tuple[Admission, IdempotencyGuard, LoopLag, Guard, Intake, TenantAdmission]:
    """The request front: the in-flight limit, idempotency keys, the loop-lag probe and the guard on it, body
    intake, identity and tenant admission."""
    admission = Admission(client.max_inflight_total, client.max_queued_requests, client.max_queue_wait_s)
    idempotency = IdempotencyGuard(membership.shared, client.retry_after_s)
    loop_lag = LoopLag(
        client.event_loop_lag_interval_s,
        client.event_loop_lag_window_s,
        telemetry.registry,
        idle_interval_s=lag_idle_interval_s(members),
    )
    guard = _build_guard(client, tenancy, loop_lag, admission)
    intake = _build_intake(client, table, telemetry)
    tenants = _build_tenants(tenancy, client, membership, admission, telemetry, router)
    return admission, idempotency, loop_lag, guard, intake, tenants


def _tracing_pair(tracing: Tracing) -> StartStop:
    """Tracing's start/stop pair: nothing to start; stopping exports what is buffered (off the event loop)."""

    async def no_start() -> None:
        return None

    async def stop_tracing() -> None:
        await asyncio.to_thread(tracing.shutdown)

    return no_start, stop_tracing


def _tracing_config(tracing: TracingSettings) -> TracingConfig | None:
    """The tracing settings (None: ``otlp_traces_endpoint`` unset, tracing off)."""
    if not tracing.otlp_traces_endpoint:
        return None
    return TracingConfig(
        endpoint=tracing.otlp_traces_endpoint,
        protocol=tracing.otlp_traces_protocol,
        sample_ratio=tracing.trace_sample_ratio,
        service_name=tracing.otel_service_name,
    )


def _pipeline_config(settings: Settings) -> PipelineConfig:
    """What the pipeline's steps read, from the routing, shared-state, regions and tokenizer sub-configs."""
    routing, tok = settings.routing, settings.tokenizer
    return PipelineConfig(
        session_header=routing.session_header,
        session_affinity=settings.shared_state.session_affinity,
        region=settings.regions.region,
        tokenize_scope=tok.tokenize_scope,
        tokenize_lookahead_chars=tok.tokenize_lookahead_chars,
        tokenize_first_prefix_chars=tok.tokenize_first_prefix_chars,
    )


def _epp_config(settings: Settings) -> EppConfig:
    """What the endpoint picker reads, from the picker, client-edge, engine-edge, server and membership
    sub-configs."""
    picker, client, engine = settings.picker, settings.client_edge, settings.engine_edge
    return EppConfig(
        host=settings.server.host,
        epp_grpc_port=picker.epp_grpc_port,
        epp_grpc_insecure=picker.epp_grpc_insecure,
        epp_tls_cert_file=picker.epp_tls_cert_file,
        epp_tls_key_file=picker.epp_tls_key_file,
        epp_max_streams_per_connection=picker.epp_max_streams_per_connection,
        epp_max_streams=picker.epp_max_streams,
        epp_request_timeout_s=picker.epp_request_timeout_s,
        epp_min_body_rate_bytes_per_s=picker.epp_min_body_rate_bytes_per_s,
        epp_body_rate_grace_s=picker.epp_body_rate_grace_s,
        max_request_bytes=client.max_request_bytes,
        max_header_bytes=client.max_header_bytes,
        max_header_count=client.max_header_count,
        retry_after_s=client.retry_after_s,
        engine_stream_usage=engine.engine_stream_usage,
        engine_max_body_bytes=engine.engine_max_body_bytes,
        shutdown_grace_s=settings.server.shutdown_grace_s,
        probe_interval_s=settings.membership.probe_interval_s,
        peer_key=settings.regions.peer_api_keys[0].get_secret_value()
        if settings.regions.peer_api_keys
        else None,
    )


def _replicas_and_index(
    settings: Settings, headers: dict[str, str]
) -> tuple[ReplicaTable, PrefixIndex, Membership, KVEventSubscriber | None]:
    """The replica table (stable indices: ordinals, Redis registry, grace), the prefix index, membership and the
    KV-event subscriber feeding the index (a root helper: it hands each its concern's sub-config)."""
    routing, kv, members = settings.routing, settings.kv, settings.membership
    table = ReplicaTable(make_allocator(settings.membership_config()))
    index = _build_index(kv, routing.block_size)
    membership = _build_membership(
        settings.membership_config(), members, settings.regions, routing, table, index, headers
    )
    kv_events = signals.build_kv_events(kv, members, routing.seed_model, index)
    return table, index, membership, kv_events


def build_services(settings: Settings, *, epp: bool = False) -> Services:
    """Build every component from ``settings`` (nothing is started; see ``run``), each from its concern's
    sub-config, never the whole settings; with ``epp`` also the endpoint picker's gRPC server. Raises ValueError /
    KeyError / TokenizerError on invalid configuration (the message names the option)."""
    routing, kv, members = settings.routing, settings.kv, settings.membership
    engine, regions = settings.engine_edge, settings.regions
    headers = engine.engine_headers()
    telemetry = Telemetry()
    _configure_engine_tls(engine)
    table, index, membership, kv_events = _replicas_and_index(settings, headers)
    policy = _build_policy(routing, regions)
    tokenizer = _build_tokenizer(settings.tokenizer, headers)
    # scrapes through the proxy's engine pool (created in the event loop when first used)
    engine_client = PooledScrapeClient(lambda: edge.pool(), engine.engine_max_body_bytes)
    engine_metrics = signals.build_engine_metrics(
        members,
        routing.block_size,
        table,
        headers,
        kv_events,
        client=engine_client,
        also_on_snapshot=lambda rep, snap: _observe_snapshot(router, dispatcher, rep, snap),
    )
    _probe_over_pool(membership, engine_client)
    router = _build_router(
        routing, kv.predict_mode, regions, settings.pd, table, index, policy, kv_events, membership
    )
    token_ids = _build_token_ids(settings.tokenizer, members.probe_interval_s, headers, tokenizer, table)
    gate = _build_gate(routing, table, index)
    proxy = settings.proxy()
    edge = _build_edge(proxy, router, telemetry, token_ids, membership)
    dispatcher = _build_dispatcher(proxy, engine, settings.pd, router, edge, telemetry, gate)
    dispatcher.exact_prompt_counts = tokenizer.mode in ("hf", "engine")
    admission, idempotency, loop_lag, guard, intake, tenants = _build_front(
        settings.client_edge, settings.tenancy, telemetry, table, membership, router, members
    )
    pipeline = Pipeline(
        _pipeline_config(settings),
        telemetry,
        table,
        router,
        tokenizer,
        tenants,
        intake,
        membership,
        guard,
        token_ids,
        dispatcher,
        _build_chains(settings.shared_state, membership),
        _build_images(settings.tokenizer, headers),
        build_tracing(_tracing_config(settings.tracing)),
    )
    _keep_index_honest(table, index, kv_events, router)
    svc = Services(
        settings=settings,
        telemetry=telemetry,
        table=table,
        index=index,
        policy=policy,
        tokenizer=tokenizer,
        membership=membership,
        kv_events=kv_events,
        engine_metrics=engine_metrics,
        router=router,
        token_ids=token_ids,
        edge=edge,
        gate=gate,
        dispatcher=dispatcher,
        admission=admission,
        idempotency=idempotency,
        loop_lag=loop_lag,
        guard=guard,
        intake=intake,
        tenants=tenants,
        pipeline=pipeline,
    )
    _plan_background(svc, epp)
    _register_metrics(svc)
    return svc


def _plan_background(svc: Services, epp: bool) -> None:
    """The background parts ``run`` starts in order (and stops in reverse); with ``epp`` the endpoint picker's gRPC
    server last (started after membership, stopped first)."""
    svc.background = _background(svc)
    if epp:
        svc.epp = EppServer(svc.pipeline, svc.edge.feedback, _epp_config(svc.settings))
        svc.background.append((svc.epp.start, svc.epp.stop))


# ---------------------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def run(svc: Services) -> AsyncIterator[None]:
    """Start the background parts (membership first), run, then stop everything in reverse order."""
    started: list[StartStop] = []
    expire_task: asyncio.Task[None] | None = None
    try:
        for start, stop in svc.background:
            await start()
            started.append((start, stop))
        expire_task = asyncio.create_task(_expire_loop(svc), name="kvroute-index-expire")
        log.info("kvroute started", extra={"settings": svc.settings.safe_dict()})
        yield
    finally:
        if expire_task is not None:
            expire_task.cancel()
        for _, stop in reversed(started):
            with contextlib.suppress(Exception):
                await stop()
        await svc.gate.aclose()
        await svc.edge.aclose()
        await svc.tokenizer.aclose()
        if svc.pipeline.images is not None:
            await svc.pipeline.images.aclose()


async def _expire_loop(svc: Services) -> None:
    """Expire stale predicted entries periodically (match() also expires lazily), at the whole multiples of the
    period (``membership.ticks``: with the router's other periodic work)."""
    due = None
    while True:
        due = await sleep_to_next_due(svc.settings.kv.index_expire_interval_s, due)
        try:
            svc.index.expire()
        except Exception:
            log.exception("index expire failed")
