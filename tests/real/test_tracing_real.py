"""Traces through kvroute into real vLLM: the engine's own ``llm_request`` span lands in the caller's trace, under
kvroute's attempt span.

r0 of the session's real fleet runs with ``--otlp-traces-endpoint`` pointing at the session's OTLP receiver
(``tests/otlp_receiver.py``, protobuf decoded with the OpenTelemetry proto package; conftest ``otlp``); vLLM
continues the ``traceparent`` kvroute hands it and exports ``llm_request`` when the request ends (every 0.5 s
here, ``OTEL_BSP_SCHEDULE_DELAY``). The PD legs over the real NIXL pair: ``tests/real/test_pd_nixl.py``.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable

import httpx
import pytest

from loadtest.real_vllm import MODEL
from tests.otlp_receiver import Receiver, Span
from tests.real.support import Router, words


def caller_trace() -> tuple[str, str]:
    """A caller's trace id and span id (hex)."""
    return secrets.token_hex(16), secrets.token_hex(8)


def wait_trace(otlp: Receiver, trace_id: str, names: set[str], engine_spans: int) -> list[Span]:
    """The trace once kvroute's ``names`` and ``engine_spans`` vLLM ``llm_request`` spans arrived."""

    def complete(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return names <= {s.name for s in mine} and sum(s.name == "llm_request" for s in mine) >= engine_spans

    otlp.wait_for(f"the spans of trace {trace_id}", complete, timeout=60)
    return otlp.in_trace(trace_id)


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_request_span_is_a_child_of_kvroutes_attempt(
    router: Callable[..., Router], otlp: Receiver, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # kvroute's spans leave within 0.2 s
    r = router(("r0",), "--otlp-traces-endpoint", otlp.endpoint)
    trace_id, parent = caller_trace()
    body = {"model": MODEL, "prompt": words(random.Random(7), 40), "max_tokens": 4, "stream": stream}
    resp = httpx.post(
        r.url + "/v1/completions",
        json=body,
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    spans = wait_trace(otlp, trace_id, {"kvroute.request", "kvroute.attempt"}, 1)
    request, attempt = one(spans, "kvroute.request"), one(spans, "kvroute.attempt")
    assert request.parent_id == parent and attempt.parent_id == request.span_id
    engine = one(spans, "llm_request")
    assert engine.parent_id == attempt.span_id  # vLLM continued kvroute's attempt span
    assert engine.service == "vllm-r0" and engine.kind == 2  # SERVER
    assert engine.attributes.get("gen_ai.latency.time_to_first_token", 0) > 0, engine.attributes
