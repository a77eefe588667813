"""``Idempotency-Key`` handling for the generation routes (client-generated key, deduplicated for ~10 minutes).

A client that retries a request it is unsure about (timeout, dropped connection) sends the same
``Idempotency-Key`` header again. The router remembers each key in Redis (``membership.shared_state``,
``<prefix>idem:<key>``, ``idempotency_ttl_s`` seconds, shared by every router replica):

* first request with a key: it is claimed (an *in-flight* marker) and served normally;
* a duplicate while the first is still being served: ``409`` ``idempotency_in_flight`` with ``Retry-After``;
* a duplicate after a finished non-streaming request that got a 2xx answer: the stored answer is returned
  unchanged (status, body, content type, ``x-kvroute-replica``) with ``idempotent-replayed: true``; nothing is
  sent to an engine;
* a duplicate after a *streamed* request that completed (2xx, no SSE ``error`` event, at most
  ``MAX_STORED_BYTES``): the stored event stream is returned at once (``text/event-stream``, same events,
  ``idempotent-replayed: true``);
* a duplicate after a streamed request that did not complete (the client left mid-stream) or was too large to
  store: ``409`` ``idempotency_stream_not_stored`` (the key stays taken for the TTL so the generation is not run
  twice); a stream that ended with an SSE ``error`` event releases the key like any failed request;
* the same key with a different body (or route): ``422`` ``idempotency_key_reused``;
* a first request that ends without a 2xx answer (engine failure, 429, 503, ...) releases the key, so the client's
  retry runs normally;
* no Redis configured: ``501`` ``idempotency_unsupported``; Redis unreachable: ``503``
  ``idempotency_unavailable`` with ``Retry-After`` (a request carrying the key is never served without the
  guarantee it asks for).

Keys are 1..255 printable ASCII characters (else ``400``), scoped by client: with ``api_keys`` configured the Redis
key is prefixed by a hash of the caller's API key, so two clients never share (or see) each other's answers. The
request fingerprint is SHA-256 over the route and the raw body bytes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from membership.shared_state import IdempotencyEntry, SharedState, SharedStateUnavailable
from router.errors import error_response
from router.telemetry import current_trace_id

log = logging.getLogger("kvroute.idempotency")

HEADER = "idempotency-key"
#: response headers kept with a stored answer
_KEPT_HEADERS = ("x-kvroute-replica", "x-kvroute-predicted-cached-tokens")
#: largest answer body stored for replay, bytes (bigger answers release the key instead)
MAX_STORED_BYTES = 4 << 20


def fingerprint(path: str, body: bytes) -> str:
    """SHA-256 hex digest identifying a request (route + raw body bytes)."""
    h = hashlib.sha256(path.encode())
    h.update(b"\0")
    h.update(body)
    return h.hexdigest()


def valid_key(key: str) -> bool:
    """True for 1..255 printable ASCII characters."""
    return 0 < len(key) <= 255 and key.isascii() and key.isprintable()


class IdempotencyGuard:
    """Wraps the serving of one request carrying an ``Idempotency-Key`` (see the module docstring).

    Args:
        shared: the Redis shared state (None when ``redis_url`` is not set).
        retry_after_s: ``Retry-After`` value on 409 / 503 answers, seconds.
    """

    def __init__(self, shared: SharedState | None, retry_after_s: int = 1) -> None:
        self.shared = shared
        self.retry_after_s = retry_after_s
        self.replayed = 0
        self.conflicts = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def handle(
        self,
        key: str,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        serve: Callable[[], Awaitable[Response]],
        *,
        principal: str = "",
    ) -> Response:
        """Serve a request with ``Idempotency-Key: key`` through ``serve()`` at most once per key and client.

        ``principal``: who is calling (``router.serve.guard.Auth.principal``: a hash of the client's API key, "" without
        keys). Keys are scoped by it: another client's identical key and body neither gets this answer nor
        blocks this request.
        """
        rid = {"x-request-id": request_id}
        if not valid_key(key):
            return error_response(
                400,
                "Idempotency-Key must be 1 to 255 printable ASCII characters",
                "invalid_idempotency_key",
                "Idempotency-Key",
                headers=rid,
                trace_id=current_trace_id(),
            )
        key = f"{principal}/{key}" if principal else key
        if self.shared is None:
            return error_response(
                501,
                "Idempotency-Key needs shared state: this router has no redis_url configured",
                "idempotency_unsupported",
                "Idempotency-Key",
                headers=rid,
                trace_id=current_trace_id(),
            )
        fp = fingerprint(path, body)
        retry = {**rid, "retry-after": str(self.retry_after_s)}
        try:
            entry = await self.shared.idempotency_begin(key, fp)
        except SharedStateUnavailable as exc:
            return error_response(
                503,
                f"cannot check the Idempotency-Key: {exc}",
                "idempotency_unavailable",
                "Idempotency-Key",
                headers=retry,
                trace_id=current_trace_id(),
            )
        if entry.state != "new":
            return self._answer_known_key(entry, fp, request_id)
        try:
            resp = await serve()
        except BaseException:
            self._release(key)
            raise
        return await self._keep_answer(self.shared, key, fp, resp, request_id)

    def _answer_known_key(self, entry: IdempotencyEntry, fp: str, request_id: str) -> Response:
        """The answer to a key already begun: its stored response, or why it cannot be replayed (another body
        or route, still in flight, streamed and not stored)."""
        rid = {"x-request-id": request_id}
        if entry.fingerprint and entry.fingerprint != fp:
            self.conflicts += 1
            return error_response(
                422,
                "this Idempotency-Key was used with a different request body or route",
                "idempotency_key_reused",
                "Idempotency-Key",
                headers=rid,
                trace_id=current_trace_id(),
            )
        if entry.state == "in_flight":
            self.conflicts += 1
            return error_response(
                409,
                "a request with this Idempotency-Key is still being served",
                "idempotency_in_flight",
                "Idempotency-Key",
                headers={**rid, "retry-after": str(self.retry_after_s)},
                trace_id=current_trace_id(),
            )
        stored = entry.response or {}
        if stored.get("streamed") and "body_b64" not in stored:
            self.conflicts += 1
            return error_response(
                409,
                "the request with this Idempotency-Key was streamed; streamed answers are not stored",
                "idempotency_stream_not_stored",
                "Idempotency-Key",
                headers=rid,
                trace_id=current_trace_id(),
            )
        self.replayed += 1
        return _stored_response(stored, request_id)

    async def _keep_answer(
        self, shared: SharedState, key: str, fp: str, resp: Response, request_id: str
    ) -> Response:
        """Store ``resp`` under ``key`` (a stream: when it ends whole) so a retry replays it; an error or an answer
        over ``MAX_STORED_BYTES`` releases the key instead. Returns ``resp`` (a stream wrapped to be watched)."""
        if isinstance(resp, StreamingResponse):
            if resp.status_code >= 300:
                self._release(key)
                return resp
            resp.body_iterator = self._watch_stream(
                resp.body_iterator,
                key,
                fp,
                {
                    "status": resp.status_code,
                    "media_type": resp.headers.get("content-type", "text/event-stream"),
                    "headers": {h: resp.headers[h] for h in _KEPT_HEADERS if h in resp.headers},
                },
            )
            return resp
        if 200 <= resp.status_code < 300 and len(resp.body) <= MAX_STORED_BYTES:
            doc = {
                "status": resp.status_code,
                "media_type": resp.headers.get("content-type", "application/json"),
                "headers": {h: resp.headers[h] for h in _KEPT_HEADERS if h in resp.headers},
                "body_b64": base64.b64encode(bytes(resp.body)).decode(),
            }
            try:
                await shared.idempotency_finish(key, doc, fp)
            except SharedStateUnavailable as exc:
                log.warning("could not store the answer of Idempotency-Key request %s: %s", request_id, exc)
        else:
            self._release(key)
        return resp

    async def _watch_stream(
        self, it: AsyncIterable[Any], key: str, fp: str, doc: dict[str, Any]
    ) -> AsyncIterator[Any]:
        """Relay a streamed answer and keep a copy (up to ``MAX_STORED_BYTES``); when it ends, store it for
        replay if it completed, release the key if it failed, else mark the key done (not stored)."""
        parts: list[bytes] = []
        size = 0
        complete = False
        try:
            async for chunk in it:
                if size <= MAX_STORED_BYTES:
                    data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                    size += len(data)
                    parts.append(data)
                yield chunk
            complete = True
        finally:
            body = b"".join(parts) if complete and size <= MAX_STORED_BYTES else None
            if body is not None and _sse_failed(body):
                self._release(key)  # ended with an error event: a failed request, the client's retry runs
            else:
                stored = {
                    **doc,
                    "streamed": True,
                    **({"body_b64": base64.b64encode(body).decode()} if body is not None else {}),
                }
                self._spawn(self._finish_streamed(key, fp, stored))

    async def _finish_streamed(self, key: str, fp: str, doc: dict[str, Any]) -> None:
        assert self.shared is not None
        with contextlib.suppress(SharedStateUnavailable):
            await self.shared.idempotency_finish(key, doc, fp)

    def _release(self, key: str) -> None:
        if self.shared is not None:
            self._spawn(self.shared.idempotency_abort(key))

    def _spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` to completion even when the caller is being cancelled (client gone)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _sse_failed(body: bytes) -> bool:
    """True when a relayed event stream ended with the proxy's SSE ``error`` event."""
    return body.rfind(b"event: error") > body.rfind(b"data: [DONE]")


def _stored_response(doc: dict[str, Any], request_id: str) -> Response:
    """The stored answer of a finished request, as a fresh Response."""
    try:
        body = base64.b64decode(doc.get("body_b64", ""))
    except (ValueError, TypeError):
        body = b""
    headers = {str(k): str(v) for k, v in (doc.get("headers") or {}).items()}
    headers.update({"x-request-id": request_id, "idempotent-replayed": "true"})
    return Response(
        body,
        status_code=int(doc.get("status", 200)),
        media_type=str(doc.get("media_type", "application/json")),
        headers=headers,
    )
