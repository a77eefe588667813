"""The endpoint picker in each of the gateway's body modes and message orders, through ``kvroute epp`` and the
gateway stand-in (real gRPC over TLS, real fake engines):

* ``BUFFERED`` (Envoy AI Gateway's ``processing-body-mode: buffered``, older kgateway): Envoy sends the request
  headers and waits for their answer before it sends the body, whole, in one message; the picker answers the
  headers with a plain CONTINUE and picks on the body (header mutations, metadata and the rewritten body with its
  ``Content-Length`` on the body's answer); responses come whole and are answered with a replaced body;
* ``NONE``: the pick on the headers; ``STREAMED``: refused at once with a clear error, never a stall;
* request trailers end a body that had no ``end_of_stream``: the pick then, answered in order;
* the subset hint is read from the final request-body message too;
* the usage event the picker asked for is removed from a streamed answer however the gateway splits it across
  response messages (every byte offset): the client gets the unsplit stream minus that event, ``[DONE]`` intact.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from loadtest.epp_gateway import BUFFERED, FULL_DUPLEX, NONE, STREAMED, GatewayStream, Picked
from tests.helpers import Proc, wait_until
from tests.integration.test_epp_protocol import MODEL, Fleet, _engine, start_epp

SSE = {":status": "200", "content-type": "text/event-stream"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    engines: list[Proc] = []
    ports: list[int] = []
    f: Fleet | None = None
    try:
        for seed in (21, 22):
            proc, port = _engine(seed)
            engines.append(proc)
            ports.append(port)
        f = start_epp([f"http://127.0.0.1:{p}" for p in ports], ready=2)
        yield f
    finally:
        if f is not None:
            f.router.stop()
        for e in engines:
            e.stop()


def _body(prompt: str, **kw: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 3, **kw}).encode()


def _released(f: Fleet) -> None:
    wait_until(lambda: f.inflight() == 0, timeout=5, what="in-flight released")


def test_buffered_mode_answers_the_headers_first_and_picks_on_the_body(fleet: Fleet) -> None:
    body = _body("buffered " * 40, stream=True)
    s = fleet.stream(mode=BUFFERED, timeout=10)  # a picker that never answers the headers fails here
    picked = s.request("/v1/completions", body)
    assert picked.headers_continued  # the headers went on before the body was sent, as Envoy requires
    assert picked.immediate is None and picked.endpoint in fleet.engines
    assert picked.metadata_endpoint == picked.endpoint and picked.clear_route_cache
    sent = json.loads(picked.body)  # the rewritten body replaces the buffered one, with its length
    assert sent["stream_options"] == {"include_usage": True}
    assert picked.set_headers["content-length"] == str(len(picked.body))
    assert fleet.inflight() == 1
    out = s.relay_response(picked.endpoint, "/v1/completions", picked.body)  # the answer comes whole
    s.close()
    assert out.endswith(b"data: [DONE]\n\n") and b'"usage"' not in out
    _released(fleet)
    # a plain request: the body goes on unchanged (no body mutation, no Content-Length set)
    s = fleet.stream(mode=BUFFERED)
    plain = _body("buffered plain " * 20)
    picked = s.request("/v1/completions", plain)
    assert picked.endpoint in fleet.engines and picked.body == plain
    assert "content-length" not in picked.set_headers
    out = s.relay_response(picked.endpoint, "/v1/completions", picked.body)
    s.close()
    assert json.loads(out)["usage"]["completion_tokens"] == 3
    _released(fleet)


def test_buffered_mode_with_trailers_and_without_response_headers(fleet: Fleet) -> None:
    """Trailers: Envoy sends the whole body without end_of_stream and the trailers after the body's answer. An
    older kgateway skips the response headers: the picker still strips the usage it asked for."""
    s = fleet.stream(mode=BUFFERED)
    body = _body("with trailers " * 20, stream=True)
    picked = s.request("/v1/completions", body, trailers={"x-checksum": "abc"})
    assert picked.endpoint in fleet.engines and picked.trailers_answer is not None
    raw = httpx.post(f"http://{picked.endpoint}/v1/completions", content=picked.body, timeout=30).content
    out = s._response_chunk(raw, end=True)  # no response headers message
    s.close()
    assert b'"usage"' in raw and b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")
    _released(fleet)


def test_none_mode_picks_on_the_headers_and_streamed_mode_is_refused_at_once(fleet: Fleet) -> None:
    s = fleet.stream(mode=NONE)
    picked = s.request("/v1/completions", _body("never seen"))  # the gateway sends no body in this mode
    s.cancel()
    assert picked.immediate is None and picked.endpoint in fleet.engines
    assert picked.chunk_sizes == []
    _released(fleet)
    s = fleet.stream(mode=STREAMED, timeout=5)  # a stall would show as a deadline error here
    picked = s.request("/v1/completions", _body("streamed"))
    assert picked.status == 500
    err = json.loads(picked.immediate.body)["error"]
    assert err["code"] == "unsupported_body_mode" and "FULL_DUPLEX_STREAMED or BUFFERED" in err["message"]


def test_request_trailers_end_the_body_and_are_answered_in_order(fleet: Fleet) -> None:
    body = _body("trailers " * 30000)  # several body messages, the last without end_of_stream
    s = fleet.stream()
    picked = s.request("/v1/completions", body, trailers={"grpc-status": "0"})
    s.cancel()
    # headers (the pick), then the body re-streamed (not ended: the trailers end it), then the trailers
    assert picked.immediate is None and picked.endpoint in fleet.engines
    assert picked.body == body and len(picked.chunk_sizes) > 1 and not any(picked.eos_flags)
    assert picked.trailers_answer is not None
    _released(fleet)


@pytest.mark.parametrize("mode", [FULL_DUPLEX, BUFFERED], ids=["full_duplex", "buffered"])
def test_the_subset_hint_of_the_final_body_message_is_honoured(fleet: Fleet, mode: int) -> None:
    body = _body("subset on the body " * 30)
    for target in fleet.engines:
        s = fleet.stream(mode=mode)
        picked = s.request("/v1/completions", body, body_subset=[target])
        s.cancel()
        assert picked.endpoint == target
    s = fleet.stream(mode=mode)
    picked = s.request("/v1/completions", body, body_subset=["10.255.255.1:8000"])
    assert picked.status == 503
    assert picked.immediate_headers()["x-kvroute-rejected-reason"] == "no_endpoint_in_subset"
    _released(fleet)


def _usage_span(raw: bytes) -> tuple[int, int]:
    """(start, end) of the usage-only event in an SSE stream, its blank line included."""
    start = 0
    for event in raw.split(b"\n\n"):
        end = start + len(event) + 2
        if b'"usage"' in event and b'"choices":[]' in event:
            return start, end
        start = end
    raise AssertionError(f"no usage event in {raw!r}")


def _routed_stream(f: Fleet, body: bytes, response_mode: int | None = None) -> tuple[GatewayStream, Picked]:
    s = f.stream(response_mode=response_mode)
    picked = s.request("/v1/completions", body)
    assert picked.immediate is None
    return s, picked


def test_usage_split_at_every_byte_offset_is_removed_and_the_stream_kept_intact(fleet: Fleet) -> None:
    body = _body("split usage " * 20, stream=True)
    s, picked = _routed_stream(fleet, body)
    assert picked.endpoint is not None
    raw = httpx.post(f"http://{picked.endpoint}/v1/completions", content=picked.body, timeout=30).content
    s.cancel()
    start, end = _usage_span(raw)
    expected = raw[:start] + raw[end:]
    assert expected.endswith(b"data: [DONE]\n\n") and b'"usage"' not in expected
    failures = []
    for cut in range(max(0, start - 2), min(len(raw), end + 2) + 1):
        s, _ = _routed_stream(fleet, body)
        out = s.respond(SSE, [raw[:cut], raw[cut:]])
        s.close()
        if out != expected:
            failures.append(cut)
    assert not failures, f"split at {failures[:10]}: the client's stream differs from the unsplit one"
    # the gateway's STREAMED response mode (each chunk answered with its replacement) and three-way splits
    for cuts in [(start + 5, end - 5), (start - 1, start + 1), (end - 1, end + 1)]:
        s, _ = _routed_stream(fleet, body, response_mode=STREAMED)
        pieces = [raw[: cuts[0]], raw[cuts[0] : cuts[1]], raw[cuts[1] :]]
        assert s.respond(SSE, pieces) == expected, cuts
        s.close()
    _released(fleet)
