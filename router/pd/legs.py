"""The two-leg orchestrator: serves a disaggregated plan (prefill on P, decode on D) for ``router.engine.proxy.Proxy``.

The proxy calls ``PdLegs.serve`` for a ``Routed`` whose plan is disaggregated (``Routed.disaggregated``); in-place
plans go through the proxy's ordinary attempts. Per request:

1. both legs are charged BEFORE anything is sent (``_Hold`` on P: the request and its uncached prompt tokens; on
   D: the request). Charging the decode leg only when it returns is the bug class that sends every request to
   prefill #0 (sglang #27547, smg #1714);
2. the legs run by protocol (``pd_protocol``; ``auto``: by the prefill replica's dialect):
   * ``vllm`` (router/pd/vllm.py): sequential relay. The prefill leg (not streamed, one token) must answer
     before the decode leg is sent with the returned ``kv_transfer_params``, relayed opaquely;
   * ``mooncake`` (router/pd/vllm.py): concurrent, the router mints ``transfer_id`` and names the prefill
     engine by the id its bootstrap server lists (router/pd/mooncake.py); an id the router cannot learn means no
     Mooncake parameters are sent at all (the plan's next prefill replica, else served in place; counted in
     ``kvroute_pd_mooncake_engine_unknown_total{replica}``, logged once per replica), never a made-up id;
   * ``sglang`` (router/pd/sglang.py): concurrent, both legs carry the bootstrap host / port / room (scalars);
     the prefill answer is drained and discarded;
   a prefill answer is read once, bounded (``pd_max_prefill_answer_bytes``; 64 KiB or more off the event loop),
   and its ``kv_transfer_params`` relayed as the bytes the engine sent, at most ``pd_max_transfer_params_bytes``
   (an answer over either bound is a failed prefill leg);
3. both legs carry the same ``X-Request-Id``; a plan's ``dp_rank`` pins the decode leg with
   ``X-data-parallel-rank``;
4. the decode leg's first byte commits the answer through the proxy's own commit path (headers, stream relay,
   usage feedback, release of D's hold when the response ends); the response also names the prefill replica
   (``x-kvroute-prefill-replica``);
5. failures before the first byte: a failed prefill leg (connection error, 5xx, timeout, unreadable answer)
   is retried on the next plan's prefill replica with the same decode replica (``max_retries``, counted in
   ``kvroute_retries_total{reason="pd_prefill_failed"}``), then falls back to serving in place, on the plan's
   decode replica first and then the ranking, through the proxy's attempts (which retry before the first byte);
   a failed decode leg re-runs both legs on the next plan's pair with an untried decode replica (``max_retries``,
   counted in ``kvroute_retries_total{reason="pd_decode_failed"}``: SGLang rooms and Mooncake transfer ids bind a
   prefill leg to one decode leg, and a NIXL prefill's blocks may be freed), then is served in place without that
   replica. With a concurrent protocol, a decode leg that fails before its first byte while its prefill leg
   failed too (or its prefill replica is no longer routable) failed because of the transfer: both legs are re-run,
   with fresh bootstrap fields / transfer id, on the plan's next prefill replica with the same decode replica
   (``kvroute_retries_total{reason="pd_transfer_failed"}``; the same ``max_retries`` budget as failed prefill
   legs). Every fallback is counted
   (``kvroute_pd_fallbacks_total{reason}``) and logged, never silent;
6. every prefill leg that answers is an observation of its prefill replica for the PD policy
   (``Router.observe_pd``: prompt tokens, the leg's reported cached tokens else the router's estimate, the leg's
   seconds as TTFT), so ``pd_ttft`` calibrates its prefill side online;
7. a client that disconnects cancels the request's task: both legs' upstream requests are closed (the engines
   abort them).

Metrics (on the router's registry): ``kvroute_pd_plans_total{policy,kind}``, ``kvroute_pd_legs_total{replica,leg}``
(legs sent, to compare with the engines' counters), ``kvroute_pd_leg_seconds{leg}`` (prefill leg: until its answer;
decode leg: until its first byte), ``kvroute_pd_handoff_seconds`` (sequential relay: from the prefill answer to
the decode leg's first byte, i.e. KV transfer plus the first decode step), ``kvroute_pd_fallbacks_total{reason}``,
``kvroute_pd_link_bandwidth_bytes_per_second`` (the P->D bandwidth the plans use: configured, then learned from
each sequential-relay handoff by ``policies.pd_link.LinkEstimator``), ``kvroute_pd_link_samples_total{outcome}``.

Units: seconds, tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson
from prometheus_client import Counter, Gauge, Histogram
from starlette.responses import Response

from membership.engine_metrics import EngineSnapshot
from membership.replicas import Replica
from policies.base import Observation
from policies.pd_base import Plan
from policies.pd_link import TransferTotals
from router.core.routing import Routed, serves_alone
from router.engine.client import EngineError, EngineResponse, EngineResponseTooLarge
from router.engine.proxy import _AttemptFailed, _cached_tokens, _Hold
from router.engine.scrape import PooledScrapeClient
from router.errors import error_response
from router.pd import mooncake as pd_mooncake
from router.pd import sglang as pd_sglang
from router.pd import vllm as pd_vllm
from router.pd.mooncake import MooncakeIds
from router.tokens.token_ids import IdsPrompt

if TYPE_CHECKING:
    from router.engine.proxy import Proxy

log = logging.getLogger("kvroute.pd")

_LEG_BUCKETS = (
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
    10.0,
    20.0,
    40.0,
)


@dataclass(frozen=True, slots=True)
class PdConfig:
    """PD wire settings (from ``Settings``; no defaults here).

    Attributes:
        protocol: ``auto``, ``vllm``, ``mooncake`` or ``sglang``.
        default_bootstrap_port: SGLang / Mooncake bootstrap port of prefill replicas that name none.
        max_prefill_answer_bytes: largest prefill-leg answer read, bytes.
        max_transfer_params_bytes: largest ``kv_transfer_params`` relayed to a decode leg, bytes.
        mooncake_query_timeout_s: timeout of one bootstrap ``/query``, seconds.
        mooncake_ids_ttl_s: discovered Mooncake engine ids are asked again after this long, seconds.
    """

    protocol: str
    default_bootstrap_port: int
    max_prefill_answer_bytes: int
    max_transfer_params_bytes: int
    mooncake_query_timeout_s: float
    mooncake_ids_ttl_s: float


class PdMetrics:
    """The PD metrics, registered on the router's registry."""

    def __init__(self, registry: Any) -> None:
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
            buckets=_LEG_BUCKETS,
            registry=registry,
        )
        self.handoff_seconds = Histogram(
            "kvroute_pd_handoff_seconds",
            "sequential relay: from the prefill "
            "answer to the decode leg's first byte (KV transfer + first decode "
            "step), s",
            buckets=_LEG_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "kvroute_pd_fallbacks",
            "disaggregated plans served in place instead, by reason (prefill_failed, decode_failed, "
            "transfer_failed, engine_id_unknown, replica_gone, bad_body)",
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


#: prefill answers at least this large are read in a worker thread, bytes
_THREAD_MIN_BYTES = 64 * 1024
#: failures that re-run both legs with another prefill replica and the same decode replica
_PREFILL_SIDE = ("prefill_failed", "transfer_failed", "engine_id_unknown")


class _LegFailed(Exception):
    """A leg failed before the decode leg's first byte; ``reason`` names it for the retry and fallback metrics
    (``prefill_failed``, ``decode_failed``, ``transfer_failed``, ``engine_id_unknown``)."""

    def __init__(self, reason: str, message: str, *, connection: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        #: the leg's replica could not be reached or dropped the connection (rather than answering an error)
        self.connection = connection


class PdLegs:
    """Serves disaggregated plans for ``proxy`` (see the module docstring).

    Args:
        proxy: the proxy whose connection pool, attempt and commit machinery the legs use.
        config: the PD wire settings.
    """

    def __init__(self, proxy: Proxy, config: PdConfig) -> None:
        self.proxy = proxy
        self.cfg = config
        self.metrics = PdMetrics(proxy.telemetry.registry)
        self.metrics.link_bandwidth.set(proxy.router.pd_link.bandwidth_bytes_per_s)
        #: prefill legs still draining after the decode leg committed (SGLang / Mooncake), kept referenced
        self._draining: set[asyncio.Task[None]] = set()
        #: the Mooncake engine ids of prefill replicas, from their bootstrap servers
        self.mooncake = MooncakeIds(
            PooledScrapeClient(lambda: proxy.pool(), 1 << 20).get,
            config.mooncake_query_timeout_s,
            config.mooncake_ids_ttl_s,
            lambda outcome: self.metrics.mooncake_queries.labels(outcome).inc(),
        )
        #: prefill replicas whose unknown Mooncake engine id was logged (once each)
        self._unknown_logged: set[str] = set()
        #: replica index -> its engine's last scraped process start time, epoch seconds (a change = a restart)
        self._started: dict[int, float] = {}

    def count_plan(self, routed: Routed) -> None:
        """Count the plan of a request about to be served (in place or disaggregated)."""
        if routed.plan is not None:
            self.metrics.plans.labels(routed.plan.policy, routed.plan.chosen.kind).inc()

    def protocol_for(self, prefill: Replica) -> str:
        """The wire protocol for a plan whose prefill replica is ``prefill``."""
        if self.cfg.protocol != "auto":
            return self.cfg.protocol
        return "sglang" if prefill.dialect == "sglang" else "vllm"

    # -- entry point -------------------------------------------------------------------------------------------
    async def serve_plan(
        self, routed: Routed, path: str, body: bytes, stream: bool, request_id: str, ids: IdsPrompt | None
    ) -> Response:
        """Serve a PD plan: disaggregated through ``serve``; in place through the proxy's attempts."""
        if not routed.disaggregated:
            self.count_plan(routed)
            rep = self.proxy.router.table.by_index(routed.decision.chosen)
            self.metrics.legs.labels(rep.name if rep else "?", "in_place").inc()
            return await self.proxy._attempts(routed, path, body, stream, request_id, ids)
        return await self.serve(routed, path, body, stream, request_id)

    async def serve(self, routed: Routed, path: str, body: bytes, stream: bool, request_id: str) -> Response:
        """Serve ``routed``'s disaggregated plan; never raises for engine or network failures."""
        assert routed.plan is not None
        plan = routed.plan.chosen
        router = self.proxy.router
        p_rep = router.table.by_index(plan.prefill) if plan.prefill is not None else None
        d_rep = router.table.by_index(plan.decode)
        if p_rep is None or d_rep is None or not p_rep.routable or not d_rep.routable:
            return await self._fallback(
                routed, None, "replica_gone", "a replica of the plan left", path, body, stream, request_id
            )
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            return await self._fallback(
                routed, d_rep, "bad_body", "the body is not a JSON object", path, body, stream, request_id
            )
        self.count_plan(routed)
        deadline = time.monotonic() + self.proxy.cfg.total_timeout_s
        tried: list[int] = []
        tried_decode = [d_rep.index]
        transfer_failed_on: set[int] = (
            set()
        )  # decode replicas a transfer failed on (twice: the decode's fault)
        while True:
            tried.append(p_rep.index)
            try:
                return await self._pair(routed, plan, p_rep, d_rep, path, obj, stream, request_id, deadline)
            except _LegFailed as exc:
                failed = exc
            if failed.reason == "transfer_failed":
                if d_rep.index in transfer_failed_on:
                    failed = _LegFailed("decode_failed", failed.message)
                transfer_failed_on.add(d_rep.index)
            retry = self._retry(routed, plan, failed, tried, tried_decode)
            if retry is None:
                gone = d_rep if failed.reason == "decode_failed" else None
                return await self._fallback(
                    routed,
                    gone,
                    failed.reason,
                    failed.message,
                    path,
                    body,
                    stream,
                    request_id,
                    first=d_rep if gone is None else None,
                )
            self.proxy.telemetry.retries.labels(f"pd_{failed.reason}").inc()
            log.warning(
                f"{failed.reason.replace('_', ' ')}: re-running both legs on another pair",
                extra={"request_id": request_id, "replica": p_rep.name, "error": failed.message},
            )
            plan, p_rep, d_rep = retry
            if d_rep.index not in tried_decode:
                tried_decode.append(d_rep.index)

    def _retry(
        self, routed: Routed, plan: Plan, exc: _LegFailed, tried: list[int], tried_decode: list[int]
    ) -> tuple[Plan, Replica, Replica] | None:
        """The pair to try after ``exc`` (``max_retries`` per side), or None to fall back in place: a failure on the
        prefill side (a failed prefill leg, a transfer that failed with it, an unknown Mooncake engine id) takes
        the next plan's prefill replica with the same decode replica; a failed decode leg the next plan's pair
        with an untried decode replica."""
        limit = self.proxy.cfg.max_retries
        if exc.reason in _PREFILL_SIDE and len(tried) <= limit:
            other = self._other_prefill(routed, plan, tried)
            d_rep = self.proxy.router.table.by_index(plan.decode)
            if other is not None and d_rep is not None:
                return other[0], other[1], d_rep
        if exc.reason in ("decode_failed", "transfer_failed") and len(tried_decode) <= limit:
            return self._other_decode(
                routed, plan, tried_decode, avoid_prefill=exc.reason == "transfer_failed"
            )
        return None

    def _other_decode(
        self, routed: Routed, plan: Plan, tried: list[int], *, avoid_prefill: bool = False
    ) -> tuple[Plan, Replica, Replica] | None:
        """The best remaining disaggregated plan whose decode replica is untried and routable (its prefill
        replica routable; ``plan``'s prefill replica preferred, or last with ``avoid_prefill``: a transfer from it
        failed), with its DP rank pinned, or None.

        Both legs are re-run for the new pair: the SGLang bootstrap room and the Mooncake ``transfer_id`` bind
        the prefill leg to one decode leg, and a vLLM NIXL prefill's blocks may already be freed once a decode
        engine failed (the re-run prefill leg mostly hits the prefix it just cached)."""
        assert routed.plan is not None
        table = self.proxy.router.table
        options = [
            p
            for p in routed.plan.plans
            if p.kind == "disaggregated" and p.prefill is not None and p.decode not in tried
        ]
        # stable: the policy's order within each group
        options.sort(
            key=lambda p: (p.prefill == plan.prefill) if avoid_prefill else (p.prefill != plan.prefill)
        )
        for other in options:
            p_rep, d_rep = table.by_index(other.prefill or 0), table.by_index(other.decode)
            if p_rep is not None and d_rep is not None and p_rep.routable and d_rep.routable:
                chosen = replace(other)
                self.proxy.router.pin_dp_rank(chosen, routed.inp)
                return chosen, p_rep, d_rep
        return None

    def _other_prefill(self, routed: Routed, plan: Plan, tried: list[int]) -> tuple[Plan, Replica] | None:
        """The best remaining disaggregated plan with ``plan``'s decode replica and an untried, routable prefill
        replica (the decode replica's pinned DP rank kept), or None."""
        assert routed.plan is not None
        for other in routed.plan.plans:
            if (
                other.kind != "disaggregated"
                or other.decode != plan.decode
                or other.prefill is None
                or other.prefill in tried
            ):
                continue
            rep = self.proxy.router.table.by_index(other.prefill)
            if rep is not None and rep.routable:
                return replace(other, dp_rank=plan.dp_rank), rep
        return None

    async def _pair(
        self,
        routed: Routed,
        plan: Plan,
        p_rep: Replica,
        d_rep: Replica,
        path: str,
        obj: dict[str, Any],
        stream: bool,
        request_id: str,
        deadline: float,
    ) -> Response:
        """One try of ``plan`` on ``p_rep`` -> ``d_rep``: both legs charged before dispatch, released on every
        path (a committed stream releases D when it ends). Raises _LegFailed before the decode leg's first byte."""
        router = self.proxy.router
        inp = routed.inp
        cached_p = routed.cached_tokens.get(p_rep.index, 0)
        # P's charge: the uncached tokens the policy predicted it computes (else the router's own estimate)
        p_tokens = plan.prefill_tokens if plan.prefill_tokens > 0 else inp.prompt_tokens - cached_p
        headers = {
            "content-type": "application/json",
            "x-request-id": request_id,
            "accept": "application/json",
        }
        d_headers = dict(headers, accept="text/event-stream" if stream else "application/json")
        if plan.dp_rank is not None:
            d_headers["x-data-parallel-rank"] = str(plan.dp_rank)
        legs = _Legs(
            self,
            routed,
            plan,
            p_rep,
            d_rep,
            path,
            obj,
            stream,
            request_id,
            headers,
            d_headers,
            deadline,
            cached_p,
        )
        with (
            _Hold(router, None, p_rep, p_tokens, inp.copies) as hp,
            _Hold(router, None, d_rep, 0, inp.copies) as hd,
        ):
            router.note_handoff(plan)
            router.record_prediction(p_rep, inp.keys)
            router.record_prediction(d_rep, inp.keys)  # the handed-over KV lands in D's cache too
            protocol = self.protocol_for(p_rep)
            if protocol == "vllm":
                return await legs.sequential(hp, hd)
            return await legs.concurrent(hp, hd, protocol)

    async def _fallback(
        self,
        routed: Routed,
        exclude: Replica | None,
        reason: str,
        message: str,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        *,
        first: Replica | None = None,
    ) -> Response:
        """Serve in place through the proxy's attempts (``first`` tried first, ``exclude`` never), counted; only
        on replicas that serve a request alone (``router.core.routing.serves_alone``), else 503."""
        ranking = [i for i in routed.decision.ranking if exclude is None or i != exclude.index]
        if first is not None:
            ranking = [first.index, *[i for i in ranking if i != first.index]]
        table = self.proxy.router.table
        ranking = [i for i in ranking if (rep := table.by_index(i)) is not None and serves_alone(rep)]
        if not ranking:
            log.warning(
                "disaggregated plan failed, no replica serves in place",
                extra={"request_id": request_id, "reason": reason, "error": message},
            )
            return error_response(
                503,
                f"disaggregated plan failed ({message}) and no replica can serve in place",
                "no_routable_replica",
                headers={"x-request-id": request_id},
            )
        self.metrics.fallbacks.labels(reason).inc()
        if first is not None and first.index == ranking[0]:
            self.metrics.legs.labels(first.name, "in_place").inc()
        log.warning(
            "disaggregated plan served in place",
            extra={"request_id": request_id, "reason": reason, "error": message},
        )
        in_place = Routed(
            inp=routed.inp,
            decision=routed.decision,
            candidates=routed.candidates,
            cached_tokens=routed.cached_tokens,
            decision_s=routed.decision_s,
            extra=routed.extra,
        )
        in_place.decision = type(routed.decision)(
            chosen=ranking[0],
            ranking=ranking,
            scores=routed.decision.scores,
            policy=routed.decision.policy,
            branch="pd_fallback",
        )
        return await self.proxy._attempts(in_place, path, body, stream, request_id)

    def observe_handoff(self, routed: Routed, plan: Plan, handoff_s: float) -> None:
        """Feed the link estimator one sequential-relay handoff: ``handoff_s`` seconds from the prefill answer
        to the decode leg's first byte, minus the plan's predicted ``decode_first`` (D's wait and first step),
        for ``plan.handoff_tokens`` x the prefill replica's ``bytes_per_token`` bytes; updates the gauge."""
        if plan.prefill is None or plan.handoff_tokens <= 0:
            return
        cand = next((c for c in routed.candidates if c.index == plan.prefill), None)
        if cand is None:
            return
        router = self.proxy.router
        if router.link_from_engines:  # the engines' own transfer times are exact: the relay's are not needed
            self.metrics.link_samples.labels("superseded").inc()
            return
        nbytes = plan.handoff_tokens * cand.profile.bytes_per_token
        accepted = router.observe_handoff(nbytes, handoff_s - plan.terms.get("decode_first", 0.0))
        self.metrics.link_samples.labels("accepted" if accepted else "rejected").inc()
        self.metrics.link_bandwidth.set(router.pd_link.bandwidth_bytes_per_s)

    def observe_engine_start(self, rep: Replica, snap: EngineSnapshot) -> None:
        """A scrape of ``rep``: an engine whose process start time changed restarted, and a restarted vLLM engine
        has a new Mooncake engine id: its discovered ids are asked again at its next use."""
        started = snap.process_start_time_s
        if started is None:
            return
        if self._started.setdefault(rep.index, started) != started:
            self._started[rep.index] = started
            self.mooncake.forget(rep.index)

    def observe_engine_transfers(self, rep: Replica, snap: EngineSnapshot) -> None:
        """A scrape of ``rep`` (any role, any protocol): the KV transfers it reports (vLLM's NIXL histograms on
        the pulling engine) feed the link estimator through ``Router.observe_engine_transfers``; an engine
        exporting none reports zero transfers (no sample ever comes of it)."""
        size, took = snap.kv_transfer_bytes, snap.kv_transfer_time
        # not exported (yet): vLLM shows the series only after its first transfer, so "none" is a zero baseline
        totals = (
            TransferTotals(0.0, 0.0, 0.0)
            if size is None or took is None
            else TransferTotals(size.sum, took.sum, took.count)
        )
        router = self.proxy.router
        outcome = router.observe_engine_transfers(rep.index, totals)
        if outcome is None:
            return
        self.metrics.link_samples.labels("engine_accepted" if outcome else "engine_rejected").inc()
        self.metrics.link_bandwidth.set(router.pd_link.bandwidth_bytes_per_s)

    def engine_id_unknown(self, rep: Replica, address: str) -> None:
        """Count (and log once per replica) a Mooncake plan whose prefill engine id is unknown."""
        self.metrics.mooncake_unknown.labels(rep.name).inc()
        if rep.name not in self._unknown_logged:
            self._unknown_logged.add(rep.name)
            log.warning(
                "Mooncake engine id unknown: its bootstrap server listed none; no Mooncake parameters sent "
                "(logged once per replica)",
                extra={"replica": rep.name, "url": f"http://{address}/query"},
            )

    def keep_draining(self, task: asyncio.Task[None]) -> None:
        """Keep a prefill leg that still drains after the decode leg committed referenced until it ends."""
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)


class _Legs:
    """One request's two legs (state shared by the protocol runners)."""

    def __init__(
        self,
        owner: PdLegs,
        routed: Routed,
        plan: Plan,
        p_rep: Replica,
        d_rep: Replica,
        path: str,
        obj: dict[str, Any],
        stream: bool,
        request_id: str,
        headers: dict[str, str],
        d_headers: dict[str, str],
        deadline: float,
        cached_p: int,
    ) -> None:
        self.owner, self.proxy, self.metrics, self.plan = owner, owner.proxy, owner.metrics, plan
        self.routed, self.p_rep, self.d_rep, self.path, self.obj = routed, p_rep, d_rep, path, obj
        self.stream, self.request_id, self.headers, self.d_headers = stream, request_id, headers, d_headers
        self.deadline, self.cached_p = deadline, cached_p
        self.t0 = time.monotonic()
        #: the router asked the decode engine for stream usage the client did not ask for (removed again)
        self.strip_usage = False

    # -- protocols ---------------------------------------------------------------------------------------------
    async def sequential(self, hp: _Hold, hd: _Hold) -> Response:
        """vLLM NIXL relay: prefill leg, then the decode leg with the returned ``kv_transfer_params`` (the bytes
        the prefill engine sent, relayed as they are)."""
        answer = await self._prefill(hp, pd_vllm.nixl_prefill_body(self.obj))
        if answer.problem is not None:
            raise _LegFailed(
                "prefill_failed", f"prefill leg on {self.p_rep.name}: its answer {answer.problem}"
            )
        params = answer.params
        if params is None:
            log.warning(
                "prefill answer without kv_transfer_params: the decode engine recomputes",
                extra={"request_id": self.request_id, "replica": self.p_rep.name},
            )
        t_handoff = time.monotonic()
        resp, first = await self._open_decode(pd_vllm.decode_body(self.obj, params))
        handoff_s = time.monotonic() - t_handoff
        self.metrics.handoff_seconds.observe(handoff_s)
        if params is not None:  # without parameters the decode engine recomputes: no handoff to learn from
            self.owner.observe_handoff(self.routed, self.plan, handoff_s)
        return await self._commit(hd, resp, first)

    async def concurrent(self, hp: _Hold, hd: _Hold, protocol: str) -> Response:
        """SGLang bootstrap / Mooncake push: both legs at once; the decode leg's answer goes to the client."""
        host = urlsplit(self.p_rep.url).hostname or ""
        port = self.p_rep.bootstrap_port or self.owner.cfg.default_bootstrap_port
        if protocol == "sglang":
            p_body, d_body, _ = pd_sglang.bodies(
                self.obj,
                host,
                port,
                prefill_dp_rank=self._pin_prefill_rank(),
                decode_dp_rank=self.plan.dp_rank,
            )
        else:
            p_body, d_body = await self._mooncake_bodies(host, port)
        prefill = asyncio.ensure_future(self._drain_prefill(hp, p_body))
        decode = asyncio.ensure_future(self._open_decode(d_body))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            failed = prefill.exception() if prefill.done() else None
            if failed is not None and not decode.done():
                raise failed  # the decode leg would wait for a room nobody fills
            try:
                resp, first = await decode
            except _LegFailed as exc:
                raise self._transfer_failed(exc, prefill) from None
        except BaseException as exc:
            for task in (prefill, decode):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(prefill, decode, return_exceptions=True)
            if protocol == "mooncake" and isinstance(exc, _LegFailed):
                self.owner.mooncake.forget(self.p_rep.index)  # restarted (a new id) or the id was rejected
            raise
        if not prefill.done():
            hp.hand_over()  # the draining prefill leg releases P when it ends
            self.owner.keep_draining(prefill)
        elif prefill.exception() is not None:
            log.warning(
                "prefill leg failed after the decode leg answered",
                extra={
                    "request_id": self.request_id,
                    "replica": self.p_rep.name,
                    "error": str(prefill.exception()),
                },
            )
        return await self._commit(hd, resp, first)

    def _transfer_failed(self, exc: _LegFailed, prefill: asyncio.Future[None]) -> _LegFailed:
        """A decode leg that failed before its first byte. The decode engine answered an error while its prefill
        leg had not answered (failed, or still waiting: a prefill pod that died without closing its connections
        hangs): the transfer failed (``transfer_failed``: re-run with fresh bootstrap fields on another prefill
        replica). The decode replica unreachable, or its prefill leg answered (the KV was sent): the decode
        replica's own failure (``exc``)."""
        prefill_answered = prefill.done() and not prefill.cancelled() and prefill.exception() is None
        if exc.reason != "decode_failed" or exc.connection or prefill_answered:
            return exc
        return _LegFailed(
            "transfer_failed", f"{exc.message} (its prefill leg on {self.p_rep.name} had not answered)"
        )

    async def _mooncake_bodies(self, host: str, port: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The Mooncake legs, naming the prefill engine by an id its bootstrap server lists (the prefill leg pinned
        to that id's rank when the server lists several). Raises _LegFailed(``engine_id_unknown``) when the id
        cannot be learned: no Mooncake parameters are sent then, never a made-up id."""
        address = f"{host if ':' not in host else f'[{host}]'}:{port}"
        ids = await self.owner.mooncake.ids(self.p_rep.index, address)
        if not ids:
            self.owner.engine_id_unknown(self.p_rep, address)
            raise _LegFailed(
                "engine_id_unknown",
                f"the Mooncake engine id of {self.p_rep.name} is unknown (GET http://{address}/query listed "
                "none): no Mooncake parameters sent",
            )
        keys = self.routed.inp.keys
        rank, engine_id = pd_mooncake.pick_engine(ids, keys[0] if keys else 0)
        if rank is not None:
            self.headers = dict(self.headers, **{"x-data-parallel-rank": str(rank)})
        return pd_vllm.mooncake_bodies(self.obj, pd_vllm.new_transfer_id(), engine_id, f"http://{address}")

    def _pin_prefill_rank(self) -> int | None:
        """A DP rank for the prefill leg of a concurrent protocol when the prefill replica has several (by the
        prompt's first block, like the decode rank), sent as ``X-data-parallel-rank``; None otherwise."""
        if self.p_rep.dp_size <= 1:
            return None
        keys = self.routed.inp.keys
        rank = (keys[0] if keys else 0) % self.p_rep.dp_size
        self.headers = dict(self.headers, **{"x-data-parallel-rank": str(rank)})
        return rank

    # -- legs --------------------------------------------------------------------------------------------------
    async def _prefill(self, hp: _Hold, body: dict[str, Any]) -> pd_vllm.PrefillAnswer:
        """Send the prefill leg and read its whole answer, once (``pd_vllm.read_prefill_answer``; in a worker
        thread from ``_THREAD_MIN_BYTES`` on); releases ``hp``. Raises _LegFailed."""
        content, leg_s = await self._prefill_bytes(hp, body)
        limit = self.owner.cfg.max_transfer_params_bytes
        if len(content) >= _THREAD_MIN_BYTES:
            answer = await asyncio.to_thread(pd_vllm.read_prefill_answer, content, limit)
        else:
            answer = pd_vllm.read_prefill_answer(content, limit)
        self._observe_prefill(answer.usage, leg_s)
        return answer

    async def _prefill_bytes(self, hp: _Hold, body: dict[str, Any]) -> tuple[bytes, float]:
        """Send the prefill leg and read its whole answer (bounded); releases ``hp``. Returns the answer and the
        leg's seconds. Raises _LegFailed (also on >= 400)."""
        self.metrics.legs.labels(self.p_rep.name, "prefill").inc()
        t0 = time.monotonic()
        try:
            resp, first = await self.proxy._open(
                self.p_rep, self.path, orjson.dumps(body), self.headers, self.deadline
            )
        except _AttemptFailed as exc:
            self._connection_failed(self.p_rep, exc)
            raise _LegFailed("prefill_failed", f"prefill leg on {self.p_rep.name}: {exc.message}") from None
        finally:
            hp.first_byte()
        content = await self._read(resp, first, self.p_rep)
        hp.release()
        leg_s = time.monotonic() - t0
        self.metrics.leg_seconds.labels("prefill").observe(leg_s)
        if resp.status >= 400:
            raise _LegFailed(
                "prefill_failed",
                f"prefill leg on {self.p_rep.name} answered {resp.status}: "
                f"{content[:300].decode(errors='replace')}",
            )
        return content, leg_s

    def _observe_prefill(self, usage: dict[str, Any] | None, leg_s: float) -> None:
        """Calibrate the PD policy with this prefill leg: the prefill replica's observation (prompt tokens;
        cached tokens from the leg's ``usage`` when reported, else the router's estimate; ``leg_s`` seconds of
        the prefill leg as its TTFT)."""
        reported = _cached_tokens(usage)
        router = self.proxy.router
        q = float(self.plan.terms.get("Q_p", 0.0) or 0.0)
        router.observe_pd(
            Observation(
                index=self.p_rep.index,
                prompt_tokens=self.routed.inp.prompt_tokens,
                cached_tokens=reported if reported is not None else self.cached_p,
                queue_wait_s=q,
                ttft_s=leg_s,
                now=router.clock(),
            )
        )

    async def _drain_prefill(self, hp: _Hold, body: dict[str, Any]) -> None:
        """A concurrent prefill leg: send it, drain and discard its answer; releases ``hp``. Raises _LegFailed."""
        try:
            await self._prefill(
                hp, body
            )  # read for its usage, else discarded (SGLang / Mooncake: nothing to relay)
        finally:
            hp.release()

    async def _read(self, resp: EngineResponse, first: bytes, rep: Replica) -> bytes:
        """The whole (bounded) body of a leg's answer; the connection goes back to the pool. Raises _LegFailed."""
        cfg = self.proxy.cfg
        limit = self.owner.cfg.max_prefill_answer_bytes
        try:
            content = await resp.read_body(
                first, max_bytes=limit, idle_timeout_s=cfg.body_idle_timeout_s, deadline=self.deadline
            )
        except EngineResponseTooLarge:
            resp.close()
            raise _LegFailed(
                "prefill_failed",
                f"prefill leg on {rep.name}: answer over {limit} bytes (pd_max_prefill_answer_bytes)",
            ) from None
        except (TimeoutError, EngineError) as exc:
            resp.close()
            raise _LegFailed(
                "prefill_failed", f"prefill leg on {rep.name}: answer unreadable ({type(exc).__name__})"
            ) from None
        except BaseException:
            resp.close()
            raise
        resp.release()
        return content

    async def _open_decode(self, body: dict[str, Any]) -> tuple[EngineResponse, bytes]:
        """Send the decode leg and wait for its first byte. Raises _LegFailed."""
        self.metrics.legs.labels(self.d_rep.name, "decode").inc()
        if self.stream and self.proxy.cfg.stream_usage:
            body, self.strip_usage = pd_vllm.with_stream_usage(body)
        payload = orjson.dumps(body)  # serialized once: relayed parameters are inserted as the engine's bytes
        t0 = time.monotonic()
        try:
            resp, first = await self.proxy._open(
                self.d_rep, self.path, payload, self.d_headers, self.deadline
            )
        except _AttemptFailed as exc:
            self._connection_failed(self.d_rep, exc)
            raise _LegFailed(
                "decode_failed", f"decode leg on {self.d_rep.name}: {exc.message}", connection=exc.connection
            ) from None
        self.metrics.leg_seconds.labels("decode").observe(time.monotonic() - t0)
        return resp, first

    async def _commit(self, hd: _Hold, resp: EngineResponse, first: bytes) -> Response:
        """The client's answer from the decode leg (the proxy's commit path; it takes over ``hd`` for streams)."""
        hd.first_byte()
        ttft = time.monotonic() - self.t0
        out = await self.proxy._commit(
            hd,
            self.routed,
            resp,
            first,
            ttft,
            self.deadline,
            self.stream,
            self.request_id,
            self.cached_p,
            self.strip_usage,
        )
        out.headers["x-kvroute-prefill-replica"] = self.p_rep.name
        out.headers["x-kvroute-plan"] = "disaggregated"
        return out

    def _connection_failed(self, rep: Replica, exc: _AttemptFailed) -> None:
        """Log a failed leg; a connection failure is the replica's passive health signal."""
        log.warning(
            "PD leg failed",
            extra={
                "request_id": self.request_id,
                "replica": rep.name,
                "reason": exc.reason,
                "error": exc.message,
            },
        )
        if exc.connection:
            self.proxy.on_connection_failure(rep, exc.message)
