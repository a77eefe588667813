"""A real OTLP trace receiver for tests: a gRPC ``TraceService`` (``opentelemetry.proto.collector.trace.v1``) or an
OTLP/HTTP endpoint (``POST /v1/traces``, protobuf), decoding every export with the OpenTelemetry proto package and
keeping the spans, with their service name, as plain ``Span`` records. Units: seconds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.helpers import wait_until


@dataclass
class Span:
    """One received span: ids as hex (parent "" for a root), name, kind (OTLP enum), attributes, service."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


def spans_of(request: Any) -> list[Span]:
    """The spans of one ``ExportTraceServiceRequest``."""
    out = []
    for rs in request.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        service=str(service),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status_code=s.status.code,
                    )
                )
    return out


class Receiver:
    """The spans received so far (thread-safe) and waiting on them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.exports = 0
        self.endpoint = ""

    def add(self, request: Any) -> None:
        with self._lock:
            self._spans.extend(spans_of(request))
            self.exports += 1

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def in_trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans() if s.trace_id == trace_id]

    def wait_for(self, what: str, pred: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """Wait until ``pred(spans)`` holds; returns the spans then."""
        wait_until(lambda: pred(self.spans()), timeout=timeout, what=what)
        return self.spans()


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the gRPC method name)
        self.receiver.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def grpc_receiver() -> Iterator[Receiver]:
    """A gRPC OTLP receiver on a free loopback port (``endpoint``: ``http://127.0.0.1:PORT``), stopped after."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(receiver), server)  # type: ignore[no-untyped-call]  # otel-proto's generated gRPC code is unannotated
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(None)


def http_receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver (protobuf bodies on ``POST /v1/traces``; ``endpoint`` is that URL), stopped after."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the http.server method name)
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            receiver.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            """Silent: http.server would print one line per export to stderr."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver.endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
