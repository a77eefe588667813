"""Distributed tracing: OpenTelemetry spans of the serving pipeline's steps, and W3C trace context to the engines.

Off unless ``otlp_traces_endpoint`` is set: then no OpenTelemetry SDK or exporter is imported,
``Pipeline.tracing`` is None and no request carries a trace (one attribute test per step, no object allocated per
request).

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

Sampling is parent-based: a caller's ``traceparent`` decides (sampled flag), a request without one is sampled
with probability ``trace_sample_ratio``. An unsampled request allocates its root span only (a non-recording
one): no child span is made, and the engines get the root's context (not sampled) so they do not sample either.

Spans leave in batches (OpenTelemetry's ``BatchSpanProcessor``; ``OTEL_BSP_SCHEDULE_DELAY`` etc. honoured) over
OTLP/gRPC (default) or OTLP/HTTP protobuf (``otlp_traces_protocol``); the exporters honour the standard
``OTEL_EXPORTER_OTLP_*`` variables (headers, certificates, timeout, compression).

Units: seconds, tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvroute.tracing")

#: the W3C trace-context headers, lower case
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
BAGGAGE = "baggage"
#: the headers the router sets on the requests it sends (a caller's own are replaced)
TRACE_HEADERS: tuple[str, ...] = (TRACEPARENT, TRACESTATE)


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


class Tracing:
    """The tracer provider and its OTLP exporter (built only when tracing is on).

    Args:
        cfg: endpoint, protocol, sampling ratio, service name.
    """

    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.cfg = cfg
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
        )
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(cfg)))
        self.tracer = self.provider.get_tracer("kvroute")
        self.propagator = TraceContextTextMapPropagator()
        self.set_span_in_context = set_span_in_context
        self.server, self.client, self.internal = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL

    def request(self, headers: Mapping[str, str], route: str) -> RequestTrace:
        """The trace of a request arriving with ``headers`` (its caller's trace context continued) on ``route``."""
        parent = self.propagator.extract(headers) if headers.get(TRACEPARENT) else None
        span = self.tracer.start_span(
            "kvroute.request", context=parent, kind=self.server, attributes={"http.route": route}
        )
        return RequestTrace(self, span, headers.get(BAGGAGE))

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter."""
        try:
            self.provider.shutdown()
        except Exception:  # a collector gone at shutdown must not fail the router's stop
            log.warning("tracing: export at shutdown failed", exc_info=True)


def _exporter(cfg: TracingConfig) -> Any:
    """The OTLP span exporter for ``cfg.protocol``."""
    if cfg.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=cfg.endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter(endpoint=cfg.endpoint)


def traceparent_of(span: Any) -> str:
    """The W3C ``traceparent`` naming ``span`` as the parent: version 00, trace id, span id, flags."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class RequestTrace:
    """One request's trace: its root span and the child spans of the pipeline's steps.

    Child spans are made only when the request is sampled (``recording``); every method works either way.
    ``respond`` and ``done`` both end the root span (whichever comes last: the answer's status is known when
    the response starts, the request is over when it ends); ``fail`` ends it at once with an error.
    """

    __slots__ = ("tracing", "span", "recording", "baggage", "_status", "_done", "_ended", "_parent")

    def __init__(self, tracing: Tracing, span: Any, baggage: str | None) -> None:
        self.tracing = tracing
        self.span = span
        self.recording: bool = span.is_recording()
        #: the caller's ``baggage`` header, forwarded unchanged to the engines
        self.baggage = baggage
        self._status: int | None = None
        self._done = False
        self._ended = False
        self._parent: Any = None  # the root span as an OpenTelemetry context (made on first use)

    @property
    def trace_id(self) -> str:
        """The trace id, 32 hex digits."""
        return f"{self.span.get_span_context().trace_id:032x}"

    def child(self, name: str, attributes: Mapping[str, Any] | None = None, *, client: bool = False) -> Any:
        """A started child span of the request (None when the request is not sampled); the caller ends it."""
        if not self.recording:
            return None
        tracing = self.tracing
        if self._parent is None:
            self._parent = tracing.set_span_in_context(self.span)
        return tracing.tracer.start_span(
            name,
            context=self._parent,
            kind=tracing.client if client else tracing.internal,
            attributes=attributes,
        )

    @contextmanager
    def step(self, name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """A child span around a pipeline step (None inside when not sampled); an exception leaving the step is
        recorded on it as its error."""
        span = self.child(name, attributes)
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

    def headers(self, span: Any) -> dict[str, str]:
        """The trace-context headers of an engine request whose parent is ``span`` (None: the request's root,
        e.g. when not sampled)."""
        target = span if span is not None else self.span
        out = {TRACEPARENT: traceparent_of(target)}
        state = target.get_span_context().trace_state
        if state:
            out[TRACESTATE] = state.to_header()
        if self.baggage:
            out[BAGGAGE] = self.baggage
        return out

    def set(self, key: str, value: Any) -> None:
        """An attribute of the request's span."""
        if self.recording and not self._ended:
            self.span.set_attribute(key, value)

    def set_many(self, attributes: Mapping[str, Any]) -> None:
        """Attributes of the request's span, at once."""
        if self.recording and not self._ended:
            self.span.set_attributes(attributes)

    def respond(self, status: int) -> None:
        """The answer's HTTP status (an error status >= 500 marks the span); ends the span if the request is
        already over."""
        self._status = status
        self.set("http.response.status_code", status)
        if status >= 500 and self.recording and not self._ended:
            self.span.set_status(_error_status(f"HTTP {status}"))
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
        if self._ended:
            return
        status = getattr(exc, "status", None)
        if isinstance(status, int):
            self.set("http.response.status_code", status)
        code = getattr(exc, "code", None)
        if code is not None:
            self.set("kvroute.error.code", str(code))
        if self.recording:
            failed(self.span, exc)
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self.span.end()


def failed(span: Any, exc: BaseException) -> None:
    """Record ``exc`` on ``span`` as its error status (the message; the exception's type as an event)."""
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    span.set_attribute("error.type", type(exc).__name__)
    span.set_status(_error_status(message))


def _error_status(message: str) -> Any:
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR, message[:500])


def attempt_failed(span: Any, reason: str, message: str) -> None:
    """Record a failed engine attempt or leg on its span (None: not sampled): the reason and the message."""
    if span is None:
        return
    span.set_attribute("kvroute.attempt.failure", reason)
    span.set_attribute("error.type", reason)
    span.set_status(_error_status(message))


def first_byte(span: Any, status: int, ttft_s: float) -> None:
    """The engine's first byte on an attempt's or a leg's span: its HTTP status and the seconds since it was
    sent (the true TTFT the decision predicted)."""
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("kvroute.ttft_s", ttft_s)
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
