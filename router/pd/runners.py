"""One protocol runner per prefill/decode wire: how the two legs of a disaggregated plan are built and sent.

* ``NixlRelay`` (vLLM NixlConnector, sequential): the prefill leg (not streamed, one token) must answer before the
  decode leg is sent with the returned ``kv_transfer_params``, relayed opaquely (``router.pd.vllm``);
* ``MooncakePush`` (vLLM MooncakeConnector, concurrent): the router mints ``transfer_id`` and names the prefill
  engine by the id its bootstrap server lists (``router.pd.mooncake``); an id the router cannot learn means no
  Mooncake parameters are sent at all (``engine_id_unknown``), never a made-up id;
* ``SglangBootstrap`` (SGLang, concurrent): both legs carry the bootstrap host / port / room (``router.pd.sglang``);
  the prefill answer is drained and discarded.

Each runner does two things with one try's ``TwoLegs``:

* ``serve``: both legs, the decode leg's answer committed to the client (the HTTP door, through the proxy's
  dispatch);
* ``handoff``: the prefill side only, returning the decode leg's body (and ``TwoLegs.d_headers``) for someone else
  to send: the endpoint picker hands it to the gateway, which sends it to the decode replica. The sequential relay
  waits for the prefill answer; a concurrent protocol starts its prefill leg and leaves it draining.

Units: seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

from starlette.responses import Response

from membership.replicas import Replica
from router.engine.hold import Hold
from router.pd import mooncake as pd_mooncake
from router.pd import sglang as pd_sglang
from router.pd import vllm as pd_vllm
from router.pd.leg import LegFailed, TwoLegs
from router.pd.mooncake import MooncakeIds
from router.telemetry import PdMetrics

log = logging.getLogger("kvroute.pd")


class ProtocolRunner(Protocol):
    """Builds and sends the two legs of a disaggregated plan for one wire protocol."""

    #: the protocol's name (``pd_protocol``): ``vllm``, ``mooncake``, ``sglang``
    name: str

    async def serve(self, legs: TwoLegs, hp: Hold, hd: Hold) -> Response:
        """Both legs; the client's answer from the decode leg. Raises LegFailed before its first byte."""
        ...

    async def handoff(self, legs: TwoLegs, hp: Hold) -> dict[str, Any]:
        """The prefill side; returns the decode leg's body (its headers: ``legs.d_headers``). Raises LegFailed."""
        ...


class NixlRelay:
    """vLLM NIXL relay: the prefill leg, then the decode leg with the returned ``kv_transfer_params`` (the bytes
    the prefill engine sent, relayed as they are)."""

    name = "vllm"

    async def handoff(self, legs: TwoLegs, hp: Hold) -> dict[str, Any]:
        """Run the prefill leg to its answer; the decode body carries its ``kv_transfer_params`` (without them the
        decode engine recomputes: logged)."""
        answer = await legs.prefill(hp, pd_vllm.nixl_prefill_body(legs.obj))
        if answer.problem is not None:
            raise LegFailed(
                "prefill_failed", f"prefill leg on {legs.p_rep.name}: its answer {answer.problem}"
            )
        legs.params_relayed = answer.params is not None
        if answer.params is None:
            log.warning(
                "prefill answer without kv_transfer_params: the decode engine recomputes",
                extra={"request_id": legs.request_id, "replica": legs.p_rep.name},
            )
        return pd_vllm.decode_body(legs.obj, answer.params)

    async def serve(self, legs: TwoLegs, hp: Hold, hd: Hold) -> Response:
        """The relay, measuring the handoff (prefill answer -> the decode leg's first byte) for link learning."""
        d_body = await self.handoff(legs, hp)
        t_handoff = time.monotonic()
        resp, first = await legs.open_decode(d_body)
        handoff_s = time.monotonic() - t_handoff
        legs.metrics.handoff_seconds.observe(handoff_s)
        if legs.params_relayed:  # without parameters the decode engine recomputes: no handoff to learn from
            legs.owner.observe_handoff(legs.routed, legs.plan, handoff_s)
        return await legs.commit(hd, resp, first)


class _Concurrent:
    """A concurrent protocol: both legs at once (``bodies`` says what each carries); the decode leg's answer goes
    to the client, the prefill leg's is drained."""

    name = ""

    async def bodies(self, legs: TwoLegs) -> tuple[dict[str, Any], dict[str, Any]]:
        """The prefill and decode legs' bodies (may pin ``legs.headers``' DP rank). Raises LegFailed."""
        raise NotImplementedError

    def failed(self, legs: TwoLegs) -> None:
        """The try failed before the decode leg's first byte (nothing to undo by default)."""

    async def handoff(self, legs: TwoLegs, hp: Hold) -> dict[str, Any]:
        """Start the prefill leg (it releases P when drained) and return the decode leg's body."""
        p_body, d_body = await self.bodies(legs)
        prefill = asyncio.ensure_future(legs.drain_prefill(hp, p_body))
        hp.hand_over()  # the draining prefill leg releases P when it ends
        legs.owner.keep_draining(prefill)
        return d_body

    async def serve(self, legs: TwoLegs, hp: Hold, hd: Hold) -> Response:
        """Both legs at once; a prefill leg that fails before the decode leg answers fails the try (the decode
        leg would wait for a room nobody fills); a decode leg failing while its prefill leg had not answered is
        a failed transfer."""
        p_body, d_body = await self.bodies(legs)
        prefill = asyncio.ensure_future(legs.drain_prefill(hp, p_body))
        decode = asyncio.ensure_future(legs.open_decode(d_body))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            failed = prefill.exception() if prefill.done() else None
            if failed is not None and not decode.done():
                raise failed
            try:
                resp, first = await decode
            except LegFailed as exc:
                raise transfer_failed(legs, exc, prefill) from None
        except BaseException as exc:
            for task in (prefill, decode):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(prefill, decode, return_exceptions=True)
            if isinstance(exc, LegFailed):
                self.failed(legs)
            raise
        if not prefill.done():
            hp.hand_over()  # the draining prefill leg releases P when it ends
            legs.owner.keep_draining(prefill)
        elif prefill.exception() is not None:
            log.warning(
                "prefill leg failed after the decode leg answered",
                extra={
                    "request_id": legs.request_id,
                    "replica": legs.p_rep.name,
                    "error": str(prefill.exception()),
                },
            )
        return await legs.commit(hd, resp, first)


def transfer_failed(legs: TwoLegs, exc: LegFailed, prefill: asyncio.Future[None]) -> LegFailed:
    """A decode leg that failed before its first byte. The decode engine answered an error while its prefill leg
    had not answered (failed, or still waiting: a prefill pod that died without closing its connections hangs):
    the transfer failed (``transfer_failed``: re-run with fresh bootstrap fields on another prefill replica). The
    decode replica unreachable, or its prefill leg answered (the KV was sent): the decode replica's own failure
    (``exc``)."""
    prefill_answered = prefill.done() and not prefill.cancelled() and prefill.exception() is None
    if exc.reason != "decode_failed" or exc.connection or prefill_answered:
        return exc
    return LegFailed(
        "transfer_failed", f"{exc.message} (its prefill leg on {legs.p_rep.name} had not answered)"
    )


def bootstrap_address(legs: TwoLegs, default_port: int) -> tuple[str, int]:
    """The prefill replica's bootstrap host and port (its own port, else ``default_port``)."""
    return urlsplit(legs.p_rep.url).hostname or "", legs.p_rep.bootstrap_port or default_port


class SglangBootstrap(_Concurrent):
    """SGLang bootstrap rooms: the same body to both legs with the prefill's bootstrap host / port / room."""

    name = "sglang"

    def __init__(self, default_bootstrap_port: int) -> None:
        self.default_bootstrap_port = default_bootstrap_port

    async def bodies(self, legs: TwoLegs) -> tuple[dict[str, Any], dict[str, Any]]:
        host, port = bootstrap_address(legs, self.default_bootstrap_port)
        p_body, d_body, _ = pd_sglang.bodies(
            legs.obj, host, port, prefill_dp_rank=legs.pin_prefill_rank(), decode_dp_rank=legs.plan.dp_rank
        )
        return p_body, d_body


class MooncakePush(_Concurrent):
    """vLLM Mooncake push: a router-minted ``transfer_id``; the prefill engine named by the id its bootstrap
    server lists (the prefill leg pinned to that id's rank when the server lists several).

    Args:
        ids: the Mooncake engine ids of prefill replicas, from their bootstrap servers.
        metrics: the PD metrics (unknown engine ids are counted there).
        default_bootstrap_port: bootstrap port of prefill replicas that name none.
    """

    name = "mooncake"

    def __init__(self, ids: MooncakeIds, metrics: PdMetrics, default_bootstrap_port: int) -> None:
        self.ids = ids
        self.metrics = metrics
        self.default_bootstrap_port = default_bootstrap_port
        #: prefill replicas whose unknown Mooncake engine id was logged (once each)
        self._unknown_logged: set[str] = set()

    async def bodies(self, legs: TwoLegs) -> tuple[dict[str, Any], dict[str, Any]]:
        """Raises LegFailed(``engine_id_unknown``) when the prefill engine's id cannot be learned: no Mooncake
        parameters are sent then, never a made-up id."""
        host, port = bootstrap_address(legs, self.default_bootstrap_port)
        address = f"{host if ':' not in host else f'[{host}]'}:{port}"
        ids = await self.ids.ids(legs.p_rep.index, address)
        if not ids:
            self.engine_id_unknown(legs.p_rep, address)
            raise LegFailed(
                "engine_id_unknown",
                f"the Mooncake engine id of {legs.p_rep.name} is unknown (GET http://{address}/query listed "
                "none): no Mooncake parameters sent",
            )
        keys = legs.routed.inp.keys
        rank, engine_id = pd_mooncake.pick_engine(ids, keys[0] if keys else 0)
        if rank is not None:
            legs.headers = dict(legs.headers, **{"x-data-parallel-rank": str(rank)})
        return pd_vllm.mooncake_bodies(legs.obj, pd_vllm.new_transfer_id(), engine_id, f"http://{address}")

    def failed(self, legs: TwoLegs) -> None:
        """The prefill engine restarted (a new id) or rejected its id: ask its bootstrap server again."""
        self.ids.forget(legs.p_rep.index)

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
