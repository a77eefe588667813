"""Dispatch chosen from the plan: the pipeline's step that sends a decided request to engines and returns the
client's answer.

* co-located decision, or a PD fleet's in-place plan: the in-place attempts over the ranking
  (``router.engine.proxy.Proxy``);
* disaggregated plan: the two legs through the plan's protocol runner (``router.pd.legs.PdLegs``), which falls
  back to the in-place attempts when a leg fails.

Whatever the path, a client that disconnects before the answer starts cancels the upstream request (answered
499, counted ``client_disconnected``); once a stream is relayed it keeps watching the client itself; ``on_done``
runs exactly once when the answer is over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from router.core.routing import Routed
from router.engine.proxy import Proxy
from router.engine.relay import ClientWatch, RelayedStream
from router.pd.legs import PdLegs
from router.telemetry import Telemetry
from router.tokens.token_ids import IdsPrompt


class Dispatcher:
    """Sends a decided request by its plan (see the module docstring).

    Args:
        in_place: the in-place attempts.
        pd: the prefill/decode legs (None: every plan is served in place).
        telemetry: metrics (``client_disconnected``).
    """

    def __init__(self, in_place: Proxy, pd: PdLegs | None, telemetry: Telemetry) -> None:
        self.in_place = in_place
        self.pd = pd
        self.telemetry = telemetry

    async def forward(
        self,
        receive: Callable[[], Any],
        routed: Routed,
        path: str,
        body: bytes,
        *,
        stream: bool,
        request_id: str,
        on_done: Callable[[], None] | None = None,
        ids: IdsPrompt | None = None,
    ) -> Response:
        """Send ``body`` to ``path`` by ``routed``'s plan and return the client's answer; never raises for engine
        or network failures. ``on_done`` is called exactly once when the answer is over (for a stream: when it
        ended or the client left). ``ids``: the prompt as the router's token ids, for replicas that take them
        (router/tokens/token_ids.py). ``receive``: the client's ASGI receive (its disconnect is watched)."""
        try:
            resp = await self._watched(receive, routed, path, body, stream, request_id, ids)
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        if on_done is not None:
            if isinstance(resp, RelayedStream):
                resp.relay.on_done = on_done
            else:
                on_done()
        return resp

    async def _watched(
        self,
        receive: Callable[[], Any],
        routed: Routed,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None,
    ) -> Response:
        """``by_plan`` while one small task watches for the client leaving (it cancels this one)."""
        watch = ClientWatch(receive)
        try:
            resp = await self.by_plan(routed, path, body, stream, request_id, ids)
        except asyncio.CancelledError:
            watch.stop()
            if not watch.left or not watch.uncancel():
                raise
            # the client went away before the answer started: the upstream request was cancelled with us
            self.telemetry.upstream_errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        except BaseException:
            watch.stop()
            raise
        if isinstance(resp, RelayedStream):
            resp.watch = watch.disarm()  # the stream keeps watching (and re-arms it on its own task)
        else:
            watch.stop()
        return resp

    async def by_plan(
        self, routed: Routed, path: str, body: bytes, stream: bool, request_id: str, ids: IdsPrompt | None
    ) -> Response:
        """In place, or disaggregated through the plan's protocol runner."""
        pd = self.pd
        if pd is not None and routed.plan is not None:
            if routed.disaggregated:
                return await pd.serve(routed, path, body, stream, request_id)
            pd.count_in_place(routed)
        return await self.in_place.attempts(routed, path, body, stream, request_id, ids)
