"""The router -> engine hop of one attempt, as a public API: open (send, wait for headers and the first chunk),
payload (the body for that replica), commit (the client's answer once the first byte arrived: a relayed stream or
the whole body). The in-place attempts (``router.engine.proxy``), the prefill/decode legs (``router.pd``) and the
endpoint picker use it with a ``router.engine.hold.Hold``.

Units: seconds, bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from starlette.responses import Response

from membership.replicas import Replica
from router.core.routing import Routed
from router.engine.client import (
    EngineConnectError,
    EngineConnectionLost,
    EngineConnectTimeout,
    EngineError,
    EnginePool,
    EngineResponse,
    EngineResponseTooLarge,
    EngineTLSError,
)
from router.engine.config import ProxyConfig
from router.engine.feedback import Feedback, openai_usage
from router.engine.hold import AttemptFailed, Hold
from router.engine.relay import TAIL_BYTES, AnswerWatch, Relay, RelayedStream
from router.engine.sse import BadStream, SSEValidator, ask_for_usage
from router.errors import error_response
from router.telemetry import Telemetry, current_trace_id
from router.tokens.token_ids import IdsPrompt, TokenIdsCheck

log = logging.getLogger("kvroute.proxy")

#: largest error body read from an engine 5xx (bytes)
ERR_BODY_BYTES = 2048


@dataclass(frozen=True, slots=True)
class Wire:
    """How a request goes to an engine beyond the OpenAI generation routes' defaults.

    Attributes:
        method: the HTTP method (``GET`` / ``DELETE`` for a stored response, ``POST`` otherwise).
        content_type: the request body's type (a multipart body keeps the client's, boundary included).
        openai_stream: a streamed answer is an OpenAI completions stream: stream usage is asked for and the
            stream must end with ``data: [DONE]`` (False for the Responses API's event streams, which end with
            their ``response.completed`` event, and for endpoints whose usage the router does not read).
        watch: reads the successful answer as it passes (None: nothing to read).
        feedback: the answer is a generation whose usage and TTFT feed the cached-token telemetry and the policy's
            calibration (False for pooling, tokenize, audio, a stored response, SGLang's native answer: their
            timing is not a prefill's, and they carry no OpenAI usage).
    """

    method: str = "POST"
    content_type: str = "application/json"
    openai_stream: bool = True
    watch: AnswerWatch | None = None
    feedback: bool = True


#: the OpenAI generation routes' wire
OPENAI = Wire()


class EngineEdge:
    """The engine edge: the connection pool, and open / payload / commit of one attempt.

    Args:
        telemetry: metrics (TTFT, upstream errors, token-id prompts).
        config: timeouts, pool sizes, bounds on what engines send back.
        feedback: usage and TTFT feedback after an answer.
        token_ids: which replicas take prompts as token ids (router/tokens/token_ids.py); None: none.
        on_connection_failure: ``f(replica, error)`` called when a connection to a replica fails (passive
            health signal).
    """

    def __init__(
        self,
        telemetry: Telemetry,
        config: ProxyConfig,
        feedback: Feedback,
        token_ids: TokenIdsCheck | None = None,
        on_connection_failure: Callable[[Replica, str], None] | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.cfg = config
        self.feedback = feedback
        self.token_ids = token_ids
        self.on_connection_failure = on_connection_failure or (lambda rep, err: None)
        self._headers: dict[str, str] = {}
        if config.engine_api_key:
            self._headers["authorization"] = f"Bearer {config.engine_api_key}"
        self._pool: EnginePool | None = None

    def pool(self) -> EnginePool:
        """The engine connection pool (created on first use, inside the event loop)."""
        if self._pool is None or self._pool.closed:
            # read timeouts are enforced by the proxy itself (first byte, idle gap, total deadline)
            self._pool = EnginePool(
                connect_timeout_s=self.cfg.connect_timeout_s,
                keepalive_timeout_s=self.cfg.keepalive_timeout_s,
                max_connections=self.cfg.max_connections,
                headers=self._headers,
                max_header_bytes=self.cfg.max_header_bytes,
                max_headers=self.cfg.max_headers,
            )
        return self._pool

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None

    # -- entry point -----------------------------------------------------------------------------------

    def payload(
        self, rep: Replica, body: bytes, stream: bool, ids: IdsPrompt | None, wire: Wire = OPENAI
    ) -> tuple[bytes, bool]:
        """The body for ``rep`` (token ids when it takes them) and whether the router asked for stream usage
        the client did not ask for (then it is removed from what the client receives)."""
        if not wire.openai_stream:
            return body, False
        payload = body
        check = self.token_ids
        if check is not None and ids is not None and check.accepts(rep):
            payload = ids.body()
            self.telemetry.token_id_prompts.inc()
            check.audit(rep, ids)
        if stream and self.cfg.stream_usage:
            return ask_for_usage(payload)
        return payload, False

    async def open(
        self,
        rep: Replica,
        path: str,
        body: bytes,
        headers: dict[str, str],
        deadline: float,
        method: str = "POST",
    ) -> tuple[EngineResponse, bytes]:
        """Send the request and wait for headers + the first body chunk. Raises AttemptFailed."""
        budget = min(self.cfg.first_byte_timeout_s, deadline - time.monotonic())
        resp: EngineResponse | None = None
        try:
            async with asyncio.timeout(max(0.001, budget)):
                if method == "POST":
                    resp = await self.pool().post(rep.url, path, body, headers)
                else:
                    resp = await self.pool().request(method, rep.url, path, body, headers)
                if resp.status >= 500:
                    data = await resp.read_all(ERR_BODY_BYTES)
                    resp.close()
                    raise AttemptFailed(
                        f"engine_{resp.status}",
                        f"engine answered {resp.status}: {data[:300].decode(errors='replace')}",
                        retry=True,
                        status=502,
                    )
                first = await resp.read_chunk()
                return resp, first
        except AttemptFailed:
            raise
        except EngineConnectTimeout as exc:  # an overloaded engine, not necessarily a dead one
            raise AttemptFailed("connect_timeout", f"connect timed out: {exc}", retry=True) from None
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise AttemptFailed(
                "first_byte_timeout",
                f"no response within {budget:.3g}s (first_byte_timeout_s)",
                retry=False,
                status=504,
            ) from None
        except EngineTLSError as exc:
            raise AttemptFailed("tls_error", str(exc), retry=True, connection=True) from None
        except EngineConnectError as exc:
            raise AttemptFailed(
                "connect_error", f"cannot connect: {exc}", retry=True, connection=True
            ) from None
        except EngineConnectionLost as exc:
            if resp is not None:
                resp.close()
            raise AttemptFailed(
                "connection_lost",
                f"connection lost before the first byte: {exc}",
                retry=True,
                connection=True,
            ) from None
        except EngineError as exc:
            if resp is not None:
                resp.close()
            raise AttemptFailed("upstream_error", f"{type(exc).__name__}: {exc}", retry=True) from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise

    # -- committed answers -----------------------------------------------------------------------------

    async def commit(
        self,
        hold: Hold,
        routed: Routed,
        resp: EngineResponse,
        first: bytes,
        ttft: float,
        deadline: float,
        stream: bool,
        request_id: str,
        predicted_cached: int,
        strip_usage: bool = False,
        wire: Wire = OPENAI,
    ) -> Response:
        """The client's answer once the first byte arrived: a relayed stream (which takes over ``hold``) or the
        whole body read now (``hold`` is released when it was read)."""
        rep = hold.rep
        out_headers = {
            "x-request-id": request_id,
            "x-kvroute-replica": rep.name,
            "x-kvroute-predicted-cached-tokens": str(predicted_cached),
        }
        ctype = resp.headers.get("content-type", "application/json")
        status = resp.status
        if status < 400:
            self.telemetry.ttft.labels(rep.name).observe(ttft)
        if ctype.startswith("text/event-stream") and status < 400:
            return self._commit_stream(
                hold,
                routed,
                resp,
                first,
                ttft,
                deadline,
                request_id,
                predicted_cached,
                strip_usage,
                ctype,
                out_headers,
                wire,
            )
        # non-streaming: read the rest now, bounded in size and in silence
        try:
            content = await resp.read_body(
                first,
                max_bytes=self.cfg.max_body_bytes,
                idle_timeout_s=self.cfg.body_idle_timeout_s,
                deadline=deadline,
            )
        except (TimeoutError, EngineError) as exc:
            hold.release()
            resp.close()
            return self._body_failed(rep, exc, out_headers)
        except BaseException:
            hold.release()
            resp.close()
            raise
        hold.release()
        resp.release()  # fully read: the connection goes back to the pool
        if status < 400:
            try:
                obj = orjson.loads(content)
            except orjson.JSONDecodeError:
                return self._not_json(rep, status, content, request_id, out_headers)
            if wire.feedback:
                usage = obj.get("usage") if isinstance(obj, dict) else None
                usage = openai_usage(usage) if isinstance(usage, dict) else None
                self.feedback.check_usage(rep, usage, streamed=False)
                self.feedback.observe(rep, routed, usage, ttft, predicted_cached, single_chunk=not stream)
            if wire.watch is not None:
                wire.watch.feed(rep, content)
                await wire.watch.complete(rep)
        return Response(content, status_code=status, media_type=ctype, headers=out_headers)

    def _not_json(
        self, rep: Replica, status: int, content: bytes, request_id: str, out_headers: dict[str, str]
    ) -> Response:
        """The 502 for a successful answer whose body is not JSON (counted and logged)."""
        self.telemetry.upstream_errors.labels("bad_body").inc()
        log.warning("engine answered garbage", extra={"request_id": request_id, "replica": rep.name})
        return error_response(
            502,
            f"engine {rep.name} answered {status} with a body that is not JSON: {content[:80]!r}",
            "upstream_bad_body",
            headers=out_headers,
            trace_id=current_trace_id(),
        )

    def _commit_stream(
        self,
        hold: Hold,
        routed: Routed,
        resp: EngineResponse,
        first: bytes,
        ttft: float,
        deadline: float,
        request_id: str,
        predicted_cached: int,
        strip_usage: bool,
        ctype: str,
        out_headers: dict[str, str],
        wire: Wire,
    ) -> Response:
        """A relayed event stream (the relay releases ``hold`` when it ends), or a clean 502 when the first
        chunk is already not a valid event stream (nothing was sent to the client yet)."""
        rep = hold.rep
        events = SSEValidator(
            strip_usage=strip_usage,
            max_event_bytes=self.cfg.max_body_bytes,
            require_done=wire.openai_stream,
        )
        try:
            out = events.feed(first)
        except BadStream as exc:
            hold.release()
            resp.close()
            self.telemetry.upstream_errors.labels("bad_stream").inc()
            log.warning(
                "engine sent an invalid event stream",
                extra={"request_id": request_id, "replica": rep.name, "error": str(exc)},
            )
            return error_response(
                502,
                f"engine {rep.name} answered {resp.status} with an invalid event stream: {exc}",
                "upstream_bad_stream",
                headers=out_headers,
                trace_id=current_trace_id(),
            )
        relay = Relay(
            hold,
            routed,
            resp,
            out,
            ttft,
            deadline,
            request_id,
            predicted_cached,
            events,
            telemetry=self.telemetry,
            feedback=self.feedback,
            idle_timeout_s=self.cfg.idle_timeout_s,
        )
        relay.tail = bytearray(first[-TAIL_BYTES:])
        relay.fed_back = wire.feedback
        if wire.watch is not None:
            relay.watch = wire.watch
            wire.watch.feed(rep, first)
        response = RelayedStream(relay, status_code=resp.status, media_type=ctype, headers=out_headers)
        hold.hand_over()
        return response

    def _body_failed(self, rep: Replica, exc: BaseException, out_headers: dict[str, str]) -> Response:
        """The error answer for a non-streamed body that could not be read whole (counted by reason)."""
        if isinstance(exc, EngineResponseTooLarge):
            reason, status, code = "body_too_large", 502, "upstream_body_too_large"
            msg = (
                f"engine {rep.name} sent a response body over {self.cfg.max_body_bytes} bytes "
                "(engine_max_body_bytes)"
            )
        elif isinstance(exc, TimeoutError) and exc.args[:1] == ("idle",):
            reason, status, code = "body_stalled", 504, "upstream_body_stalled"
            msg = (
                f"engine {rep.name} sent nothing for {self.cfg.body_idle_timeout_s:g}s while sending the "
                "response body (engine_body_idle_timeout_s)"
            )
        elif isinstance(exc, TimeoutError):
            reason, status, code = "total_timeout", 504, "total_timeout"
            msg = f"engine {rep.name} did not finish the response within total_timeout_s"
        else:
            reason, status, code = "body_failed", 502, "upstream_body_failed"
            msg = f"engine {rep.name} failed while sending the response: {type(exc).__name__}"
        self.telemetry.upstream_errors.labels(reason).inc()
        log.warning(
            "engine response body failed",
            extra={"replica": rep.name, "reason": reason, "request_id": out_headers.get("x-request-id")},
        )
        return error_response(status, msg, code, headers=out_headers, trace_id=current_trace_id())
