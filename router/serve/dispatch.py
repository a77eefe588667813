"""Dispatch chosen from the plan: the pipeline's step that sends a decided request to engines and returns the
client's answer.

* co-located decision, or a PD fleet's in-place plan: the in-place attempts over the ranking
  (``router.engine.proxy.Proxy``);
* disaggregated plan: the two legs through the plan's protocol runner (``router.pd.legs.PdLegs``), which falls
  back to the in-place attempts when a leg fails.

A relayed stream is armed for mid-stream migration (``migration_limit`` > 0, ``router.serve.migration``): when its
engine fails after the first byte, the answer continues on another replica, dispatched by the same plan step.

Whatever the path, a client that disconnects before the answer starts cancels the upstream request (answered
499, counted ``client_disconnected``); once a stream is relayed it keeps watching the client itself; ``on_done``
runs exactly once when the answer is over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response

from router.core.routing import Routed
from router.engine.attempt import OPENAI, Wire
from router.engine.proxy import Proxy
from router.engine.relay import ClientWatch, RelayedStream
from router.pd.legs import PdLegs
from router.serve.migration import Migration, as_stream, assembled
from router.telemetry import Telemetry
from router.tokens.token_ids import IdsPrompt


class Dispatcher:
    """Sends a decided request by its plan (see the module docstring).

    Args:
        in_place: the in-place attempts.
        pd: the prefill/decode legs (None: every plan is served in place).
        telemetry: metrics (``client_disconnected``).
        migration_limit: continuations of a stream whose engine failed after the first byte (0: none).
        migrate_non_streamed: plain non-streamed generation requests are streamed and assembled (``as_stream``)
            so that they are continued too.
    """

    def __init__(
        self,
        in_place: Proxy,
        pd: PdLegs | None,
        telemetry: Telemetry,
        migration_limit: int,
        migrate_non_streamed: bool,
    ) -> None:
        self.in_place = in_place
        self.pd = pd
        self.telemetry = telemetry
        self.migration_limit = migration_limit
        self.migrate_non_streamed = migrate_non_streamed and migration_limit > 0
        #: the router's prompt token counts equal the engines' (a local HF tokenizer or the engines' own
        #: /tokenize): a migrated answer's usage then reports the router's count of the original prompt
        self.exact_prompt_counts = False

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
        wire: Wire = OPENAI,
    ) -> Response:
        """Send ``body`` to ``path`` by ``routed``'s plan and return the client's answer; never raises for engine
        or network failures. ``on_done`` is called exactly once when the answer is over (for a stream: when it
        ended or the client left). ``ids``: the prompt as the router's token ids, for replicas that take them
        (router/tokens/token_ids.py). ``receive``: the client's ASGI receive (its disconnect is watched).

        With ``migrate_non_streamed``, a plain non-streamed generation request is streamed from the engine and its answer
        assembled by the router (``router.serve.migration.as_stream``), so that it too survives its engine."""
        streamed = as_stream(path, body) if not stream and self.migrate_non_streamed else None
        if streamed is not None:
            body, stream = streamed, True
            if ids is not None:
                ids = IdsPrompt(ids.text, ids.token_ids, orjson.loads(streamed))
        try:
            resp = await self._watched(receive, routed, path, body, stream, request_id, ids, wire)
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        if isinstance(resp, RelayedStream) and self.migration_limit > 0:
            migration = Migration(
                self.in_place.router,
                self._continue,
                self.telemetry,
                self.migration_limit,
                routed,
                path,
                body,
                request_id,
            )
            if self.exact_prompt_counts and not routed.inp.ids_partial:
                migration.prompt_tokens = routed.inp.prompt_tokens
            resp.relay.arm(migration.resume)
        if on_done is not None:
            if isinstance(resp, RelayedStream):
                resp.relay.on_done = on_done
            else:
                on_done()
        if streamed is not None and isinstance(resp, RelayedStream):
            return await self._assemble(resp, path)
        return resp

    async def _assemble(self, resp: RelayedStream, path: str) -> Response:
        """The non-streamed answer of a request the router streamed (``as_stream``): the relayed stream read
        whole (continued elsewhere if its engine fails), then assembled; the client leaving cancels it (499)."""
        relay, watch = resp.relay, resp.watch
        if watch is not None:
            watch.arm()
        chunks: list[bytes] = []
        try:
            async for chunk in relay.body():
                chunks.append(chunk)
        except asyncio.CancelledError:
            if watch is None or not watch.left or not watch.uncancel():
                raise
            self.telemetry.upstream_errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        finally:
            if watch is not None:
                watch.stop()
            await relay.finish()
        status, content = assembled(b"".join(chunks), path.endswith("/chat/completions"))
        headers = {k: v for k, v in resp.headers.items() if k.startswith("x-")}
        return Response(content, status_code=status, media_type="application/json", headers=headers)

    async def _continue(self, routed: Routed, path: str, body: bytes, request_id: str) -> Response:
        """Dispatch a stream's continuation by its plan (``router.serve.migration``)."""
        return await self.by_plan(routed, path, body, True, request_id, None)

    async def _watched(
        self,
        receive: Callable[[], Any],
        routed: Routed,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None,
        wire: Wire,
    ) -> Response:
        """``by_plan`` while one small task watches for the client leaving (it cancels this one)."""
        watch = ClientWatch(receive)
        try:
            resp = await self.by_plan(routed, path, body, stream, request_id, ids, wire)
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
        self,
        routed: Routed,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None,
        wire: Wire = OPENAI,
    ) -> Response:
        """In place, or disaggregated through the plan's protocol runner (the OpenAI generation routes only:
        every other endpoint is served in place)."""
        pd = self.pd
        if pd is not None and routed.plan is not None:
            if routed.disaggregated and wire is OPENAI:
                return await pd.serve(routed, path, body, stream, request_id)
            pd.count_in_place(routed)
        return await self.in_place.attempts(routed, path, body, stream, request_id, ids, wire)
