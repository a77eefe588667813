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


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its key (``tag``), the payload's length, the payload."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else varint(n)) + payload


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) numbered ``number``: a message, a string or bytes."""
    return _ld(varint(number << 3 | 2), payload)


def string_field(number: int, text: str) -> bytes:
    return field(number, text.encode("utf-8"))


def any_value(value: Any) -> bytes:
    """An ``AnyValue`` message's body: a string, bool, int64, double, or an array of them (anything else: its
    ``str``)."""
    if isinstance(value, str):
        return _ld(b"\x0a", value.encode("utf-8"))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _PACK_F64(value)
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return _ld(b"\x2a", b"".join(_ld(b"\x0a", any_value(v)) for v in value))
    return _ld(b"\x0a", str(value).encode("utf-8"))


#: encoded ``KeyValue`` s of string and bool attributes kept for reuse (model, replica, policy, route: few
#: values); the cache is emptied when it reaches this many (a request id never repeats)
PAIR_CACHE = 4096
#: a span's fields, keys and tags (field number << 3 | wire type)
_SPAN_ATTRIBUTE, _RESOURCE_ATTRIBUTE, _KV_VALUE = b"\x4a", b"\x0a", b"\x12"


class Encoder:
    """Writes batches of recorded spans as one ``ExportTraceServiceRequest``.

    Args:
        resource: the resource's attributes (``service.name`` and the SDK's ``telemetry.sdk.*``).
        scope: the instrumentation scope's name.
    """

    def __init__(self, resource: dict[str, Any], scope: str) -> None:
        #: an attribute key's ``KeyValue.key`` field (a fleet's spans use a few dozen keys)
        self._keys: dict[str, bytes] = {}
        #: (key, str or bool value) -> its ``KeyValue`` body
        self._pairs: dict[tuple[str, Any], bytes] = {}
        #: a span name's ``Span.name`` field
        self._names: dict[str, bytes] = {}
        #: ``ResourceSpans.resource`` (field 1), written once
        self._resource = field(1, self.attributes(resource, _RESOURCE_ATTRIBUTE))
        #: ``ScopeSpans.scope`` (field 1), written once
        self._scope = field(1, string_field(1, scope))

    def key_value(self, key: str, value: Any) -> bytes:
        """A ``KeyValue`` message's body."""
        head = self._keys.get(key)
        if head is None:
            head = self._keys[key] = _ld(b"\x0a", key.encode("utf-8"))
        return head + _ld(_KV_VALUE, any_value(value))

    def attributes(self, attributes: dict[str, Any], tag: bytes) -> bytes:
        """Repeated ``KeyValue`` fields with key ``tag`` (``None`` values left out, as the SDK drops them)."""
        pairs = self._pairs
        out = []
        for k, v in attributes.items():
            kind = type(v)
            if kind is str or kind is bool:
                kv = pairs.get((k, v))
                if kv is None:
                    if len(pairs) >= PAIR_CACHE:
                        pairs.clear()
                    kv = pairs[(k, v)] = self.key_value(k, v)
            elif v is None:
                continue
            else:
                kv = self.key_value(k, v)
            out.append(_ld(tag, kv))
        return b"".join(out)

    def span(self, span: EncodedSpan) -> bytes:
        """A ``Span`` message's body."""
        name = self._names.get(span.name)
        if name is None:
            name = self._names[span.name] = string_field(5, span.name)
        parts = [
            b"\x0a\x10" + span.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + span.span_id.to_bytes(8, "big"),
        ]
        if span.parent_id:
            parts.append(b"\x22\x08" + span.parent_id.to_bytes(8, "big"))
        parts += [
            name,
            b"\x30" + _SMALL[KINDS[span.kind]],
            b"\x39" + _PACK_U64(span.start_ns),
            b"\x41" + _PACK_U64(span.end_ns),
            self.attributes(span.attributes, _SPAN_ATTRIBUTE),
        ]
        for event, ns in span.events:
            parts.append(field(11, b"\x09" + _PACK_U64(ns) + string_field(2, event)))
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
        body = b"".join(_ld(b"\x12", self.span(s)) for s in spans)
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
