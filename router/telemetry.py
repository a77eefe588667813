"""The router's own Prometheus metrics (one private registry, never the global one) and structured logs.

Metric names (all prefixed ``kvroute_``):

* ``requests_total{route,status}``: HTTP requests answered, by route template and status code.
* ``decision_seconds``: time to tokenize + hash + match + choose, seconds (histogram).
* ``routed_total{policy,branch,replica}``: decisions by policy branch and chosen replica.
* ``ttft_seconds{replica}``: router-measured time to first byte of the response body, seconds (histogram).
* ``retries_total{reason}``, ``upstream_errors_total{reason}``: failed attempts, and requests that failed for good.
* ``migrations_total{reason,outcome}``, ``streams_lost_total{reason}``, ``migration_reprefill_tokens_total``,
  ``migration_seconds``: mid-stream migration (``router.serve.migration``).
* ``relayed_pieces_total{path}``: pieces of engine event streams relayed to clients, ``direct`` from the engine
  connection's read callback or by the request's ``task`` (``router.engine.relay.Relay``).
* ``tokenize_tokens_total{kind}``: prompt tokens the router tokenized (``tokenized``) or, past the fleet's cache
  frontier, only estimated (``estimated``); ``partial_ids_requests_total``: requests routed on a prefix of their
  ids (``router.tokens.frontier``).
* ``prompt_tokens_total``, ``predicted_cached_tokens_total``, ``engine_cached_tokens_total``: for requests where
  the engine reported cached tokens, the router's prediction vs the engine's report, tokens.
* ``cached_tokens_match_total{result}``: per request, ``exact`` when the prediction equals the engine's report,
  ``over`` / ``under`` otherwise.
* ``reuse_available_tokens_total``, ``reuse_achieved_tokens_total``: per forwarded request, the most cached
  prompt tokens any eligible replica held vs what the chosen replica held (``policies.base.Reuse``), tokens;
  ``reuse_missed_tokens`` (histogram): their difference per decision; ``reuse_decisions_total{outcome}``:
  ``best`` (the chosen replica held the most), ``traded`` (it held less: reuse traded for a shorter queue, or a
  router miss), ``none`` (no replica held any of the prompt: a workload miss). ``1 - achieved / available`` is
  the router's share of the misses; ``prompt - available`` the workload's.
* gauges collected at scrape time: ``index_nodes``, ``index_bytes`` (and every numeric ``PrefixIndex.stats()``
  value as ``index_<name>``), ``replica_state{replica,state}``, ``replica_inflight_requests{replica}``,
  ``inflight_requests``.
* ``kubernetes_{synced,lists,watches,events,gone,errors,resync_repairs}``: the pod watcher
  (``kubernetes_metrics``).
* ``tokenizer_cache_*``: the prefix tokenization cache's ``stats()`` (``tokenizer_cache_gauges``).
* KV-event and scrape counters are owned by ``membership.kv_events`` / ``membership.engine_metrics``; they register
  their collectors (``membership.metrics.FamiliesCollector``) on this registry.
* ``pd_plans_total{policy,kind}``, ``pd_legs_total{replica,leg}``, ``pd_leg_seconds{leg}``, ``pd_handoff_seconds``,
  ``pd_fallbacks_total{reason}``, ``pd_link_bandwidth_bytes_per_second``, ``pd_link_samples_total{outcome}``:
  prefill/decode plans, their legs and the learned P->D link (``PdMetrics``, created by ``router.pd.legs.PdLegs``).
* components' own counters, declared below and created by their component on this registry (a family exists only
  where its component does): ``class_{predicted,observed}_ttft_seconds{class}``, ``priority_unknown_total``
  (``ClassMetrics``), ``epp_requests_total{status}``, ``epp_protocol_errors_total{reason}`` (``EppMetrics``),
  ``engine_usage_missing_total``, ``client_fields_stripped_total``, ``client_connections_cut_total``,
  ``event_loop_lag_seconds``, ``event_loop_own_lag_seconds``.
* the router queue (``admission_gauges``), the dispatch gate (``dispatch_gauges``), the loop lag (``lag_gauges``,
  ``shedder_gauges``), tenant quotas (``budget_gauges``), the endpoint picker's streams (``epp_gauges``), the
  router's own values (``router_gauges``).

One style: every router metric is declared here. Components count the counters declared here (``Telemetry``'s,
or their own created from a declaration below) or expose ``stats()`` / plain counters, and never build a metric
family; the functions here render those at scrape time (typed by what they read, so this module imports no
component), and ``router.services`` registers each with ``Telemetry.add_gauges`` (``tests/unit/test_layering.py``
checks both).

Logs: one JSON object per line (``log_format=json``) via ``setup_logging``; secrets are never logged (settings are
logged through ``Settings.safe_dict``; an ``extra`` field that names a credential is masked, ``is_secret_field``,
while token counts such as ``prompt_tokens`` stay visible). A line logged while a request with a trace id is served
(uvicorn's access line, the router's own lines) carries ``trace_id`` (``bind_trace_id``; JSON: a field, text: a
``trace_id=`` suffix); a request without one adds nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from membership.kubernetes import PodWatcher
from membership.replicas import Replica, ReplicaState
from policies.base import Reuse

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: histogram buckets of time-to-first-token families (router-measured, per tenant, per class), seconds
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.2,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
#: histogram buckets of the PD legs and handoffs: the TTFT buckets but 7.5 and 80 s, seconds
_PD_LEG_BUCKETS = tuple(b for b in TTFT_BUCKETS if b not in (7.5, 80.0))
#: histogram buckets of the event-loop lag probe, seconds
_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_MISSED_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _FnCollector(Collector):
    """Adapts a function returning metric families into a registry collector."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        try:
            yield from self._fn()
        except Exception:  # a broken gauge source must never break /metrics
            logging.getLogger("kvroute.telemetry").exception("metrics collector failed")


class Telemetry:
    """Holds the router's metrics registry and counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._texts: list[Callable[[], Iterator[bytes]]] = []
        # registered in this order: the exposition lists the families in it
        self._define_request_metrics(self.registry)
        self._define_engine_hop_metrics(self.registry)
        self._define_token_metrics(self.registry)
        self._define_reuse_metrics(self.registry)

    def _define_request_metrics(self, r: CollectorRegistry) -> None:
        """Requests answered, routing decisions (count and time), router-measured TTFT."""
        self.requests = Counter(
            "kvroute_requests", "HTTP requests answered by route and status", ["route", "status"], registry=r
        )
        self.decision_seconds = Histogram(
            "kvroute_decision_seconds",
            "time to tokenize, hash, match and choose a replica (s)",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.routed = Counter(
            "kvroute_routed",
            "routing decisions by policy, branch and chosen replica",
            ["policy", "branch", "replica"],
            registry=r,
        )
        self.region_headers_ignored = Counter(
            "kvroute_region_headers_ignored",
            "regional headers ignored because the caller may not set them (x-kvroute-client-region from a key "
            "that is not an edge key of tenant_header_keys), by header",
            ["header"],
            registry=r,
        )
        self.region_rtt = Gauge(
            "kvroute_region_rtt_seconds",
            "round trip to a peer region's router measured from its probes (EWMA), s; the configured "
            "region_rtt_ms is used until region_rtt_min_samples probes answered",
            ["peer"],
            registry=r,
        )
        self.region_summary_fallbacks = Counter(
            "kvroute_region_summary_fallbacks",
            "peer candidates priced from this router's own view because the peer's summary was missing, stale or "
            "did not name the model, by peer region and reason",
            ["peer", "reason"],
            registry=r,
        )
        self.region_feed_errors = Counter(
            "kvroute_region_feed_errors",
            "failed probes / summary fetches of a peer region's router, by peer region and what failed",
            ["peer", "what"],
            registry=r,
        )
        self.region_summary_fetches = Counter(
            "kvroute_region_summary_fetches",
            "summary fetches from a peer region's router, by peer region and outcome (full; lean: its filter "
            "unchanged, left out; unchanged: 304, no body)",
            ["peer", "outcome"],
            registry=r,
        )
        self.region_summary_bytes = Counter(
            "kvroute_region_summary_bytes",
            "body bytes of the summaries fetched from a peer region's router, by peer region",
            ["peer"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "router-measured time to first response byte (s)",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )

    def _define_engine_hop_metrics(self, r: CollectorRegistry) -> None:
        """Retries, failed requests, relayed stream pieces, prompts sent as token ids."""
        self.retries = Counter(
            "kvroute_retries", "attempts retried on another replica, by reason", ["reason"], registry=r
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "requests that failed after all attempts, by reason",
            ["reason"],
            registry=r,
        )
        self.migrations = Counter(
            "kvroute_migrations",
            "streams whose engine failed after the first byte, by failure reason and outcome: continued (on "
            "another replica), completed (the answer was already whole), limit (migration_limit reached), "
            "not_migratable, no_replica, failed (the continuation could not start)",
            ["reason", "outcome"],
            registry=r,
        )
        self.streams_lost = Counter(
            "kvroute_streams_lost",
            "client streams that ended mid-way with an error event, by the last failure's reason",
            ["reason"],
            registry=r,
        )
        self.migration_tokens = Counter(
            "kvroute_migration_reprefill_tokens",
            "prompt tokens (original prompt + tokens already streamed) of continuations, minus those the router "
            "predicted cached where they went",
            registry=r,
        )
        self.migration_seconds = Histogram(
            "kvroute_migration_seconds",
            "from a stream's failure to its continuation's first byte (s)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.relayed_pieces = Counter(
            "kvroute_relayed_pieces",
            "pieces of engine event streams relayed to "
            "clients, by path: direct (written from the engine connection's read "
            "callback), task (by the request's task: the first piece, pieces that "
            "waited for a slow client, servers without a direct path)",
            ["path"],
            registry=r,
        )
        self.token_id_prompts = Counter(
            "kvroute_token_id_prompts",
            "engine requests (attempts) whose prompt was sent as the router's token ids (forward_token_ids)",
            registry=r,
        )

    def _define_token_metrics(self, r: CollectorRegistry) -> None:
        """Prompt tokens tokenized or estimated, partial-id routing, predicted vs engine-reported cached tokens."""
        self.tokenize_tokens = Counter(
            "kvroute_tokenize_tokens",
            "prompt tokens of text prompts the router "
            "tokenized (kind=tokenized), and those it only estimated, past the fleet's "
            "cache frontier (kind=estimated; tokenize_scope=cached_prefix)",
            ["kind"],
            registry=r,
        )
        self.image_prompts = Counter(
            "kvroute_image_prompts",
            "image chats by how their block keys were made: rendered (the engine's render endpoint gave the "
            "images' identifiers and placeholders: keyed exactly) or unkeyed (routed by load, never keyed on "
            "text alone); client uuids rewritten per tenant (scoped_uuids)",
            ["outcome"],
            registry=r,
        )
        self.partial_ids = Counter(
            "kvroute_partial_ids_requests",
            "requests routed on a prefix of their prompt's "
            "ids (cache-frontier tokenization stopped early: estimated prompt length, the "
            "text goes to the engine)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens",
            "prompt tokens of requests with an engine cached-token report",
            registry=r,
        )
        self.predicted_cached = Counter(
            "kvroute_predicted_cached_tokens",
            "cached tokens the router predicted on the chosen replica",
            registry=r,
        )
        self.engine_cached = Counter(
            "kvroute_engine_cached_tokens",
            "cached tokens the engine reported (usage.prompt_tokens_details)",
            registry=r,
        )
        self.cached_match = Counter(
            "kvroute_cached_tokens_match",
            "per request: router prediction vs engine report (exact|over|under)",
            ["result"],
            registry=r,
        )

    def _define_reuse_metrics(self, r: CollectorRegistry) -> None:
        """Requests rejected before routing; per decision, the cached prompt tokens available vs achieved."""
        self.rejected = Counter(
            "kvroute_rejected", "requests rejected before routing, by reason", ["reason"], registry=r
        )
        self.reuse_available = Counter(
            "kvroute_reuse_available_tokens",
            "per decision, the most cached prompt tokens any eligible replica held (tokens)",
            registry=r,
        )
        self.reuse_achieved = Counter(
            "kvroute_reuse_achieved_tokens",
            "per decision, the cached prompt tokens the chosen replica held (tokens)",
            registry=r,
        )
        self.reuse_missed = Histogram(
            "kvroute_reuse_missed_tokens",
            "per decision, available minus achieved cached prompt tokens (tokens)",
            buckets=_MISSED_TOKEN_BUCKETS,
            registry=r,
        )
        self.reuse_decisions = Counter(
            "kvroute_reuse_decisions",
            "decisions by reuse outcome: best (chose the "
            "replica holding the most), traded (chose one holding less), none (no "
            "replica held any of the prompt)",
            ["outcome"],
            registry=r,
        )

    def add_text(self, chunks: Callable[[], Iterator[bytes]]) -> None:
        """Register a source of exposition text appended after the registry's (whole metric families, in slices:
        ``render_stream`` yields to the event loop between them). For families with many series (per tenant),
        where prometheus_client's generic exposition is too slow for the event loop."""
        self._texts.append(chunks)

    def add_gauges(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """Register ``fn`` to produce gauge families at every scrape (index size, replica states, ...)."""
        self.registry.register(_FnCollector(fn))

    def add_collector(self, collector: Collector) -> None:
        """Register another component's collector (e.g. KV-event counters) in the router registry."""
        self.registry.register(collector)

    def observe_cached(self, prompt_tokens: int, predicted: int, reported: int) -> None:
        """Record one request's predicted vs engine-reported cached tokens (tokens)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted_cached.inc(predicted)
        self.engine_cached.inc(reported)
        self.cached_match.labels(
            "exact" if predicted == reported else "over" if predicted > reported else "under"
        ).inc()

    def observe_reuse(self, reuse: Reuse) -> None:
        """Record one forwarded decision's available vs achieved cached prompt tokens (tokens)."""
        self.reuse_available.inc(reuse.available_tokens)
        self.reuse_achieved.inc(reuse.achieved_tokens)
        self.reuse_missed.observe(reuse.missed_tokens)
        outcome = "none" if reuse.available_tokens == 0 else "best" if reuse.missed_tokens == 0 else "traded"
        self.reuse_decisions.labels(outcome).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return b"".join([generate_latest(self.registry), *(c for source in self._texts for c in source())])

    async def render_stream(self) -> AsyncIterator[bytes]:
        """``render`` in pieces, yielding to the event loop between them (a scrape never holds the loop for the
        whole exposition)."""
        yield generate_latest(self.registry)
        for source in self._texts:
            for chunk in source():
                await asyncio.sleep(0)
                yield chunk


# ---------------------------------------------------------------------------------------------------------
# components' counters: declared here, created by their component on the router's registry (so a family exists
# only where its component does, e.g. the PD families on a PD fleet) and counted by it
# ---------------------------------------------------------------------------------------------------------


class PdMetrics:
    """The PD metrics (``router.pd.legs.PdLegs``): plans, legs, their latencies, fallbacks, the learned link."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.plans = Counter(
            "kvroute_pd_plans",
            "PD plans dispatched, by policy and kind (in_place, disaggregated)",
            ["policy", "kind"],
            registry=registry,
        )
        self.legs = Counter(
            "kvroute_pd_legs",
            "PD legs sent, by replica and leg (prefill, decode; in_place: "
            "in-place plans, by the planned replica)",
            ["replica", "leg"],
            registry=registry,
        )
        self.leg_seconds = Histogram(
            "kvroute_pd_leg_seconds",
            "PD leg latency: prefill leg until its answer, decode leg until its first byte (s)",
            ["leg"],
            buckets=_PD_LEG_BUCKETS,
            registry=registry,
        )
        self.handoff_seconds = Histogram(
            "kvroute_pd_handoff_seconds",
            "sequential relay: from the prefill "
            "answer to the decode leg's first byte (KV transfer + first decode "
            "step), s",
            buckets=_PD_LEG_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "kvroute_pd_fallbacks",
            "disaggregated plans served in place instead, by reason (prefill_failed, decode_failed, "
            "transfer_failed, engine_id_unknown, replica_gone, bad_body; the endpoint picker: no_body)",
            ["reason"],
            registry=registry,
        )
        self.mooncake_unknown = Counter(
            "kvroute_pd_mooncake_engine_unknown",
            "Mooncake plans whose prefill replica's engine id the router could not learn from its bootstrap "
            "server (GET /query): no Mooncake parameters sent, by prefill replica",
            ["replica"],
            registry=registry,
        )
        self.mooncake_queries = Counter(
            "kvroute_pd_mooncake_queries",
            "bootstrap /query requests for Mooncake engine ids, by outcome (ok, failed)",
            ["outcome"],
            registry=registry,
        )
        self.link_bandwidth = Gauge(
            "kvroute_pd_link_bandwidth_bytes_per_second",
            "P->D link bandwidth the PD plans use: configured, then learned from observed handoffs (bytes/s)",
            registry=registry,
        )
        self.link_samples = Counter(
            "kvroute_pd_link_samples",
            "observed handoffs fed to the P->D link estimator, "
            "by outcome: accepted / rejected (the relay's own timing; rejected: "
            "non-positive or non-finite transfer time or size), engine_accepted / "
            "engine_rejected (transfers the engines reported in /metrics, e.g. vLLM's "
            "NIXL histograms), superseded (relay timing not fed: engines report)",
            ["outcome"],
            registry=registry,
        )


class ClassMetrics:
    """Per priority class (``router.core.tenant_metrics.TenantMetrics``): the cost model's predicted TTFT vs the
    observed one, and peers' priority values no table maps."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.predicted = Histogram(
            "kvroute_class_predicted_ttft_seconds",
            "predicted TTFT of the chosen replica, by priority class (s)",
            ["class"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.observed = Histogram(
            "kvroute_class_observed_ttft_seconds",
            "observed TTFT of requests with a prediction, by priority class (s)",
            ["class"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.unknown_priority = Counter(
            "kvroute_priority_unknown",
            "requests whose peer priority header named no known class or objective (served at "
            "default_priority_class), by header",
            ["header"],
            registry=registry,
        )


class EppMetrics:
    """The endpoint picker's streams by outcome and its protocol errors (``router.epp.picker``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.streams = Counter(
            "kvroute_epp_requests",
            "endpoint-picker streams by outcome (HTTP status of the answer: 200 = routed)",
            ["status"],
            registry=registry,
        )
        self.protocol_errors = Counter(
            "kvroute_epp_protocol_errors",
            "ext_proc messages out of the protocol (answered 400 protocol_error, the stream ended), by reason",
            ["reason"],
            registry=registry,
        )


def usage_missing_counter(registry: CollectorRegistry) -> Counter:
    """``kvroute_engine_usage_missing_total{replica,what}`` (``router.engine.feedback.Feedback``)."""
    return Counter(
        "kvroute_engine_usage_missing",
        "successful engine answers without the usage the router needs for "
        "cached-token feedback, by replica and what was missing (prompt_tokens_details: vLLM without "
        "--enable-prompt-tokens-details, SGLang without --enable-cache-report; stream_usage: a stream that "
        "carried no usage although it was asked for)",
        ["replica", "what"],
        registry=registry,
    )


def fields_stripped_counter(registry: CollectorRegistry) -> Counter:
    """``kvroute_client_fields_stripped_total{field}`` (``router.serve.client_fields.ClientFields``)."""
    return Counter(
        "kvroute_client_fields_stripped",
        "router-controlled fields (kv_transfer_params, bootstrap_*, DP ranks) removed from client request "
        "bodies at intake, by field",
        ["field"],
        registry=registry,
    )


def connections_cut_counter(registry: CollectorRegistry) -> Counter:
    """``kvroute_client_connections_cut_total{reason}`` (``router.http.protocol``)."""
    return Counter(
        "kvroute_client_connections_cut",
        "client connections closed by the router for a request "
        "head over max_header_bytes / max_header_count, a head or body timeout or a body under "
        "client_body_min_rate_bytes_s, by reason",
        ["reason"],
        registry=registry,
    )


def loop_lag_histograms(registry: CollectorRegistry | None) -> tuple[Histogram, Histogram]:
    """The event-loop lag probe's delays and the part of them the router's own work explains
    (``router.serve.loop_lag.LoopLag``; ``registry`` None: not exported), seconds."""
    lag = Histogram(
        "kvroute_event_loop_lag_seconds",
        "delay of the event-loop lag probe past its due time (s)",
        buckets=_LOOP_LAG_BUCKETS,
        registry=registry,
    )
    own = Histogram(
        "kvroute_event_loop_own_lag_seconds",
        "the part of each event-loop probe delay the router's own work explains: the delay less the time the "
        "loop thread waited for a CPU, at most the CPU time the process used (s)",
        buckets=_LOOP_LAG_BUCKETS,
        registry=registry,
    )
    return lag, own


def gauge(
    name: str,
    doc: str,
    value: float | None = None,
    labels: list[str] | None = None,
    samples: Iterable[tuple[list[str], float]] = (),
) -> GaugeMetricFamily:
    """Build a gauge family: one unlabelled ``value``, or labelled ``samples`` [(label values, value)]."""
    g = (
        GaugeMetricFamily(name, doc, value=value, labels=labels)
        if labels is None
        else GaugeMetricFamily(name, doc, labels=labels)
    )
    if labels is not None:
        for lv, v in samples:
            g.add_metric(lv, v)
    return g


def stats_gauges(prefix: str, stats: Mapping[str, object], doc: Callable[[str], str]) -> Iterator[Metric]:
    """One gauge ``<prefix><key>`` per numeric value of a component's ``stats()`` (booleans and nested values
    left out); ``doc(key)`` is its help text."""
    for key, value in stats.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield gauge(f"{prefix}{key}", doc(key), float(value))


def index_gauges(stats: Mapping[str, object]) -> Iterator[Metric]:
    """Every numeric ``PrefixIndex.stats()`` value as a ``kvroute_index_<key>`` gauge (nodes, bytes, ...)."""
    for key, value in stats.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield gauge(f"kvroute_index_{key}", f"PrefixIndex.stats()[{key!r}]", float(value))


def replica_gauges(reps: Sequence[Replica], takes_token_ids: Callable[[Replica], bool]) -> Iterator[Metric]:
    """Per replica: its state, requests in flight, and whether prompts go to it as the router's token ids."""
    yield gauge(
        "kvroute_replica_state",
        "1 for the replica's current state",
        labels=["replica", "state"],
        samples=[([r.name, s.value], 1.0 if r.state == s else 0.0) for r in reps for s in ReplicaState],
    )
    yield gauge(
        "kvroute_replica_inflight_requests",
        "requests in flight per replica",
        labels=["replica"],
        samples=[([r.name], float(r.load.inflight_requests)) for r in reps],
    )
    yield gauge(
        "kvroute_replica_token_ids",
        "1 when prompts go to the replica as the router's token ids "
        "(forward_token_ids and its tokenizer check)",
        labels=["replica"],
        samples=[([r.name], 1.0 if takes_token_ids(r) else 0.0) for r in reps],
    )


_TOKENIZER_CACHE_HELP = {
    "hits": "prompts tokenized past a cached prefix only (cumulative)",
    "misses": "long prompts with no cached prefix, tokenized in pieces (cumulative)",
    "reused_tokens": "token ids taken from the prefix tokenization cache (cumulative)",
    "encoded_tokens": "token ids the cache tokenized itself (past a cached prefix, or all of a miss; cumulative)",
    "verified": "cached encodings compared with a whole tokenization (cumulative)",
    "mismatches": "audited encodings that differed (the cache is off after the first)",
    "entries": "prompts held by the prefix tokenization cache",
    "bytes": "memory held by the prefix tokenization cache, bytes",
    "enabled": "1 while the prefix tokenization cache is on",
}


def tokenizer_cache_gauges(stats: Mapping[str, float]) -> Iterator[Metric]:
    """The prefix tokenization cache's ``stats()`` as ``kvroute_tokenizer_cache_*`` gauges."""
    return stats_gauges(
        "kvroute_tokenizer_cache_",
        stats,
        lambda key: _TOKENIZER_CACHE_HELP.get(key, f"prefix tokenization cache {key}"),
    )


def kubernetes_metrics(watcher: PodWatcher | None) -> Iterator[Metric]:
    """The pod watcher's counters (nothing when discovery is off)."""
    if watcher is None:
        return
    st = watcher.stats
    yield gauge(
        "kvroute_kubernetes_synced", "1 once the first pod LIST was applied", 1.0 if watcher.synced else 0.0
    )
    for name, value, doc in (
        ("kvroute_kubernetes_lists", st.lists, "pod LIST requests (start, reconnect, 410, resync)"),
        ("kvroute_kubernetes_watches", st.watches, "pod WATCH streams opened"),
        ("kvroute_kubernetes_events", st.events, "pod watch events applied"),
        ("kvroute_kubernetes_gone", st.gone_410, "watches answered 410 Gone"),
        ("kvroute_kubernetes_errors", st.errors, "Kubernetes API errors (retried with backoff)"),
        ("kvroute_kubernetes_resync_repairs", st.resync_repairs, "changes found by a re-LIST, not the watch"),
    ):
        yield CounterMetricFamily(name, doc, value=float(value))


# ---------------------------------------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------------------------------------

#: parts of a log field's name that make it a credential (``x-api-key``, ``redis_password``, ``client_secret``)
_SECRET_PARTS = ("api_key", "apikey", "authorization", "password", "passwd", "secret", "credential", "cookie")
#: last words of a name that is a credential: ``admin_token``, ``access_token``, ``hf_token``, ``token``, a
#: ``bearer``; never the plural, so ``prompt_tokens`` / ``cached_tokens`` (counts) stay visible
_SECRET_LAST_WORDS = ("token", "bearer", "key", "keys")
#: words before a trailing ``key`` / ``keys`` that make it a credential (``api_keys``, ``tenant_header_keys``)
_KEY_OWNERS = ("api", "engine", "tenant", "header", "private", "signing", "access", "admin", "secret")


def is_secret_field(name: str) -> bool:
    """Whether a log field named ``name`` holds a credential to mask: API keys, bearer / admin / access tokens,
    passwords, secrets, authorization headers. Counts of tokens (``prompt_tokens``, ``cached_tokens``,
    ``token_ids``) and other fields that merely mention tokens are not secrets."""
    low = name.lower().replace("-", "_")
    if any(part in low for part in _SECRET_PARTS):
        return True
    words = [w for w in low.split("_") if w]
    if not words or words[-1] not in _SECRET_LAST_WORDS:
        return False
    if words[-1] in ("key", "keys"):
        return len(words) > 1 and words[-2] in _KEY_OWNERS
    return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and the record's ``extra`` fields (secrets masked)."""

    _std = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in self._std or key.startswith("_"):
                continue
            out[key] = "***" if is_secret_field(key) else value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


#: the trace id (32 hex digits) of the request the current task serves; unset for a request without one
_TRACE_ID: ContextVar[str | None] = ContextVar("kvroute_trace_id", default=None)


def bind_trace_id(trace_id: str) -> None:
    """Name ``trace_id`` (32 hex digits) as the trace of the request the current task serves: its log lines (and
    the doors' answers) carry it from now on. Each request runs in its own task, so it never leaks to another."""
    _TRACE_ID.set(trace_id)


def current_trace_id() -> str | None:
    """The trace id of the request the current task serves (``bind_trace_id``), or None."""
    return _TRACE_ID.get()


def _with_trace_id(record: logging.LogRecord) -> bool:
    """Log filter: a record logged while a request with a trace id is served gets its ``trace_id``."""
    trace_id = _TRACE_ID.get()
    if trace_id is not None:
        record.trace_id = trace_id
    return True


class _TextFormatter(logging.Formatter):
    """Plain text lines; a request's ``trace_id`` appended when the line has one."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        trace_id = getattr(record, "trace_id", None)
        return line if trace_id is None else f"{line} trace_id={trace_id}"


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Configure the root logger (stderr) once: JSON lines or plain text, a request's trace id on its lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_with_trace_id)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def monotonic() -> float:
    """The router's clock for latencies, seconds."""
    return time.monotonic()


# ---------------------------------------------------------------------------------------------------------
# scrape-time families: the components expose their counters (plain attributes), telemetry renders them here
# (typed by what it reads, so telemetry imports no component)
# ---------------------------------------------------------------------------------------------------------


class QueueCounts(Protocol):
    """The router queue's counters (``router.core.admission.Admission``)."""

    @property
    def waiting(self) -> int: ...

    queued_total: int
    queue_wait_s_total: float


class GateCounts(Protocol):
    """The cache-first dispatch gate's counters (``router.core.dispatch.DispatchGate``)."""

    queues: Any
    gone_total: int


class LagCounts(Protocol):
    """The event-loop lag probe's readings (``router.serve.loop_lag.LoopLag``)."""

    max_seen_s: float
    own_max_seen_s: float

    def lag_s(self) -> float: ...


class WaitCounts(Protocol):
    """Requests held while the loop lags (``router.serve.guard.Shedder``)."""

    waiting: int
    waited_total: int


class BudgetCounts(Protocol):
    """The tenant quotas' mode and takes (``membership.tenant_budget.TenantBudget``)."""

    @property
    def mode(self) -> str: ...

    @property
    def stats(self) -> Any: ...


def admission_gauges(adm: QueueCounts) -> Iterator[Metric]:
    """Gauge families of the router queue (collected at scrape time)."""
    yield gauge(
        "kvroute_queued_requests",
        "requests waiting in the router queue for an in-flight slot",
        float(adm.waiting),
    )
    yield gauge(
        "kvroute_queue_waited_requests",
        "requests that waited in the router queue (cumulative)",
        float(adm.queued_total),
    )
    yield gauge(
        "kvroute_queue_wait_seconds",
        "total time requests waited in the router queue (cumulative, s)",
        adm.queue_wait_s_total,
    )


def dispatch_gauges(gate: GateCounts) -> Iterator[Metric]:
    """Gauge families of the dispatch gate (collected at scrape time)."""
    q = gate.queues
    yield gauge(
        "kvroute_dispatch_waiting_requests",
        "requests waiting in the router for their replica (cache-first dispatch gate)",
        float(q.waiting()),
    )
    yield gauge(
        "kvroute_dispatch_queued_requests",
        "requests that waited for their replica (cumulative)",
        float(q.queued_total),
    )
    yield gauge(
        "kvroute_dispatch_reordered_requests",
        "requests sent ahead of older ones because more of their prompt is cached (cumulative)",
        float(q.reordered_total),
    )
    yield gauge(
        "kvroute_dispatch_expired_requests",
        "requests sent after waiting dispatch_max_wait_s (cumulative)",
        float(q.expired_total),
    )
    yield gauge(
        "kvroute_dispatch_failed_over_requests",
        "waiting requests moved to another replica because theirs stopped being routable (cumulative)",
        float(gate.gone_total),
    )
    yield gauge(
        "kvroute_dispatch_wait_seconds",
        "total time requests waited for their replica (cumulative, s)",
        q.wait_s_total,
    )
    yield gauge(
        "kvroute_dispatch_sent_prefill_tokens",
        "uncached prompt tokens sent to replicas whose first token is pending (gate's count)",
        float(sum(q.queue(r).sent_tokens for r in q.replicas())),
    )


def lag_gauges(lag: LagCounts) -> Iterator[Metric]:
    """Gauge families of the loop lag (collected at scrape time)."""
    yield gauge(
        "kvroute_event_loop_lag_recent_seconds",
        "the event loop's current lag: largest probe delay within "
        "event_loop_lag_window_s, or the probe's overdue time (s)",
        lag.lag_s(),
    )
    yield gauge(
        "kvroute_event_loop_lag_max_seconds", "largest event-loop probe delay since start (s)", lag.max_seen_s
    )
    yield gauge(
        "kvroute_event_loop_own_lag_max_seconds",
        "largest part of an event-loop probe delay the router's own work explained, since start (s)",
        lag.own_max_seen_s,
    )


def shedder_gauges(shedder: WaitCounts) -> Iterator[Metric]:
    """Gauge families of the requests held while the loop lags (collected at scrape time)."""
    yield gauge(
        "kvroute_lag_waiting_requests",
        "new requests waiting for the event loop's lag to pass (not an overload of the router's own)",
        float(shedder.waiting),
    )
    yield gauge(
        "kvroute_lag_waited_requests",
        "new requests that waited for the event loop's lag to pass (cumulative)",
        float(shedder.waited_total),
    )


def budget_gauges(budget: BudgetCounts) -> Iterator[Metric]:
    """The quota mode and the takes per mode (collected at scrape time)."""
    mode = GaugeMetricFamily(
        "kvroute_tenant_budget_mode",
        "1 for the current tenant-quota mode: shared "
        "(Redis), local_fallback (Redis unreachable: quota / tenant_expected_routers per "
        "router), local (no Redis)",
        labels=["mode"],
    )
    for name in ("shared", "local_fallback", "local"):
        mode.add_metric([name], 1.0 if budget.mode == name else 0.0)
    yield mode
    takes = CounterMetricFamily("kvroute_tenant_budget_takes", "quota takes by mode", labels=["mode"])
    st = budget.stats
    takes.add_metric(["shared"], float(st.shared_takes))
    takes.add_metric(["local_fallback"], float(st.fallback_takes))
    takes.add_metric(["local"], float(st.local_takes))
    yield takes


def epp_gauges(active: int) -> Iterator[Metric]:
    """The endpoint picker's open streams."""
    yield gauge(
        "kvroute_epp_streams_active",
        "endpoint-picker streams open now (one per request the gateway is processing)",
        float(active),
    )


def image_render_gauges(
    calls: Mapping[str, int], lookups: Mapping[str, int], entries: int
) -> Iterator[Metric]:
    """Image-chat render calls to engines by outcome (``calls``: rendered, unsupported, failed), render cache
    lookups by outcome (``lookups``: hit, miss) and the answers kept now (``entries``)."""
    c = CounterMetricFamily(
        "kvroute_image_render_calls",
        "image-chat render calls to engines (POST /v1/chat/completions/render), by outcome",
        labels=["outcome"],
    )
    for outcome, n in sorted(calls.items()):
        c.add_metric([outcome], float(n))
    yield c
    c = CounterMetricFamily(
        "kvroute_image_render_cache_lookups",
        "image-chat render cache lookups, by outcome (hit: no engine call)",
        labels=["outcome"],
    )
    for outcome, n in sorted(lookups.items()):
        c.add_metric([outcome], float(n))
    yield c
    yield gauge("kvroute_image_render_cache_entries", "image-chat render answers kept", value=float(entries))


def adapter_gauges(
    deferred: Mapping[str, int], dispatches: Mapping[str, int], resident: Mapping[str, int]
) -> Iterator[Metric]:
    """LoRA adapters: per replica, the requests its engine last reported waiting for an adapter slot
    (``deferred``, by replica name) and the adapters the router's model holds resident there (``resident``);
    LoRA requests dispatched by the adapter's predicted tier on the chosen replica (``dispatches``: gpu = resident
    in a batch slot, cpu = to activate, storage = to load)."""
    yield gauge(
        "kvroute_replica_lora_deferred_requests",
        "requests the replica's engine reports waiting for a LoRA adapter slot "
        '(vllm:num_requests_waiting_by_reason{reason="deferred"}, last scrape)',
        labels=["replica"],
        samples=[([name], float(n)) for name, n in sorted(deferred.items())],
    )
    yield gauge(
        "kvroute_replica_lora_adapters_resident",
        "LoRA adapters the router's adapter model holds in the replica's GPU slots or CPU cache",
        labels=["replica"],
        samples=[([name], float(n)) for name, n in sorted(resident.items())],
    )
    c = CounterMetricFamily(
        "kvroute_lora_dispatches",
        "LoRA requests dispatched, by the adapter's predicted tier on the chosen replica (gpu: in a batch slot, "
        "cpu: to activate, storage: to load)",
        labels=["tier"],
    )
    for tier, n in sorted(dispatches.items()):
        c.add_metric([tier], float(n))
    yield c


def router_gauges(
    inflight: int,
    excluded_candidates: int | None,
    panic_decisions: int,
    token_id_audits: int,
    token_id_mismatches: int,
) -> Iterator[Metric]:
    """The router's own scrape-time values: in flight, candidates the policy could not score (None: the policy
    does not count them), panic decisions, token-id audits."""
    yield gauge("kvroute_inflight_requests", "requests in flight through the router", float(inflight))
    if excluded_candidates is not None:
        yield gauge(
            "kvroute_policy_excluded_candidates",
            "candidates left out of routing decisions because their score could not be computed (not finite or "
            "negative: broken load values; cumulative)",
            float(excluded_candidates),
        )
    yield gauge(
        "kvroute_panic_decisions",
        "decisions made among unhealthy replicas because none was ready (cumulative)",
        float(panic_decisions),
    )
    yield gauge(
        "kvroute_token_id_audits",
        "prompts sent as ids re-checked against the replica's /tokenize (cumulative)",
        float(token_id_audits),
    )
    yield gauge(
        "kvroute_token_id_audit_mismatches",
        "audited prompts the replica tokenized differently: it gets text from then on (cumulative)",
        float(token_id_mismatches),
    )
