"""One try of a disaggregated plan: the wire settings, the PD metrics, the failure of a leg, and the two legs'
operations (send the prefill leg and read its answer once, drain a concurrent prefill leg, open the decode leg,
commit its answer through the engine edge) that the protocol runners (``router.pd.runners``) compose.

Units: seconds, tokens, bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from starlette.responses import Response

from membership.replicas import Replica
from policies.base import Observation
from policies.pd_base import Plan
from router.core.large_parse import scan_in_thread
from router.core.routing import Routed, Router
from router.engine.attempt import EngineEdge
from router.engine.client import EngineError, EngineResponse, EngineResponseTooLarge
from router.engine.feedback import cached_tokens
from router.engine.hold import AttemptFailed, Hold
from router.pd import vllm as pd_vllm
from router.telemetry import PdMetrics
from router.tracing import attempt_failed, first_byte

log = logging.getLogger("kvroute.pd")


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


#: prefill answers at least this large are read in a worker thread, bytes
THREAD_MIN_BYTES = 64 * 1024


class LegFailed(Exception):
    """A leg failed before the decode leg's first byte; ``reason`` names it for the retry and fallback metrics
    (``prefill_failed``, ``decode_failed``, ``transfer_failed``, ``engine_id_unknown``)."""

    def __init__(self, reason: str, message: str, *, connection: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        #: the leg's replica could not be reached or dropped the connection (rather than answering an error)
        self.connection = connection


class LegsOwner(Protocol):
    """What one try's legs need from the orchestrator (``router.pd.legs.PdLegs``)."""

    edge: EngineEdge
    router: Router
    metrics: PdMetrics
    cfg: PdConfig

    def observe_handoff(self, routed: Routed, plan: Plan, handoff_s: float) -> None:
        """Feed the link estimator one sequential-relay handoff."""
        ...

    def keep_draining(self, task: asyncio.Task[None]) -> None:
        """Keep a prefill leg that still drains after the decode leg committed referenced until it ends."""
        ...


class TwoLegs:
    """One try of a disaggregated plan: its two legs' state and operations, shared by the protocol runners
    (``router.pd.runners``)."""

    def __init__(
        self,
        owner: LegsOwner,
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
        self.owner, self.edge, self.metrics, self.plan = owner, owner.edge, owner.metrics, plan
        self.routed, self.p_rep, self.d_rep, self.path, self.obj = routed, p_rep, d_rep, path, obj
        self.stream, self.request_id, self.headers, self.d_headers = stream, request_id, headers, d_headers
        self.deadline, self.cached_p = deadline, cached_p
        self.t0 = time.monotonic()
        #: the router asked the decode engine for stream usage the client did not ask for (removed again)
        self.strip_usage = False
        #: the decode leg carries the prefill's ``kv_transfer_params`` (sequential relay)
        self.params_relayed = False
        #: the legs' spans (``router.tracing``; ended when their holds are released); None: not traced
        self.p_span: Any = None
        self.d_span: Any = None

    def pin_prefill_rank(self) -> int | None:
        """A DP rank for the prefill leg of a concurrent protocol when the prefill replica has several (by the
        prompt's first block, like the decode rank), sent as ``X-data-parallel-rank``; None otherwise."""
        if self.p_rep.dp_size <= 1:
            return None
        keys = self.routed.inp.keys
        rank = (keys[0] if keys else 0) % self.p_rep.dp_size
        self.headers = dict(self.headers, **{"x-data-parallel-rank": str(rank)})
        return rank

    # -- legs --------------------------------------------------------------------------------------------------
    async def prefill(self, hp: Hold, body: dict[str, Any]) -> pd_vllm.PrefillAnswer:
        """Send the prefill leg and read its whole answer, once (``pd_vllm.read_prefill_answer``; in a worker
        thread from ``THREAD_MIN_BYTES`` on); releases ``hp``. Raises LegFailed."""
        content, leg_s = await self.prefill_bytes(hp, body)
        limit = self.owner.cfg.max_transfer_params_bytes
        if len(content) >= THREAD_MIN_BYTES:  # one large scan at a time (router.core.large_parse)
            answer = await scan_in_thread(len(content), pd_vllm.read_prefill_answer, content, limit)
        else:
            answer = pd_vllm.read_prefill_answer(content, limit)
        self.observe_prefill(answer.usage, leg_s)
        return answer

    async def prefill_bytes(self, hp: Hold, body: dict[str, Any]) -> tuple[bytes, float]:
        """Send the prefill leg and read its whole answer (bounded); releases ``hp``. Returns the answer and the
        leg's seconds. Raises LegFailed (also on >= 400)."""
        self.metrics.legs.labels(self.p_rep.name, "prefill").inc()
        t0 = time.monotonic()
        try:
            resp, first = await self.edge.open(
                self.p_rep, self.path, orjson.dumps(body), self.headers, self.deadline
            )
        except AttemptFailed as exc:
            attempt_failed(self.p_span, exc.reason, exc.message)
            self.connection_failed(self.p_rep, exc)
            raise LegFailed("prefill_failed", f"prefill leg on {self.p_rep.name}: {exc.message}") from None
        finally:
            hp.first_byte()
        if self.p_span is not None:
            first_byte(self.p_span, resp.status, time.monotonic() - t0)
        try:
            content = await self.read(resp, first, self.p_rep)
        except LegFailed as exc:
            attempt_failed(self.p_span, exc.reason, exc.message)
            raise
        leg_s = time.monotonic() - t0
        if resp.status >= 400:
            failed = LegFailed(
                "prefill_failed",
                f"prefill leg on {self.p_rep.name} answered {resp.status}: "
                f"{content[:300].decode(errors='replace')}",
            )
            attempt_failed(self.p_span, failed.reason, failed.message)
            hp.release()
            self.metrics.leg_seconds.labels("prefill").observe(leg_s)
            raise failed
        hp.release()
        self.metrics.leg_seconds.labels("prefill").observe(leg_s)
        return content, leg_s

    def observe_prefill(self, usage: dict[str, Any] | None, leg_s: float) -> None:
        """Calibrate the PD policy with this prefill leg: the prefill replica's observation (prompt tokens;
        cached tokens from the leg's ``usage`` when reported, else the router's estimate; ``leg_s`` seconds of
        the prefill leg as its TTFT)."""
        reported = cached_tokens(usage)
        router = self.owner.router
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

    async def drain_prefill(self, hp: Hold, body: dict[str, Any]) -> None:
        """A concurrent prefill leg: send it, drain and discard its answer; releases ``hp``. Raises LegFailed."""
        try:
            await self.prefill(
                hp, body
            )  # read for its usage, else discarded (SGLang / Mooncake: nothing to relay)
        finally:
            hp.release()

    async def read(self, resp: EngineResponse, first: bytes, rep: Replica) -> bytes:
        """The whole (bounded) body of a leg's answer; the connection goes back to the pool. Raises LegFailed."""
        cfg = self.edge.cfg
        limit = self.owner.cfg.max_prefill_answer_bytes
        try:
            content = await resp.read_body(
                first, max_bytes=limit, idle_timeout_s=cfg.body_idle_timeout_s, deadline=self.deadline
            )
        except EngineResponseTooLarge:
            resp.close()
            raise LegFailed(
                "prefill_failed",
                f"prefill leg on {rep.name}: answer over {limit} bytes (pd_max_prefill_answer_bytes)",
            ) from None
        except (TimeoutError, EngineError) as exc:
            resp.close()
            raise LegFailed(
                "prefill_failed", f"prefill leg on {rep.name}: answer unreadable ({type(exc).__name__})"
            ) from None
        except BaseException:
            resp.close()
            raise
        resp.release()
        return content

    async def open_decode(self, body: dict[str, Any]) -> tuple[EngineResponse, bytes]:
        """Send the decode leg and wait for its first byte. Raises LegFailed."""
        self.metrics.legs.labels(self.d_rep.name, "decode").inc()
        if self.stream and self.edge.cfg.stream_usage:
            body, self.strip_usage = pd_vllm.with_stream_usage(body)
        payload = orjson.dumps(body)  # serialized once: relayed parameters are inserted as the engine's bytes
        t0 = time.monotonic()
        try:
            resp, first = await self.edge.open(self.d_rep, self.path, payload, self.d_headers, self.deadline)
        except AttemptFailed as exc:
            attempt_failed(self.d_span, exc.reason, exc.message)
            self.connection_failed(self.d_rep, exc)
            raise LegFailed(
                "decode_failed", f"decode leg on {self.d_rep.name}: {exc.message}", connection=exc.connection
            ) from None
        leg_s = time.monotonic() - t0
        self.metrics.leg_seconds.labels("decode").observe(leg_s)
        if self.d_span is not None:
            first_byte(self.d_span, resp.status, leg_s)
        return resp, first

    async def commit(self, hd: Hold, resp: EngineResponse, first: bytes) -> Response:
        """The client's answer from the decode leg (the proxy's commit path; it takes over ``hd`` for streams)."""
        hd.first_byte()
        ttft = time.monotonic() - self.t0
        out = await self.edge.commit(
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

    def connection_failed(self, rep: Replica, exc: AttemptFailed) -> None:
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
            self.edge.on_connection_failure(rep, exc.message)
