"""OTLP trace export without the OpenTelemetry SDK's encoder: the router's recorded spans written straight to the
protobuf wire format of ``ExportTraceServiceRequest`` (opentelemetry-proto ``collector/trace/v1``), and sent by the
SDK's own OTLP transports (gRPC or HTTP, so every ``OTEL_EXPORTER_OTLP_*`` variable still applies).

Why: the SDK's exporter builds one Python protobuf message per span, attribute, value and event, ~2 us per
attribute and ~10 us per span; this encoder writes bytes (cached key fields, one join per span) at a fraction of
that (docs/benchmarks.md "Tracing overhead"). An error status's message is cut at 500 characters. The spans it writes are those of ``router.tracing.Span`` only (ids,
name, kind, two times, attributes of str / bool / int / float or a sequence of them, named events, a status), the
same fields, values and flags the SDK's encoder writes for them (tests/unit/test_otlp_encoder.py decodes the bytes
with the generated classes and compares).

Wire format (proto3): a field is a varint key ``(number << 3) | wire type`` then its value: varint (0), fixed64
(1), length-delimited bytes (2), fixed32 (5). Units: nanoseconds since the epoch for times, bytes for sizes.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any, Protocol

log = logging.getLogger("kvroute.tracing")

#: OTLP ``Span.SpanKind``
KINDS = {"internal": 1, "server": 2, "client": 3}
#: OTLP ``Status.StatusCode``
STATUS_ERROR = 2
#: OTLP ``SpanFlags``: the span's parent context says whether it is remote (set on every span, as the SDK does)
FLAG_HAS_IS_REMOTE = 0x100
FLAG_IS_REMOTE = 0x200

_PACK_F64 = struct.Struct("<d").pack
_PACK_U64 = struct.Struct("<Q").pack
_PACK_U32 = struct.Struct("<I").pack
_MASK_64 = (1 << 64) - 1
#: one-byte varints, precomputed
_SMALL = [bytes((i,)) for i in range(128)]


class EncodedSpan(Protocol):
    """What the encoder reads of a recorded span (``router.tracing.Span``)."""

    name: str
    kind: str
    span_id: int
    parent_id: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]
    error: str | None

    @property
    def trace_id(self) -> int: ...

    @property
    def remote_parent(self) -> bool: ...


def varint(n: int) -> bytes:
    """``n`` (0 <= n < 2**64; a negative int64 as its two's complement) as a protobuf varint."""
    if 0 <= n < 128:
        return _SMALL[n]
    n &= _MASK_64
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a message, a string or bytes."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def string_field(number: int, text: str) -> bytes:
    return field(number, text.encode("utf-8"))


def any_value(value: Any) -> bytes:
    """An ``AnyValue`` message's body: a string, bool, int64, double, or an array of them (anything else: its
    ``str``)."""
    if isinstance(value, str):
        return string_field(1, value)
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _PACK_F64(value)
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return field(5, b"".join(field(1, any_value(v)) for v in value))
    return string_field(1, str(value))


class Encoder:
    """Writes batches of recorded spans as one ``ExportTraceServiceRequest``.

    Args:
        resource: the resource's attributes (``service.name`` and the SDK's ``telemetry.sdk.*``).
        scope: the instrumentation scope's name.
    """

    def __init__(self, resource: dict[str, Any], scope: str) -> None:
        #: an attribute key's ``KeyValue.key`` field, cached (a fleet's spans use a few dozen keys)
        self._keys: dict[str, bytes] = {}
        #: ``ResourceSpans.resource`` (field 1), written once
        self._resource = field(1, self.attributes(resource, 1))
        #: ``ScopeSpans.scope`` (field 1), written once
        self._scope = field(1, string_field(1, scope))

    def key_value(self, key: str, value: Any) -> bytes:
        """A ``KeyValue`` message's body."""
        head = self._keys.get(key)
        if head is None:
            head = self._keys[key] = string_field(1, key)
        return head + field(2, any_value(value))

    def attributes(self, attributes: dict[str, Any], number: int) -> bytes:
        """Repeated ``KeyValue`` fields numbered ``number`` (``None`` values left out, as the SDK drops them)."""
        return b"".join(field(number, self.key_value(k, v)) for k, v in attributes.items() if v is not None)

    def span(self, span: EncodedSpan) -> bytes:
        """A ``Span`` message's body."""
        parts = [
            b"\x0a\x10" + span.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + span.span_id.to_bytes(8, "big"),
        ]
        if span.parent_id:
            parts.append(b"\x22\x08" + span.parent_id.to_bytes(8, "big"))
        parts += [
            string_field(5, span.name),
            b"\x30" + _SMALL[KINDS[span.kind]],
            b"\x39" + _PACK_U64(span.start_ns),
            b"\x41" + _PACK_U64(span.end_ns),
            self.attributes(span.attributes, 9),
        ]
        for name, ns in span.events:
            parts.append(field(11, b"\x09" + _PACK_U64(ns) + string_field(2, name)))
        if span.error is not None:
            status = (
                (string_field(2, span.error[:500]) if span.error else b"") + b"\x18" + _SMALL[STATUS_ERROR]
            )
            parts.append(field(15, status))
        else:
            parts.append(b"\x7a\x00")  # an empty Status (UNSET), as the SDK writes it
        flags = FLAG_HAS_IS_REMOTE | (FLAG_IS_REMOTE if span.remote_parent else 0)
        parts.append(b"\x85\x01" + _PACK_U32(flags))
        return b"".join(parts)

    def request(self, spans: Iterable[EncodedSpan]) -> bytes:
        """The ``ExportTraceServiceRequest`` of ``spans`` (one resource, one scope; no span: an empty request)."""
        body = b"".join(field(2, self.span(s)) for s in spans)
        if not body:
            return b""
        scope_spans = field(2, self._scope + body)
        return field(1, self._resource + scope_spans)


def _raw_trace_stub(channel: Any) -> Any:
    """A ``TraceService`` stub whose ``Export`` sends already encoded bytes (no request serializer)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    export = channel.unary_unary(
        "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
        request_serializer=None,
        response_deserializer=ExportTraceServiceResponse.FromString,
        _registered_method=True,
    )
    return SimpleNamespace(Export=export)


def grpc_exporter(endpoint: str, encoder: Encoder) -> Any:
    """The SDK's OTLP/gRPC span exporter (channel, credentials, headers, retries, compression from the
    ``OTEL_EXPORTER_OTLP_*`` variables) sending ``encoder``'s bytes instead of the SDK's encoding."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class BytesGrpcExporter(OTLPSpanExporter):
        def _initialize_channel_and_stub(self) -> None:
            super()._initialize_channel_and_stub()  # type: ignore[no-untyped-call]
            self._client = _raw_trace_stub(self._channel)

        def _translate_data(self, data: Sequence[EncodedSpan]) -> bytes:  # type: ignore[override]
            return encoder.request(data)

    return BytesGrpcExporter(endpoint=endpoint)


def http_exporter(endpoint: str, encoder: Encoder) -> Any:
    """The SDK's OTLP/HTTP protobuf span exporter (session, certificates, headers, compression, retries from the
    ``OTEL_EXPORTER_OTLP_*`` variables) sending ``encoder``'s bytes instead of the SDK's encoding."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class BytesHttpExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[EncodedSpan]) -> Any:  # type: ignore[override]
            if self._shutdown:
                return SpanExportResult.FAILURE
            try:
                data = encoder.request(spans)
            except Exception:  # an unencodable span must not stop the export thread
                log.exception("tracing: encoding a batch of %d spans failed", len(spans))
                return SpanExportResult.FAILURE
            if 0 < self._max_request_size < len(data):
                log.warning("tracing: dropped a batch of %d bytes (over the exporter's limit)", len(data))
                return SpanExportResult.FAILURE
            result = self._client.export(data)
            return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE

    return BytesHttpExporter(endpoint=endpoint)
