"""The stand-in engine's tracing, as vLLM does it: the W3C trace context of each generation request continued.

* Every ``traceparent`` a request arrives with (any endpoint) is kept (the last ``KEEP`` of them, with its
  ``tracestate``, ``baggage``, ``x-request-id`` and path) and listed by ``GET /admin/traces``: a test sees which span the
  caller named as the engine request's parent without any collector.
* With ``--otlp-traces-endpoint`` (vLLM's flag) the engine exports a span ``llm_request`` (SERVER) per generation
  request, child of the caller's ``traceparent`` (a new trace without one), from its arrival to the end of its
  answer (a stream: its last event), over OTLP/gRPC, or OTLP/HTTP with
  ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, as vLLM; ``OTEL_SERVICE_NAME`` names the service
  (default ``fake-engine``). Spans leave in batches (``OTEL_BSP_SCHEDULE_DELAY``, 5 s by default, as vLLM's).

Units: seconds.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.responses import Response, StreamingResponse

#: received trace contexts kept for ``GET /admin/traces``
KEEP = 256


class EngineTracing:
    """Received trace contexts, and the ``llm_request`` spans when an OTLP endpoint is given.

    Args:
        endpoint: the OTLP collector (``--otlp-traces-endpoint``); None: no span is exported.
    """

    def __init__(self, endpoint: str | None) -> None:
        self.received: deque[dict[str, str]] = deque(maxlen=KEEP)
        self.tracer: Any = None
        self.provider: Any = None
        self.propagator: Any = None
        if endpoint:
            self._export_to(endpoint)

    def _export_to(self, endpoint: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc") == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

            exporter: Any = Http(endpoint=endpoint)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            exporter = Grpc(endpoint=endpoint)
        name = os.environ.get("OTEL_SERVICE_NAME") or "fake-engine"
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("fake-engine")
        self.propagator = TraceContextTextMapPropagator()

    def note(self, headers: Mapping[str, str], path: str) -> None:
        """A request to ``path`` arrived with ``headers``: its trace context kept when it has one."""
        parent = headers.get("traceparent")
        if parent:
            self.received.append(
                {
                    "traceparent": parent,
                    "tracestate": headers.get("tracestate") or "",
                    "baggage": headers.get("baggage") or "",
                    "x-request-id": headers.get("x-request-id") or "",
                    "path": path,
                }
            )

    def start(self, headers: Mapping[str, str], path: str) -> Any:
        """A generation request arrived with ``headers``: its ``llm_request`` span started (None when no endpoint
        is configured; its trace context was kept by ``note``, as every request's)."""
        parent = headers.get("traceparent")
        if self.tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        ctx = self.propagator.extract(headers) if parent else None
        return self.tracer.start_span(
            "llm_request",
            context=ctx,
            kind=SpanKind.SERVER,
            attributes={"gen_ai.request.id": headers.get("x-request-id") or "", "url.path": path},
        )

    def ended_with(self, resp: Response, span: Any) -> Response:
        """``resp`` with ``span`` ended when it is over (a stream: after its last event)."""
        if span is None:
            return resp
        span.set_attribute("http.response.status_code", resp.status_code)
        if not isinstance(resp, StreamingResponse):
            span.end()
            return resp
        events = resp.body_iterator

        async def traced() -> AsyncIterator[Any]:
            try:
                async for chunk in events:
                    yield chunk
            finally:
                span.end()

        resp.body_iterator = traced()
        return resp

    def shutdown(self) -> None:
        """Export what is buffered (a blocking call)."""
        if self.provider is not None:
            self.provider.shutdown()


class _NoteTraceContext:
    """ASGI middleware: every HTTP request's trace context noted (``EngineTracing.note``) before it is served."""

    def __init__(self, app: Any, tracing: EngineTracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            raw = scope["headers"]
            if any(k == b"traceparent" for k, _ in raw):
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
                self.tracing.note(headers, scope["path"])
        await self.app(scope, receive, send)


def add_trace_routes(app: FastAPI, tracing: EngineTracing) -> None:
    """``GET /admin/traces``: the trace contexts received (every endpoint's, generation or not: ``/tokenize``,
    ``/v1/responses``, pooling, ...), oldest first."""
    app.add_middleware(_NoteTraceContext, tracing=tracing)

    @app.get("/admin/traces")
    async def traces() -> Response:
        return JSONResponse({"received": list(tracing.received)})
