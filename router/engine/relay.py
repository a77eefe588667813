"""A relayed engine event stream: the engine's chunks go to the client as they come (written straight onto the
client's connection when the server allows it), validated event by event; cleanup exactly once at the end (the
hold released, usage and TTFT fed back, the engine connection back to the pool or closed).

Units: seconds, bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttpToolsCycle

from membership.replicas import Replica
from router.core.routing import Routed
from router.engine.client import EngineError, EngineResponse
from router.engine.feedback import Feedback, usage_from_sse
from router.engine.hold import Hold
from router.engine.sse import BadStream, SSEValidator, sse_error
from router.engine.transcript import Transcript, error_event_at
from router.telemetry import Telemetry, current_trace_id

log = logging.getLogger("kvroute.proxy")

#: bytes of the end of a stream kept to find the final ``usage`` chunk
TAIL_BYTES = 16384


class AnswerWatch(Protocol):
    """Reads a successful engine answer as it passes (e.g. the Responses API's response id and output text).

    ``feed`` gets every raw piece of the answer in order (a non-streamed answer: its whole body at once); it must
    be cheap and never raise. ``complete`` is awaited once when the answer ended whole (not after a failure)."""

    def feed(self, rep: Replica, piece: bytes) -> None:
        """One piece of the answer from ``rep``."""

    async def complete(self, rep: Replica) -> None:
        """The answer from ``rep`` ended whole."""


class Relay:
    """One relayed SSE stream: yields the engine's chunks, and cleans up exactly once (``finish``).

    Cleanup = release the attempt's hold on the replica (in-flight count), feed back usage / TTFT, close the upstream response, call
    ``on_done``. It runs from the generator's ``finally`` and, as a safety net, from ``RelayedStream`` (a stream
    cancelled before its generator ever started has no ``finally`` to run).
    """

    def __init__(
        self,
        hold: Hold,
        routed: Routed,
        resp: EngineResponse,
        first: bytes,
        ttft: float,
        deadline: float,
        request_id: str,
        predicted_cached: int,
        events: SSEValidator,
        *,
        telemetry: Telemetry,
        feedback: Feedback,
        idle_timeout_s: float,
    ) -> None:
        self.hold, self.rep, self.routed, self.resp = hold, hold.rep, routed, resp
        self.first, self.ttft, self.deadline, self.request_id = first, ttft, deadline, request_id
        #: the request's trace id, named in the error event that may end the stream (``error.trace_id``); taken
        #: here, in the request's task: ``_sink`` runs in the engine connection's read callback, whose context
        #: may be another request's
        self.trace_id = current_trace_id()
        self.predicted_cached = predicted_cached
        #: validates (and filters) the engine's events; ``first`` has already been through it
        self.events = events
        self.telemetry, self.feedback, self.idle_timeout_s = telemetry, feedback, idle_timeout_s
        #: the end of the engine's raw stream (before filtering): the final usage chunk is found there
        self.tail = bytearray(first[-TAIL_BYTES:])
        self.ok = False
        self.finished = False
        self.on_done: Callable[[], None] | None = None
        #: writes to the client's connection directly (``RelayedStream`` sets it when the server allows it): the
        #: engine's pieces are then relayed from the engine connection's read callback (``_sink``)
        self.direct: DirectWrite | None = None
        #: the engine's stream failed validation in ``_sink`` (the loop sends the error event)
        self.bad: BadStream | None = None
        #: ``time.monotonic()`` of the last piece the engine sent (seconds): the idle timeout counts from it
        self.last_at = time.monotonic()
        #: reads the answer as it passes (``router.engine.attempt.AnswerWatch``; None: nothing reads it)
        self.watch: AnswerWatch | None = None
        #: the answer's usage and TTFT are fed back (a generation's; ``router.engine.attempt.Wire.feedback``)
        self.fed_back = True
        self.direct_pieces = 0  # pieces relayed by ``_sink`` / by the loop (``kvroute_relayed_pieces_total``)
        self.task_pieces = 1 if first else 0
        #: a failure after the first byte is recorded in ``failure`` instead of ending the client's stream with
        #: an error event (mid-stream migration: ``resume`` or the caller continues the answer elsewhere)
        self.migrating = False
        #: the failure that ended the engine's stream: (reason, the SSE error event the client would get)
        self.failure: tuple[str, bytes] | None = None
        #: the events sent to the client (kept when the answer can be continued elsewhere)
        self.transcript: Transcript | None = None
        #: continues a failed stream: ``resume(relay)`` yields the client's remaining bytes (the continuation,
        #: or the final error event); None: the failure's own error event ends the stream
        self.resume: Callable[[Relay], AsyncIterator[bytes]] | None = None
        #: the relay of the continuation being streamed (finished with this one)
        self.inner: Relay | None = None

    def arm(self, resume: Callable[[Relay], AsyncIterator[bytes]] | None) -> None:
        """Record failures instead of ending the stream with an error; with ``resume``, also keep the transcript
        and let ``resume`` continue the answer (see the attributes)."""
        self.migrating = True
        self.resume = resume
        if resume is not None:
            self.transcript = Transcript()

    def _fail(self, reason: str, err: bytes) -> bytes | None:
        """A failure after the first byte: the error event to send now, or None when the failure is recorded
        for the continuation (``migrating``)."""
        if not self.migrating:
            self.telemetry.streams_lost.labels(reason).inc()
            return err
        self.failure = (reason, err)
        return None

    def _cut_error_event(self, out: bytes) -> tuple[bytes, bool]:
        """``out`` up to an engine error event (vLLM's ``{"error": ...}`` mid-stream) when the stream may be
        continued elsewhere, and whether there was one (then recorded as the failure)."""
        if not self.migrating:
            return out, False
        at = error_event_at(out)
        if at < 0:
            return out, False
        self.telemetry.upstream_errors.labels("error_event").inc()
        log.warning("engine sent an error event mid-stream", extra={"request_id": self.request_id})
        self.failure = ("error_event", out[at:])
        return out[:at], True

    def _sent(self, out: bytes) -> bytes:
        """``out`` is going to the client: recorded in the transcript (when kept)."""
        if self.transcript is not None and out:
            self.transcript.feed(out)
        return out

    def _bad(self, exc: BadStream) -> bytes:
        """Count and log an invalid event stream; the SSE error event that ends the client's stream."""
        self.telemetry.upstream_errors.labels("bad_stream").inc()
        log.warning(
            "engine sent an invalid event stream",
            extra={"request_id": self.request_id, "replica": self.rep.name, "error": str(exc)},
        )
        return sse_error(
            502, f"engine {self.rep.name} sent an invalid event stream: {exc}", "bad_stream", self.trace_id
        )

    def _end(self) -> bytes | None:
        """The engine's stream is over: None when it ended properly, else the SSE error event to send."""
        try:
            self.events.end()
        except BadStream as exc:
            return self._bad(exc)
        return None

    async def body(self) -> AsyncIterator[bytes]:
        """The chunks for the client; a failure after the first byte ends with an SSE error event, or (armed for
        migration, ``resume``) with the continuation of the answer on another replica.

        ``ok`` turns True before the last chunk is yielded when the engine's answer is already complete (no
        further read), so ``RelayedStream`` can send it as the end of the response (one write, not two).
        """
        try:
            async for out in self._engine_chunks():
                yield self._sent(out)
            if self.failure is not None and self.resume is not None:
                self.resp.close()  # the engine sees the connection close and aborts what is left of it
                self.hold.release()
                async for out in self.resume(self):
                    yield self._sent(out)
        finally:
            # a complete stream is finished by RelayedStream after the client got its last byte (the feedback
            # and policy update are then off the client's latency); failures and cancellations clean up here
            if not self.ok:
                await self.finish()

    async def _engine_chunks(self) -> AsyncIterator[bytes]:
        """The engine's validated chunks; a failure yields its error event, or records it (``_fail``)."""
        resp = self.resp
        if resp.at_end:  # the whole answer came with the headers
            first, cut = self._cut_error_event(self.first)
            err = None if cut else self._end()
            if not cut and err is None:
                self.ok = True
            yield first + (self._fail("bad_stream", err) or b"" if err is not None else b"")
            return
        first, cut = self._cut_error_event(self.first)
        if first:
            yield first
        if cut:
            return
        while not self.ok:
            wait, expired = self._next_wait(self.idle_timeout_s)
            if expired is not None:
                err = self._fail(*expired)
                if err is not None:
                    yield err
                return
            chunk, err = await self._read(wait)
            if err is not None:
                if err:
                    yield err
                return
            if chunk is None:
                continue
            try:
                out = self.events.feed(chunk)
            except BadStream as exc:
                yield self._fail("bad_stream", self._bad(exc)) or b""
                return
            out, cut = self._cut_error_event(out)
            if cut:
                if out:
                    yield out
                return
            if resp.at_end:
                err = self._end()
                if err is not None:
                    yield out + (self._fail("bad_stream", err) or b"")
                    return
                self.ok = True
                yield out
            elif out:
                yield out

    async def _read(self, wait: float) -> tuple[bytes | None, bytes | None]:
        """The next raw chunk (None: nothing within ``wait``, look at the limits again), or the failure: its
        error event to send (empty bytes when recorded for the continuation). The end of a complete stream sets
        ``ok``."""
        resp = self.resp
        if self.direct is not None:
            resp.attach(self._sink)  # pieces go to the client from the read callback until one is declined
        try:
            chunk = await resp.read_chunk(wait)
        except TimeoutError:
            return None, None  # the checks tell which limit passed (pieces may have flowed through the sink)
        except EngineError as exc:
            reason = "stream_broken"
            self.telemetry.upstream_errors.labels(reason).inc()
            log.warning(
                "stream failed",
                extra={
                    "request_id": self.request_id,
                    "replica": self.rep.name,
                    "error": f"{type(exc).__name__}: {exc}",
                },
            )
            err = sse_error(
                502, f"engine {self.rep.name} failed mid-stream: {type(exc).__name__}", reason, self.trace_id
            )
            return None, self._fail(reason, err) or b""
        finally:
            resp.attach(None)
        if self.bad is not None:
            return None, self._fail("bad_stream", self._bad(self.bad)) or b""
        if not chunk:
            end = self._end()
            if end is not None:
                return None, self._fail("stream_broken", end) or b""
            self.ok = True
            return None, b""
        self.last_at = time.monotonic()
        self.task_pieces += 1
        self._keep_tail(chunk)
        return chunk, None

    def _keep_tail(self, piece: bytes) -> None:
        """Append ``piece`` to the end of the raw stream kept for the final usage chunk (bounded)."""
        if self.watch is not None:
            self.watch.feed(self.rep, piece)
        tail = self.tail
        tail += piece
        if len(tail) > 2 * TAIL_BYTES:
            del tail[:-TAIL_BYTES]

    def _next_wait(self, idle: float) -> tuple[float, tuple[str, bytes] | None]:
        """How long the next read may wait (seconds: until ``total_timeout_s`` or ``idle`` seconds after the last
        piece, whichever comes first), or the reason and SSE error event (counted) when one of them has passed."""
        now = time.monotonic()
        remaining = self.deadline - now
        if remaining <= 0:
            self.telemetry.upstream_errors.labels("total_timeout").inc()
            return 0.0, (
                "total_timeout",
                sse_error(504, "stream exceeded total_timeout_s", "total_timeout", self.trace_id),
            )
        idle_left = idle - (now - self.last_at)
        if idle_left <= 0:
            self.telemetry.upstream_errors.labels("idle_timeout").inc()
            msg = f"engine {self.rep.name} sent nothing for {idle:g}s (idle_timeout_s)"
            return 0.0, ("idle_timeout", sse_error(504, msg, "idle_timeout", self.trace_id))
        return (remaining if remaining < idle_left else idle_left), None

    def _sink(self, piece: bytes) -> bool:
        """``EngineResponse.attach`` sink: validate a piece of the engine's stream and write it to the client now,
        in the engine connection's read callback (no task switch, future or ASGI message per piece). False
        (the relay loop takes the piece) when the client's connection is paused or closing, or the piece is not
        a valid event stream (``bad``). Never raises."""
        write = self.direct
        if write is None or not write.ready() or (self.migrating and b'"error"' in piece):
            return False  # (an error event the continuation replaces is the loop's to handle)
        self.last_at = time.monotonic()
        self._keep_tail(piece)
        try:
            out = self.events.feed(piece)
            if out:
                write(self._sent(out))
        except BadStream as exc:
            self.bad = exc
            return False
        except Exception as exc:  # a bug here must not break the engine connection's read callback
            log.exception("stream relay failed")
            self.bad = BadStream(f"relay failed: {type(exc).__name__}")
            return False
        self.direct_pieces += 1
        return True

    async def finish(self) -> None:
        """Release everything (idempotent; never raises)."""
        if self.finished:
            return
        self.finished = True
        try:
            pieces = self.telemetry.relayed_pieces
            if self.direct_pieces:
                pieces.labels("direct").inc(self.direct_pieces)
            if self.task_pieces:
                pieces.labels("task").inc(self.task_pieces)
            self.hold.release()
            if self.inner is not None:
                await self.inner.finish()
            # usage is fed back even when the client left right after the last chunk (a migrated stream's
            # continuation fed back its own)
            usage = usage_from_sse(bytes(self.tail)) if self.failure is None and self.fed_back else None
            if self.ok and self.failure is None and self.fed_back:
                self.feedback.check_usage(self.rep, usage, streamed=True)
            if self.fed_back and ((self.ok and self.failure is None) or usage):
                self.feedback.observe(
                    self.rep, self.routed, usage, self.ttft, self.predicted_cached, single_chunk=False
                )
            if self.ok and self.failure is None and self.watch is not None:
                await self.watch.complete(self.rep)
        except Exception:
            log.exception("stream cleanup failed")
        finally:
            if self.on_done is not None:
                self.on_done()
            if self.ok and self.failure is None:
                self.resp.release()  # fully read: the connection goes back to the pool
            else:
                self.resp.close()  # the engine sees the connection close and aborts the request


class RelayedStream(StreamingResponse):
    """A StreamingResponse over a ``Relay`` that always runs the relay's cleanup when the response ends.

    Streams in the request's own task while one small task waits for the client's ``http.disconnect`` and
    cancels the stream when the client leaves (Starlette's StreamingResponse does the same with an anyio task
    group per response, which costs more CPU than the rest of the relay). The relay's cleanup (in-flight release,
    usage / TTFT feedback, connection back to the pool) runs after the last byte was sent.
    """

    def __init__(self, relay: Relay, **kwargs: Any) -> None:
        super().__init__(relay.body(), **kwargs)
        self.relay = relay
        #: the relay's own generator: when someone replaced ``body_iterator`` to see every chunk (the idempotency
        #: guard keeps a copy of the stream), nothing may bypass it, so the direct relay stays off
        self._own_body = self.body_iterator
        #: the request's disconnect watcher, handed over by ``Proxy.forward`` (None: one is started here)
        self.watch: ClientWatch | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = self.watch or ClientWatch(receive)
        watch.arm()
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            relay = self.relay
            relay.direct = DirectWrite.of(send) if self.body_iterator is self._own_body else None
            ended = False
            async for chunk in self.body_iterator:
                if relay.ok:  # the engine's answer is complete: this chunk ends the response
                    watch.disarm()
                    ended = True
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                watch.disarm()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            watch.disarm()
            if not watch.left or not watch.uncancel():
                raise
            # our own cancellation (the client disconnected): the response is simply over
        except OSError:
            raise ClientDisconnect() from None
        finally:
            watch.stop()
            with anyio.CancelScope(shield=True):
                await self.relay.finish()
        if self.background is not None:
            await self.background()


class DirectWrite:
    """Writes relayed pieces straight onto the client's connection, as uvicorn's ``send`` would for a
    ``http.response.body`` message with ``more_body`` (one chunk of the chunked transfer encoding), for
    ``Relay._sink``. Only for uvicorn's httptools protocol (the router's server) once it has started a chunked
    response; ``of`` returns None otherwise (other servers, test clients: the relay then sends every piece
    through ``send``). The end of the response always goes through ``send`` (uvicorn's own bookkeeping)."""

    __slots__ = ("transport", "flow")

    def __init__(self, transport: Any, flow: Any) -> None:
        self.transport = transport
        self.flow = flow

    @classmethod
    def of(cls, send: Any) -> DirectWrite | None:
        """The direct writer behind ``send`` (after ``http.response.start``), or None when there is none. A wrapper
        that changes only the response head may expose the server's own send as ``server_send`` (the workers'
        ``WorkerApp`` does)."""
        cycle = getattr(getattr(send, "server_send", send), "__self__", None)
        if (
            not isinstance(cycle, HttpToolsCycle)
            or cycle.chunked_encoding is not True
            or cycle.response_complete
            or cycle.scope.get("method") == "HEAD"
        ):
            return None
        return cls(cycle.transport, cycle.flow)

    def ready(self) -> bool:
        """The client's connection takes writes now (not paused by flow control, not closing)."""
        return not self.flow.write_paused and not self.transport.is_closing()

    def __call__(self, data: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))


class ClientWatch:
    """One small task per request waiting for the client's ``http.disconnect`` (the body was already read).

    While armed it cancels the task it watches over (the request's own task) when the client leaves: before
    the answer starts that cancels the upstream attempt, mid-stream it stops the relay. ``Proxy.forward`` hands
    the same watcher to the stream, so a request costs one extra task, not one per phase.
    """

    __slots__ = ("task", "left", "armed", "_waiter")

    def __init__(self, receive: Callable[[], Any]) -> None:
        self.task = asyncio.current_task()
        self.left = False
        self.armed = True
        self._waiter = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                break
        self.left = True
        if self.armed and self.task is not None:
            self.task.cancel()

    def arm(self) -> None:
        """Watch over the current task (cancel it when the client leaves)."""
        self.task = asyncio.current_task()
        self.armed = True
        if self.left and self.task is not None:
            self.task.cancel()  # left while nobody was armed

    def disarm(self) -> ClientWatch:
        """Stop cancelling (the answer is complete or being handed over); returns self."""
        self.armed = False
        return self

    def uncancel(self) -> bool:
        """Undo the cancellation this watcher caused; True when no other cancellation is pending."""
        return self.task is not None and self.task.uncancel() == 0

    def stop(self) -> None:
        """End the watcher task."""
        self.armed = False
        self._waiter.cancel()
