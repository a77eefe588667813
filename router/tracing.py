"""Distributed tracing: OpenTelemetry spans of the serving pipeline's steps, and W3C trace context to the engines.

Off unless ``otlp_traces_endpoint`` is set: then no OpenTelemetry SDK or exporter is imported,
``Pipeline.tracing`` is None and a request carries no trace (one attribute test per step, no object allocated per
request), except a request that came with a caller's ``traceparent``: its ``PassedTrace`` hands the caller's trace
context on to the engines unchanged (the router transparent), recording nothing.

On, each request the pipeline prepares gets a ``RequestTrace``: its span ``kvroute.request`` (SERVER) continues
the caller's W3C ``traceparent`` / ``tracestate`` (from the client on the HTTP door, from the gateway on the
endpoint picker), and every step of the pipeline is a child span of it (the span catalog is in
docs/observability.md):

* ``kvroute.intake`` (parse, identify), ``kvroute.tokenize``, ``kvroute.admission``, ``kvroute.decide`` (the
  chosen replica, its predicted cached tokens and TTFT terms, the best alternative's predicted TTFT, reuse);
* ``kvroute.attempt`` (CLIENT): one per engine attempt, ended when the hold on the replica is released (the
  answer ended, or the attempt failed); ``kvroute.pd.prefill`` / ``kvroute.pd.decode`` (CLIENT): the legs of a
  disaggregated plan.

The engine request of an attempt or a leg carries a ``traceparent`` whose parent is that span (``headers``), so
an engine started with ``--otlp-traces-endpoint`` (vLLM's ``llm_request`` span) lands in the same trace under it;
the client's ``baggage`` goes on unchanged.

Trace ids to users: a request with a trace id (tracing on: its trace, sampled or not; off: the trace of a valid
``traceparent`` its caller sent) names it in its log lines (``router.telemetry.bind_trace_id``: uvicorn's access line
and the router's own), in the ``x-kvroute-trace-id`` response header and in ``error.trace_id`` of an error body, so
a user's bug report leads to the trace. Off and without a caller's ``traceparent`` nothing is added.

Sampling is parent-based: a caller's ``traceparent`` decides (sampled flag), a request without one is sampled
with probability ``trace_sample_ratio``. An unsampled request allocates its root span only (a non-recording
one): no child span is made, and the engines get the root's context (not sampled) so they do not sample either.

Spans leave in batches (OpenTelemetry's ``BatchSpanProcessor``; ``OTEL_BSP_SCHEDULE_DELAY`` etc. honoured) over
OTLP/gRPC (default) or OTLP/HTTP protobuf (``otlp_traces_protocol``); the exporters honour the standard
``OTEL_EXPORTER_OTLP_*`` variables (headers, certificates, timeout, compression).

Cost: a request's spans are recorded in plain objects (``Span``: ids, times, a dict of attributes) and handed to
the batch processor as they are when each ends; its thread writes them to OTLP protobuf with router/otlp.py's
encoder (the SDK's live spans, and its encoder's one message per attribute, would cost several times more per
request: docs/benchmarks.md "Tracing overhead"). Sampling is the SDK's ``ParentBased(TraceIdRatioBased(ratio))`` rule,
applied here once per request; ``traceparent`` is parsed and written as the W3C format says.

Units: seconds, tokens.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from router.otlp import Encoder, grpc_exporter, http_exporter
from router.telemetry import bind_trace_id

log = logging.getLogger("kvroute.tracing")

#: the W3C trace-context headers, lower case
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
BAGGAGE = "baggage"
#: the headers the router sets on the requests it sends (a caller's own are replaced)
TRACE_HEADERS: tuple[str, ...] = (TRACEPARENT, TRACESTATE)
#: a caller's trace context, passed on unchanged when tracing is off
TRACE_CONTEXT_HEADERS: tuple[str, ...] = (TRACEPARENT, TRACESTATE, BAGGAGE)


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Tracing settings (from ``Settings``; no defaults here).

    Attributes:
        endpoint: the OTLP collector (gRPC ``http://host:4317``, HTTP ``http://host:4318/v1/traces``).
        protocol: ``grpc`` or ``http/protobuf``.
        sample_ratio: probability a request without a caller's decision is sampled, 0..1.
        service_name: the ``service.name`` resource attribute.
    """

    endpoint: str
    protocol: str
    sample_ratio: float
    service_name: str


#: W3C traceparent: version, trace id, parent id, flags (what OpenTelemetry's propagator accepts)
_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")
#: the low 64 bits of a trace id decide ratio sampling (OpenTelemetry's TraceIdRatioBased)
_TRACE_ID_LIMIT = (1 << 64) - 1


class Tracing:
    """The exporter, the batch processor and the sampling rule (built only when tracing is on).

    Args:
        cfg: endpoint, protocol, sampling ratio, service name.
    """

    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.cfg = cfg
        resource = Resource.create({"service.name": cfg.service_name})
        self.encoder = Encoder(dict(resource.attributes), "kvroute")
        #: OpenTelemetry's batch processor (its queue, thread and ``OTEL_BSP_*`` variables) over ``Span`` s
        self.processor: Any = BatchSpanProcessor(_exporter(cfg, self.encoder))
        #: a trace id whose low 64 bits are under this is sampled (requests without a caller's decision)
        self.bound = round(cfg.sample_ratio * (_TRACE_ID_LIMIT + 1))

    def request(self, headers: Mapping[str, str], route: str) -> RequestTrace:
        """The trace of a request arriving with ``headers`` (its caller's trace context continued when valid) on
        ``route``; sampled as its caller says, else with probability ``sample_ratio``."""
        parent = _caller(headers.get(TRACEPARENT))
        if parent is not None:
            trace_id, caller_span, sampled = parent
        else:
            trace_id = random.getrandbits(128) or 1
            caller_span, sampled = 0, (trace_id & _TRACE_ID_LIMIT) < self.bound
        trace = RequestTrace(self, trace_id, caller_span, sampled, headers.get(BAGGAGE))
        bind_trace_id(trace.trace_hex)
        if parent is not None:
            trace.state = headers.get(TRACESTATE)
        if sampled:
            trace.root = Span(trace, "kvroute.request", "server", caller_span, {"http.route": route})
        return trace

    def emit(self, span: Span) -> None:
        """Hand an ended span to the batch processor (the exporter's thread encodes it: router/otlp.py)."""
        self.processor.on_end(span)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter."""
        try:
            self.processor.shutdown()
        except Exception:  # a collector gone at shutdown must not fail the router's stop
            log.warning("tracing: export at shutdown failed", exc_info=True)


def caller_trace_id(header: str | None) -> str | None:
    """The trace id (32 hex digits) of a caller's ``traceparent`` header; None when absent or invalid."""
    parent = _caller(header)
    return None if parent is None else f"{parent[0]:032x}"


def _caller(header: str | None) -> tuple[int, int, bool] | None:
    """A valid W3C ``traceparent``'s trace id, parent span id and sampled flag; None when absent or invalid (an
    invalid one is ignored, as the W3C format says: the request starts a new trace)."""
    if not header:
        return None
    m = _TRACEPARENT.match(header)
    if m is None:
        return None
    version, trace, span, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


def _exporter(cfg: TracingConfig, encoder: Encoder) -> Any:
    """The OTLP span exporter for ``cfg.protocol``, writing spans with ``encoder``."""
    if cfg.protocol == "http/protobuf":
        return http_exporter(cfg.endpoint, encoder)
    return grpc_exporter(cfg.endpoint, encoder)


class _Sampled:
    """What OpenTelemetry's batch processor reads of an ended span before queueing it
    (``span.context.trace_flags.sampled``): every recorded span is sampled."""

    sampled = True

    @property
    def trace_flags(self) -> _Sampled:
        return self


class Span:
    """One recorded span of a sampled request: its id, parent, kind, times (ns), attributes, events and error;
    exported when it ends (at most once). The methods are OpenTelemetry's span methods the router uses."""

    __slots__ = (
        "trace",
        "name",
        "kind",
        "span_id",
        "parent_id",
        "start_ns",
        "attributes",
        "events",
        "error",
        "ended",
        "end_ns",
    )

    #: for OpenTelemetry's batch processor (it queues sampled spans only)
    context = _Sampled()

    def __init__(
        self, trace: RequestTrace, name: str, kind: str, parent_id: int, attributes: dict[str, Any] | None
    ) -> None:
        self.trace = trace
        self.name = name
        #: ``server``, ``client`` or ``internal``
        self.kind = kind
        self.span_id = random.getrandbits(64) or 1
        self.parent_id = parent_id
        self.start_ns = time.time_ns()
        self.attributes: dict[str, Any] = attributes if attributes is not None else {}
        self.events: list[tuple[str, int]] = []
        self.error: str | None = None
        self.ended = False
        self.end_ns = 0

    @property
    def trace_id(self) -> int:
        return self.trace.trace_id

    @property
    def remote_parent(self) -> bool:
        """The span's parent is the caller's span (another process's)."""
        return self.parent_id != 0 and self.parent_id == self.trace.caller_span

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str) -> None:
        self.events.append((name, time.time_ns()))

    def set_error(self, message: str) -> None:
        """The span's status: an error, with ``message``."""
        self.error = message

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.end_ns = time.time_ns()
            self.trace.tracing.emit(self)


class RequestTrace:
    """One request's trace: its root span and the child spans of the pipeline's steps.

    Spans are recorded only when the request is sampled (``recording``); every method works either way.
    ``respond`` and ``done`` both end the root span (whichever comes last: the answer's status is known when
    the response starts, the request is over when it ends); ``fail`` ends it at once with an error.
    """

    __slots__ = (
        "tracing",
        "trace_id",
        "caller_span",
        "recording",
        "baggage",
        "state",
        "root",
        "span_id",
        "_status",
        "_done",
    )

    def __init__(
        self, tracing: Tracing, trace_id: int, caller_span: int, sampled: bool, baggage: str | None
    ) -> None:
        self.tracing = tracing
        self.trace_id = trace_id
        #: the caller's span id (0: the request started the trace)
        self.caller_span = caller_span
        self.recording = sampled
        #: the caller's ``baggage`` and ``tracestate`` headers, forwarded unchanged to the engines
        self.baggage = baggage
        self.state: str | None = None
        self.root: Span | None = None
        #: the id engines get as their parent when the request is not sampled (no span is recorded)
        self.span_id = 0
        self._status: int | None = None
        self._done = False

    def child(
        self, name: str, attributes: Mapping[str, Any] | None = None, *, client: bool = False
    ) -> Span | None:
        """A started child span of the request (None when the request is not sampled); the caller ends it."""
        root = self.root
        if root is None:
            return None
        return Span(self, name, "client" if client else "internal", root.span_id, dict(attributes or {}))

    @property
    def trace_hex(self) -> str:
        """The trace id as 32 hex digits (empty: none, a caller's invalid ``traceparent`` passed on)."""
        return f"{self.trace_id:032x}" if self.trace_id else ""

    @contextmanager
    def step(self, name: str) -> Iterator[Span | None]:
        """A child span around a pipeline step (None inside when not sampled); an exception leaving the step is
        recorded on it as its error."""
        span = self.child(name)
        if span is None:
            yield None
            return
        try:
            yield span
        except BaseException as exc:
            failed(span, exc)
            raise
        finally:
            span.end()

    def headers(self, span: Span | None) -> dict[str, str]:
        """The trace-context headers of an engine request whose parent is ``span`` (None: the request's root;
        not sampled: a span id of the router's, marked not sampled)."""
        if span is not None:
            parent_id = span.span_id
        elif self.root is not None:
            parent_id = self.root.span_id
        else:
            parent_id = self.span_id = self.span_id or random.getrandbits(64) or 1
        flags = "01" if self.recording else "00"
        out = {TRACEPARENT: f"00-{self.trace_id:032x}-{parent_id:016x}-{flags}"}
        if self.state:
            out[TRACESTATE] = self.state
        if self.baggage:
            out[BAGGAGE] = self.baggage
        return out

    def set(self, key: str, value: Any) -> None:
        """An attribute of the request's span."""
        if self.root is not None:
            self.root.attributes[key] = value

    def set_many(self, attributes: Mapping[str, Any]) -> None:
        """Attributes of the request's span, at once."""
        if self.root is not None:
            self.root.attributes.update(attributes)

    def respond(self, status: int) -> None:
        """The answer's HTTP status (an error status >= 500 marks the span); ends the span if the request is
        already over."""
        self._status = status
        root = self.root
        if root is not None and not root.ended:
            root.attributes["http.response.status_code"] = status
            if status >= 500:
                root.error = f"HTTP {status}"
        if self._done:
            self._end()

    def done(self) -> None:
        """The request is over (the answer ended); ends the span if its status is known."""
        self._done = True
        if self._status is not None:
            self._end()

    def close(self) -> None:
        """The request is over, its status known or not (a stream the gateway ended): the span ended."""
        self._done = True
        self._end()

    def fail(self, exc: BaseException) -> None:
        """The request ended with ``exc`` (a refusal or a failure): recorded, the span ended."""
        root = self.root
        if root is None or root.ended:
            return
        status = getattr(exc, "status", None)
        if isinstance(status, int):
            root.attributes["http.response.status_code"] = status
        code = getattr(exc, "code", None)
        if code is not None:
            root.attributes["kvroute.error.code"] = str(code)
        failed(root, exc)
        root.end()

    def _end(self) -> None:
        if self.root is not None:
            self.root.end()


class PassedTrace(RequestTrace):
    """Tracing off: a caller's W3C trace context (``traceparent``, ``tracestate``, ``baggage``) passed on unchanged
    to every engine request of the request (the proxied one, both PD legs, retries, the engine ``/tokenize``
    call), so the router is transparent to the caller's tracing. Records nothing: no span, no attribute.

    Args:
        headers: the request's headers (a ``traceparent`` among them).
    """

    __slots__ = ("_passed",)

    def __init__(
        self, headers: Mapping[str, str]
    ) -> None:  # no Tracing: RequestTrace's span methods are unused
        self.recording = False
        self.root = None
        self._status = None
        self._done = False
        self._passed = {k: v for k in TRACE_CONTEXT_HEADERS if (v := headers.get(k))}
        parent = _caller(headers.get(TRACEPARENT))
        self.trace_id = 0 if parent is None else parent[0]
        if parent is not None:
            bind_trace_id(self.trace_hex)

    def headers(self, span: Span | None) -> dict[str, str]:
        """The caller's trace-context headers, as they came."""
        return self._passed


def request_trace(tracing: Tracing | None, headers: Mapping[str, str], route: str) -> RequestTrace | None:
    """The trace of a request arriving with ``headers`` on ``route``: tracing on, its ``RequestTrace``; off, the
    caller's trace context to pass on (``PassedTrace``), or None when it has none (nothing allocated). Its trace id,
    when it has one, is bound to the task serving it (``router.telemetry.bind_trace_id``)."""
    if tracing is not None:
        return tracing.request(headers, route)
    if TRACEPARENT not in headers:
        return None
    return PassedTrace(headers)


def failed(span: Span, exc: BaseException) -> None:
    """Record ``exc`` on ``span`` as its error status (the message; ``error.type``: the exception's type)."""
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    span.attributes["error.type"] = type(exc).__name__
    span.error = str(message)


def attempt_failed(span: Span | None, reason: str, message: str) -> None:
    """Record a failed engine attempt or leg on its span (None: not sampled): the reason and the message."""
    if span is None:
        return
    span.attributes["kvroute.attempt.failure"] = reason
    span.attributes["error.type"] = reason
    span.error = message


def first_byte(span: Span, status: int, ttft_s: float) -> None:
    """The engine's first byte on an attempt's or a leg's span: its HTTP status and the seconds since it was
    sent (the true TTFT the decision predicted)."""
    span.attributes["http.response.status_code"] = status
    span.attributes["kvroute.ttft_s"] = ttft_s
    span.add_event("first_byte")


def build_tracing(cfg: TracingConfig | None) -> Tracing | None:
    """The tracing of the router (None: off, no SDK imported)."""
    if cfg is None:
        return None
    tracing = Tracing(cfg)
    log.info(
        "tracing on",
        extra={"endpoint": cfg.endpoint, "protocol": cfg.protocol, "sample_ratio": cfg.sample_ratio},
    )
    return tracing
