"""router/otlp.py writes the router's spans as OTLP protobuf by hand: its bytes, decoded with opentelemetry-proto's
generated classes, equal what the OpenTelemetry SDK's own encoder makes of the same spans (as ``ReadableSpan`` s),
field for field: ids, parent, remote flags, kind, times, every attribute type, events, status."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from router.otlp import Encoder, varint
from router.tracing import RequestTrace, Span, failed

_KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}


class _Collect:
    """Stands where ``Tracing`` does for a trace: keeps the spans that end."""

    def __init__(self) -> None:
        self.ended: list[Span] = []

    def emit(self, span: Span) -> None:
        self.ended.append(span)


def _readable(span: Span, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The span as the SDK's exporter would have got it."""
    trace = span.trace
    flags = TraceFlags(TraceFlags.SAMPLED)
    parent = (
        SpanContext(trace.trace_id, span.parent_id, span.parent_id == trace.caller_span, flags)
        if span.parent_id
        else None
    )
    status = Status(StatusCode.UNSET) if span.error is None else Status(StatusCode.ERROR, span.error[:500])
    return ReadableSpan(
        span.name,
        SpanContext(trace.trace_id, span.span_id, False, flags),
        parent,
        resource,
        span.attributes,
        [Event(name, None, ns) for name, ns in span.events],
        (),
        _KINDS[span.kind],
        None,
        status,
        span.start_ns,
        span.end_ns,
        scope,
    )


def _spans(caller_span: int) -> list[Span]:
    """A request's spans with every attribute type and shape the router writes."""
    sink = _Collect()
    trace = RequestTrace(sink, 0x4BF92F3577B34DA6A3CE929D0E0E4736, caller_span, True, None)  # type: ignore[arg-type]
    root = trace.root = Span(
        trace, "kvroute.request", "server", caller_span, {"http.route": "/v1/completions"}
    )
    with trace.step("kvroute.decide") as decide:
        assert decide is not None
        decide.set_attributes(
            {
                "kvroute.replica": "r1 é ünïcode",
                "kvroute.candidates": 3,
                "kvroute.predicted.Q": 0.125,
                "kvroute.session_pinned": True,
                "kvroute.estimated": False,
                "kvroute.big": 1 << 62,
                "kvroute.negative": -7,
                "kvroute.zero": 0,
                "kvroute.many": ["a", "b"],
                "kvroute.long": "x" * 300,
            }
        )
    attempt = trace.child("kvroute.attempt", {"kvroute.attempt": 1}, client=True)
    assert attempt is not None
    attempt.add_event("first_byte")
    attempt.set_error("connect refused " * 50)
    attempt.end()
    with pytest.raises(ValueError), trace.step("kvroute.admission"):
        raise ValueError("")
    failed(root, RuntimeError("boom"))
    trace.respond(503)
    trace.done()
    return sink.ended


def test_bytes_decode_to_what_the_sdk_encodes() -> None:
    resource = Resource.create({"service.name": "kvroute-test"})
    scope = InstrumentationScope("kvroute")
    encoder = Encoder(dict(resource.attributes), "kvroute")
    for caller in (0x00F067AA0BA902B7, 0):
        spans = _spans(caller)
        assert len(spans) == 4
        ours = ExportTraceServiceRequest.FromString(encoder.request(spans))
        sdk: Any = encode_spans([_readable(s, resource, scope) for s in spans])
        assert ours == sdk
        # the message equality above covers these; spelled out so a failure says which
        got = ours.resource_spans[0].scope_spans[0].spans
        assert [s.name for s in got] == [s.name for s in sdk.resource_spans[0].scope_spans[0].spans]
        assert ours.SerializeToString(deterministic=True) == sdk.SerializeToString(deterministic=True)


def test_an_empty_batch_and_varints() -> None:
    encoder = Encoder({"service.name": "s"}, "kvroute")
    assert ExportTraceServiceRequest.FromString(encoder.request([])) == encode_spans([])
    assert varint(0) == b"\x00"
    assert varint(300) == b"\xac\x02"
    assert varint(-1) == b"\xff" * 9 + b"\x01"


def test_cached_pairs_give_the_same_bytes(monkeypatch: Any) -> None:
    """String and bool attributes are cached as encoded pairs: the bytes are the same on a cache hit, and after
    the cache was emptied because it was full."""
    encoder = Encoder({"service.name": "s"}, "kvroute")
    spans = _spans(0x00F067AA0BA902B7)
    first = encoder.request(spans)
    assert encoder.request(spans) == first
    monkeypatch.setattr("router.otlp.PAIR_CACHE", 2)
    small = Encoder({"service.name": "s"}, "kvroute")
    assert small.request(spans) == first and small.request(spans) == first
