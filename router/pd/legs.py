"""The two-leg orchestrator: serves a disaggregated plan (prefill on P, decode on D).

The serving pipeline's dispatch (``router.serve.dispatch``) calls ``PdLegs.serve`` for a ``Routed`` whose plan is
disaggregated (``Routed.disaggregated``); in-place plans go through the in-place attempts
(``router.engine.proxy``), which a failed plan falls back to as well. Per request:

1. both legs are charged BEFORE anything is sent (``_Hold`` on P: the request and its uncached prompt tokens; on
   D: the request). Charging the decode leg only when it returns is the bug class that sends every request to
   prefill #0 (sglang #27547, smg #1714);
2. the legs run by protocol (``pd_protocol``; ``auto``: by the prefill replica's dialect), one protocol runner per
   wire (``router.pd.runners``):
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
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import orjson
from starlette.responses import Response

from membership.engine_metrics import EngineSnapshot
from membership.replicas import Replica
from policies.pd_base import Plan
from policies.pd_link import TransferTotals
from router.core.routing import Routed, Router, serves_alone
from router.engine.attempt import EngineEdge
from router.engine.hold import Hold
from router.engine.proxy import Proxy
from router.engine.scrape import PooledScrapeClient
from router.errors import error_response
from router.pd import vllm as pd_vllm
from router.pd.leg import LegFailed, PdConfig, TwoLegs
from router.pd.mooncake import MooncakeIds
from router.pd.runners import MooncakePush, NixlRelay, ProtocolRunner, SglangBootstrap
from router.telemetry import PdMetrics, Telemetry, current_trace_id
from router.tracing import TRACE_HEADERS

log = logging.getLogger("kvroute.pd")


@dataclass(slots=True)
class Handoff:
    """A disaggregated plan whose prefill side the router ran: the decode leg for another to send.

    Attributes:
        prefill: the prefill replica (its leg done, or draining for a concurrent protocol).
        decode: the decode replica to send ``body`` to.
        body: the decode leg's body (the prefill's ``kv_transfer_params``, or the bootstrap fields), bytes.
        headers: request headers the decode leg needs (``x-data-parallel-rank`` when a rank is pinned; with
            tracing on, the ``traceparent`` naming the decode leg's span).
        hold: the decode replica's hold, handed over: the caller releases it when the response ends.
        strip_usage: stream usage was asked for on the client's behalf (remove it from what the client gets).
        cached_p: prompt tokens the router expected the prefill replica to reuse, tokens.
        decode_leg: the decode leg waiting on ``decode`` (``Router.note_handoff``'s handle): whoever sends it calls
            ``Router.decode_leg_started(decode.index, decode_leg)`` at its first byte or when it ends without one.
    """

    prefill: Replica
    decode: Replica
    body: bytes
    headers: dict[str, str]
    hold: Hold
    strip_usage: bool
    cached_p: int
    decode_leg: int | None = None


#: failures that re-run both legs with another prefill replica and the same decode replica
_PREFILL_SIDE = ("prefill_failed", "transfer_failed", "engine_id_unknown")


class PdLegs:
    """Serves disaggregated plans (see the module docstring).

    Args:
        router: decisions, accounting, the PD policy's calibration and the P->D link.
        edge: the engine edge (pool, open / commit of a leg).
        in_place: the in-place attempts a failed plan falls back to.
        telemetry: the router's metrics (retries; the PD metrics are registered on its registry).
        config: the PD wire settings.
    """

    def __init__(
        self, router: Router, edge: EngineEdge, in_place: Proxy, telemetry: Telemetry, config: PdConfig
    ) -> None:
        self.router = router
        self.edge = edge
        self.in_place = in_place
        self.telemetry = telemetry
        self.cfg = config
        self.metrics = PdMetrics(telemetry.registry)
        self.metrics.link_bandwidth.set(router.pd_link.bandwidth_bytes_per_s)
        #: prefill legs still draining after the decode leg committed (SGLang / Mooncake), kept referenced
        self._draining: set[asyncio.Task[None]] = set()
        #: the Mooncake engine ids of prefill replicas, from their bootstrap servers
        self.mooncake = MooncakeIds(
            PooledScrapeClient(lambda: edge.pool(), 1 << 20).get,
            config.mooncake_query_timeout_s,
            config.mooncake_ids_ttl_s,
            lambda outcome: self.metrics.mooncake_queries.labels(outcome).inc(),
        )
        #: one runner per wire protocol
        self.runners: dict[str, ProtocolRunner] = {
            "vllm": NixlRelay(),
            "mooncake": MooncakePush(self.mooncake, self.metrics, config.default_bootstrap_port),
            "sglang": SglangBootstrap(config.default_bootstrap_port),
        }
        #: replica index -> its engine's last scraped process start time, epoch seconds (a change = a restart)
        self._started: dict[int, float] = {}

    def count_plan(self, routed: Routed) -> None:
        """Count the plan of a request about to be served (in place or disaggregated)."""
        if routed.plan is not None:
            self.metrics.plans.labels(routed.plan.policy, routed.plan.chosen.kind).inc()

    def runner_for(self, prefill: Replica) -> ProtocolRunner:
        """The protocol runner for a plan whose prefill replica is ``prefill`` (``pd_protocol``; ``auto``: SGLang
        for an SGLang prefill replica, else the vLLM NIXL relay)."""
        protocol = self.cfg.protocol
        if protocol == "auto":
            protocol = "sglang" if prefill.dialect == "sglang" else "vllm"
        return self.runners[protocol]

    def count_in_place(self, routed: Routed) -> None:
        """Count a PD fleet's in-place plan about to be served (by the planned replica)."""
        self.count_plan(routed)
        rep = self.router.table.by_index(routed.decision.chosen)
        self.metrics.legs.labels(rep.name if rep else "?", "in_place").inc()

    # -- entry point -------------------------------------------------------------------------------------------
    async def serve(self, routed: Routed, path: str, body: bytes, stream: bool, request_id: str) -> Response:
        """Serve ``routed``'s disaggregated plan; never raises for engine or network failures."""
        assert routed.plan is not None
        plan = routed.plan.chosen
        router = self.router
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
        deadline = time.monotonic() + self.edge.cfg.total_timeout_s
        tried: list[int] = []
        tried_decode = [d_rep.index]
        transfer_failed_on: set[int] = (
            set()
        )  # decode replicas a transfer failed on (twice: the decode's fault)
        while True:
            tried.append(p_rep.index)
            try:
                legs = self._two_legs(routed, plan, p_rep, d_rep, path, obj, stream, request_id, deadline)
                return await self._pair(legs)
            except LegFailed as exc:
                failed = exc
            if failed.reason == "transfer_failed":
                if d_rep.index in transfer_failed_on:
                    failed = LegFailed("decode_failed", failed.message)
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
            self.telemetry.retries.labels(f"pd_{failed.reason}").inc()
            log.warning(
                f"{failed.reason.replace('_', ' ')}: re-running both legs on another pair",
                extra={"request_id": request_id, "replica": p_rep.name, "error": failed.message},
            )
            plan, p_rep, d_rep = retry
            if d_rep.index not in tried_decode:
                tried_decode.append(d_rep.index)

    def _retry(
        self, routed: Routed, plan: Plan, exc: LegFailed, tried: list[int], tried_decode: list[int]
    ) -> tuple[Plan, Replica, Replica] | None:
        """The pair to try after ``exc`` (``max_retries`` per side), or None to fall back in place: a failure on the
        prefill side (a failed prefill leg, a transfer that failed with it, an unknown Mooncake engine id) takes
        the next plan's prefill replica with the same decode replica; a failed decode leg the next plan's pair
        with an untried decode replica."""
        limit = self.edge.cfg.max_retries
        if exc.reason in _PREFILL_SIDE and len(tried) <= limit:
            other = self._other_prefill(routed, plan, tried)
            d_rep = self.router.table.by_index(plan.decode)
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
        table = self.router.table
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
                self.router.pin_dp_rank(chosen, routed.inp)
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
            rep = self.router.table.by_index(other.prefill)
            if rep is not None and rep.routable:
                return replace(other, dp_rank=plan.dp_rank), rep
        return None

    async def _pair(self, legs: TwoLegs) -> Response:
        """One try of ``legs.plan`` on its prefill -> decode replicas: both legs charged before dispatch (with the
        request's LoRA adapter, as an in-place attempt: each engine loads it), released on every path (a committed
        stream releases D when it ends). Raises LegFailed before the decode leg's first byte."""
        router, inp, plan = self.router, legs.routed.inp, legs.plan
        p_rep, d_rep = legs.p_rep, legs.d_rep
        # P's charge: the uncached tokens the policy predicted it computes (else the router's own estimate)
        p_tokens = plan.prefill_tokens if plan.prefill_tokens > 0 else inp.prompt_tokens - legs.cached_p
        with (
            Hold(router, None, p_rep, p_tokens, inp.copies, inp.lora) as hp,
            Hold(router, None, d_rep, 0, inp.copies, inp.lora) as hd,
        ):
            hp.span, hd.span = legs.p_span, legs.d_span  # each leg's span ends when its hold is released
            leg = router.note_handoff(plan, decode_tokens=inp.prompt_tokens)
            router.record_prediction(p_rep, inp.keys)
            router.record_prediction(d_rep, inp.keys)  # the handed-over KV lands in D's cache too
            try:
                return await self.runner_for(p_rep).serve(legs, hp, hd)
            finally:  # the decode leg's first byte committed the answer, or this try failed
                router.decode_leg_started(d_rep.index, leg)

    def _two_legs(
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
    ) -> TwoLegs:
        """The state of one try: both legs carry the request's id; the decode leg the client's ``accept`` and the
        plan's pinned DP rank."""
        headers = {
            "content-type": "application/json",
            "x-request-id": request_id,
            "accept": "application/json",
        }
        d_headers = dict(headers, accept="text/event-stream" if stream else "application/json")
        if plan.dp_rank is not None:
            d_headers["x-data-parallel-rank"] = str(plan.dp_rank)
        legs = TwoLegs(
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
            routed.cached_tokens.get(p_rep.index, 0),
        )
        trace = routed.inp.trace
        if trace is not None:  # one span per leg; each engine's traceparent names its leg's span
            protocol = self.runner_for(p_rep).name
            legs.p_span = trace.child(
                "kvroute.pd.prefill", _leg_attributes(p_rep, "prefill", protocol), client=True
            )
            legs.d_span = trace.child(
                "kvroute.pd.decode", _leg_attributes(d_rep, "decode", protocol), client=True
            )
            legs.headers = {**headers, **trace.headers(legs.p_span)}
            legs.d_headers = {**d_headers, **trace.headers(legs.d_span)}
        return legs

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
        ranking = self.fall_back(routed, exclude, reason, message, request_id, first=first)
        if not ranking:
            return error_response(
                503,
                f"disaggregated plan failed ({message}) and no replica can serve in place",
                "no_routable_replica",
                headers={"x-request-id": request_id},
                trace_id=current_trace_id(),
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
        return await self.in_place.attempts(in_place, path, body, stream, request_id)

    def fall_back(
        self,
        routed: Routed,
        exclude: Replica | None,
        reason: str,
        message: str,
        request_id: str,
        *,
        first: Replica | None = None,
    ) -> list[int]:
        """The ranking a failed disaggregated plan is served in place on (``first`` first, ``exclude`` never; only
        replicas that serve a request alone, ``router.core.routing.serves_alone``), counted and logged; empty: no
        replica can (the caller answers 503)."""
        ranking = [i for i in routed.decision.ranking if exclude is None or i != exclude.index]
        if first is not None:
            ranking = [first.index, *[i for i in ranking if i != first.index]]
        table = self.router.table
        ranking = [i for i in ranking if (rep := table.by_index(i)) is not None and serves_alone(rep)]
        if not ranking:
            log.warning(
                "disaggregated plan failed, no replica serves in place",
                extra={"request_id": request_id, "reason": reason, "error": message},
            )
            return ranking
        self.metrics.fallbacks.labels(reason).inc()
        if first is not None and first.index == ranking[0]:
            self.metrics.legs.labels(first.name, "in_place").inc()
        log.warning(
            "disaggregated plan served in place",
            extra={"request_id": request_id, "reason": reason, "error": message},
        )
        return ranking

    # -- the prefill side only: the decode request handed to someone else (the endpoint picker's gateway) -------
    async def handoff(
        self, routed: Routed, path: str, body: bytes, stream: bool, request_id: str
    ) -> Handoff | list[int]:
        """Run ``routed``'s disaggregated plan up to its decode leg and return that leg (``Handoff``: the decode
        replica, the body and headers it needs, its hold) for another to send; never raises for engine or network
        failures. A failed prefill side is retried on the plan's next prefill replica with the same decode
        replica (``max_retries``), then falls back: the in-place ranking is returned (``fall_back``, counted;
        empty: no replica can serve in place)."""
        assert routed.plan is not None
        plan = routed.plan.chosen
        table = self.router.table
        p_rep = table.by_index(plan.prefill) if plan.prefill is not None else None
        d_rep = table.by_index(plan.decode)
        if p_rep is None or d_rep is None or not p_rep.routable or not d_rep.routable:
            return self.fall_back(routed, None, "replica_gone", "a replica of the plan left", request_id)
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            return self.fall_back(routed, d_rep, "bad_body", "the body is not a JSON object", request_id)
        self.count_plan(routed)
        deadline = time.monotonic() + self.edge.cfg.total_timeout_s
        tried: list[int] = []
        while True:
            tried.append(p_rep.index)
            try:
                legs = self._two_legs(routed, plan, p_rep, d_rep, path, obj, stream, request_id, deadline)
                return await self._handoff_pair(legs)
            except LegFailed as exc:
                failed = exc
            other = (
                self._other_prefill(routed, plan, tried) if len(tried) <= self.edge.cfg.max_retries else None
            )
            if other is None:
                return self.fall_back(routed, None, failed.reason, failed.message, request_id, first=d_rep)
            self.telemetry.retries.labels(f"pd_{failed.reason}").inc()
            log.warning(
                f"{failed.reason.replace('_', ' ')}: running the prefill leg on another replica",
                extra={"request_id": request_id, "replica": p_rep.name, "error": failed.message},
            )
            plan, p_rep = other

    async def _handoff_pair(self, legs: TwoLegs) -> Handoff:
        """One try of the prefill side of ``legs.plan`` on its prefill replica for its decode replica: both legs
        charged now (D's hold is handed to the caller with the decode leg, and so is the decode leg's wait on D:
        ``Handoff.decode_leg``), the prefill leg run by the plan's protocol runner. Raises LegFailed (nothing held
        or waiting then)."""
        router, inp, plan = self.router, legs.routed.inp, legs.plan
        p_rep, d_rep, stream = legs.p_rep, legs.d_rep, legs.stream
        p_tokens = plan.prefill_tokens if plan.prefill_tokens > 0 else inp.prompt_tokens - legs.cached_p
        with Hold(router, None, p_rep, p_tokens, inp.copies, inp.lora) as hp:
            hd = Hold(router, None, d_rep, 0, inp.copies, inp.lora).__enter__()
            hp.span, hd.span = (
                legs.p_span,
                legs.d_span,
            )  # the decode leg's span ends with the gateway's answer
            leg: int | None = None
            try:
                # the gateway sends the decode leg: it waits on D until the picker sees its first byte
                leg = router.note_handoff(plan, decode_tokens=inp.prompt_tokens)
                router.record_prediction(p_rep, inp.keys)
                router.record_prediction(d_rep, inp.keys)  # the handed-over KV lands in D's cache too
                d_body = await self.runner_for(p_rep).handoff(legs, hp)
                if stream and self.edge.cfg.stream_usage:
                    d_body, legs.strip_usage = pd_vllm.with_stream_usage(d_body)
                payload = orjson.dumps(d_body)
            except BaseException:
                router.decode_leg_started(d_rep.index, leg)
                hd.release()
                raise
        self.metrics.legs.labels(d_rep.name, "decode").inc()  # sent by the gateway
        headers = {
            k: v for k, v in legs.d_headers.items() if k == "x-data-parallel-rank" or k in TRACE_HEADERS
        }
        return Handoff(p_rep, d_rep, payload, headers, hd.hand_over(), legs.strip_usage, legs.cached_p, leg)

    def observe_handoff(self, routed: Routed, plan: Plan, handoff_s: float) -> None:
        """Feed the link estimator one sequential-relay handoff: ``handoff_s`` seconds from the prefill answer
        to the decode leg's first byte, minus the plan's predicted ``decode_first`` (D's wait and first step),
        for ``plan.handoff_tokens`` x the prefill replica's ``bytes_per_token`` bytes; updates the gauge."""
        if plan.prefill is None or plan.handoff_tokens <= 0:
            return
        cand = next((c for c in routed.candidates if c.index == plan.prefill), None)
        if cand is None:
            return
        router = self.router
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
        router = self.router
        outcome = router.observe_engine_transfers(rep.index, totals)
        if outcome is None:
            return
        self.metrics.link_samples.labels("engine_accepted" if outcome else "engine_rejected").inc()
        self.metrics.link_bandwidth.set(router.pd_link.bandwidth_bytes_per_s)

    def keep_draining(self, task: asyncio.Task[None]) -> None:
        """Keep a prefill leg that still drains after the decode leg committed referenced until it ends."""
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)


def _leg_attributes(rep: Replica, leg: str, protocol: str) -> dict[str, Any]:
    """A PD leg span's attributes: the replica, the leg (prefill, decode), the wire protocol."""
    return {
        "kvroute.replica": rep.name,
        "server.address": rep.url,
        "kvroute.pd.leg": leg,
        "kvroute.pd.protocol": protocol,
    }
