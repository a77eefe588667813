"""The endpoint picker under hostile gateway streams, through ``kvroute epp`` and the gateway stand-in (real gRPC
over TLS, real fake engines):

* authorization on the normalized request, at the headers, before any body is held: encoded and dot-segment
  paths, other methods and paths, a missing ``:path``, a body before any headers -> refused without a key (a key
  gets the normalized route through; other methods / paths are 404 / 405, never routed);
* one pick per stream: a second request phase is a protocol error (answered 400, counted), and holds and
  admission slots are released exactly once, so ``--max-inflight-total 4`` still admits exactly 4;
* limits: a body trickled below the minimum rate or a request past its deadline is cut (408), streams over the
  total cap get 503 at once, a connection carries at most its cap of streams, response data without a routed
  request is refused;
* malformed messages: a header outside Latin-1 is a clean 400, header size and count limits are the picker's
  own (431), a non-numeric response ``:status`` does not end the stream, an empty message gets an answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from loadtest.epp_gateway import BUFFERED, GatewayStream, Picked, header_map, stub_for
from tests.helpers import Proc, metric, wait_until
from tests.integration.test_epp_protocol import MODEL, Fleet, _engine, start_epp

KEY = "k-epp-test"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    proc, port = _engine(31)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def keyed(engine: str) -> Iterator[Fleet]:
    """A picker with an API key, an in-flight cap of 4 and nothing queued."""
    f = start_epp(
        [engine], "--api-key", KEY, "--max-inflight-total", "4", "--max-queued-requests", "0", ready=1
    )
    try:
        yield f
    finally:
        f.router.stop()


def _body(prompt: str, **kw: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw}).encode()


def _inflight(f: Fleet) -> float:
    reps = httpx.get(f.http + "/replicas", headers=AUTH, timeout=5).json()["replicas"]
    return float(sum(r["load"]["inflight_requests"] for r in reps))


def _released(f: Fleet) -> None:
    wait_until(lambda: _inflight(f) == 0, timeout=5, what="replica in-flight back to 0")
    wait_until(
        lambda: metric(f.http, "kvroute_inflight_requests") == 0, timeout=5, what="admission slots free"
    )
    wait_until(lambda: metric(f.http, "kvroute_epp_streams_active") == 0, timeout=5, what="streams closed")


def _code(picked: Picked) -> str:
    return str(json.loads(picked.immediate.body)["error"]["code"])


# -- authorization ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path", ["/v1%2Fcompletions", "/%761/completions", "/v1/./completions", "/x/../v1/completions"]
)
def test_encoded_and_dot_segment_paths_need_the_key_and_route_with_it(keyed: Fleet, path: str) -> None:
    s = keyed.stream()
    picked = s.request(path, _body("sneaky " * 10))
    assert picked.status == 401 and _code(picked) == "unauthorized", path
    assert picked.immediate_headers()["www-authenticate"] == "Bearer"
    s = keyed.stream()
    picked = s.request(path, _body("sneaky " * 10), headers={"authorization": "Bearer wrong"})
    assert picked.status == 401
    s = keyed.stream()
    picked = s.request(path, _body("allowed " * 10), headers=AUTH)
    s.cancel()
    assert picked.immediate is None and picked.endpoint in keyed.engines, path
    _released(keyed)


def test_other_methods_paths_a_missing_path_and_a_body_first_are_refused(keyed: Fleet) -> None:
    cases: list[tuple[str | None, str, dict[str, str], int, str]] = [
        ("/v1/completions", "OPTIONS", {}, 401, "unauthorized"),
        ("/v1/completions", "OPTIONS", AUTH, 405, "method_not_allowed"),
        ("/v1/completions", "GET", AUTH, 405, "method_not_allowed"),
        ("/v1/files", "POST", AUTH, 404, "not_found"),
        ("/tokenize", "POST", {}, 401, "unauthorized"),
        (None, "POST", {}, 400, "missing_path"),
        (None, "POST", AUTH, 400, "missing_path"),
    ]
    for path, method, headers, status, code in cases:
        s = keyed.stream()
        picked = s.request(path, _body("refused"), headers=headers, method=method)
        assert picked.status == status and _code(picked) == code, (path, method, headers, picked.status)
    assert keyed.stream().request("/v1/completions", b"", method="OPTIONS", headers=AUTH).status == 405
    s = keyed.stream()  # a body before any headers
    s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=_body("no headers"), end_of_stream=True)))
    first = s.recv()
    assert first.WhichOneof("response") == "immediate_response"
    assert (
        first.immediate_response.status.code == 400 and first.immediate_response.details == "protocol_error"
    )
    _released(keyed)


# -- one pick per stream ----------------------------------------------------------------------------------------
def _second_body(s: GatewayStream, body: bytes) -> object:
    s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    return s.recv()


def test_a_second_request_on_one_stream_is_a_protocol_error_and_leaks_nothing(keyed: Fleet) -> None:
    before = metric(keyed.http, "kvroute_epp_protocol_errors_total", reason="second_request")
    for n in (1, 2**62):  # 2**62 sequences: a hold that counts them, released once
        s = keyed.stream()
        picked = s.request("/v1/completions", _body("twice", n=n), headers=AUTH)
        if picked.immediate is None:
            answer = _second_body(s, _body("twice again", n=n))
            assert answer.immediate_response.status.code == 400  # type: ignore[attr-defined]
            assert answer.immediate_response.details == "protocol_error"  # type: ignore[attr-defined]
        else:  # (intake may bound n: then the first body is refused, nothing is held)
            assert picked.status in (400, 413, 422), picked.status
        s.close()
    s = keyed.stream()  # second request headers on a routed stream
    assert s.request("/v1/completions", _body("headers twice"), headers=AUTH).immediate is None
    s.send(
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=header_map({":path": "/v1/completions", ":method": "POST", **AUTH}),
                end_of_stream=True,
            )
        )
    )
    assert s.recv().immediate_response.details == "protocol_error"
    _released(keyed)
    assert metric(keyed.http, "kvroute_epp_protocol_errors_total", reason="second_request") >= before + 2
    # nothing leaked: exactly max_inflight_total (4) requests are admitted at once, the 5th is shed
    held = [keyed.stream() for _ in range(4)]
    for i, s in enumerate(held):
        assert s.request("/v1/completions", _body(f"slot {i}"), headers=AUTH).immediate is None, i
    extra = keyed.stream().request("/v1/completions", _body("one too many"), headers=AUTH)
    assert extra.status == 429
    for s in held:
        s.cancel()
    _released(keyed)


# -- limits -----------------------------------------------------------------------------------------------------
def test_a_trickled_body_and_a_request_past_its_deadline_are_cut(engine: str) -> None:
    f = start_epp(
        [engine],
        "--epp-min-body-rate-bytes-per-s",
        "100",
        "--epp-body-rate-grace-s",
        "2",
        "--epp-request-timeout-s",
        "4",
        ready=1,
    )
    try:
        body = _body("trickle " * 20)
        s = f.stream(timeout=20)
        s.send(
            pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(
                    headers=header_map({":path": "/v1/completions", ":method": "POST"}), end_of_stream=False
                )
            )
        )
        stop = threading.Event()

        def trickle() -> None:  # 1 byte every 2 s, as a slowloris client through the gateway
            for i in range(len(body)):
                s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body[i : i + 1])))
                if stop.wait(2.0):
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            answer = s.recv()
        finally:
            stop.set()
        assert answer.immediate_response.status.code == 408
        assert answer.immediate_response.details == "body_too_slow"
        s.cancel()
        s = f.stream(mode=BUFFERED, timeout=20)  # BUFFERED: headers answered, then no body: the deadline
        s.send(
            pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(
                    headers=header_map({":path": "/v1/completions", ":method": "POST"}), end_of_stream=False
                )
            )
        )
        assert s.recv().WhichOneof("response") == "request_headers"  # CONTINUE
        assert s.recv().immediate_response.details == "request_timeout"
        s.cancel()
        wait_until(
            lambda: metric(f.http, "kvroute_epp_streams_active") == 0, timeout=5, what="cut streams closed"
        )
    finally:
        f.router.stop()


def _open(f: Fleet, stub: object | None = None) -> GatewayStream:
    """A stream that has sent its request headers and holds its body (an open request)."""
    if stub is None:
        _, stub = stub_for(f.grpc_port)
    s = GatewayStream(stub, 20)
    s.send(
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=header_map({":path": "/v1/completions", ":method": "POST"}), end_of_stream=False
            )
        )
    )
    return s


def test_streams_over_the_total_cap_get_503_at_once(engine: str) -> None:
    f = start_epp([engine], "--epp-max-streams", "2", ready=1)
    try:
        holders = [_open(f), _open(f)]
        wait_until(
            lambda: metric(f.http, "kvroute_epp_streams_active") == 2, timeout=5, what="2 open streams"
        )
        picked = f.stream(timeout=5).request("/v1/completions", _body("third"))
        assert picked.status == 503 and picked.immediate_headers()["retry-after"]
        assert picked.immediate_headers()["x-kvroute-rejected-reason"] == "too_many_streams"
        holders[0].cancel()
        wait_until(lambda: metric(f.http, "kvroute_epp_streams_active") == 1, timeout=5, what="a slot freed")
        s = f.stream()
        assert s.request("/v1/completions", _body("now")).immediate is None
        s.cancel()
        holders[1].cancel()
    finally:
        f.router.stop()


def test_one_connection_carries_at_most_its_cap_of_streams(engine: str) -> None:
    f = start_epp([engine], "--epp-max-streams-per-connection", "2", ready=1)
    pool = ThreadPoolExecutor(2)
    try:
        channel, stub = stub_for(f.grpc_port)
        holders = [_open(f, stub), _open(f, stub)]
        wait_until(
            lambda: metric(f.http, "kvroute_epp_streams_active") == 2, timeout=5, what="2 open streams"
        )
        third = pool.submit(lambda: GatewayStream(stub, 20).request("/v1/completions", _body("waits")))
        # control: the same request on another connection is answered (the picker is not busy)
        other = pool.submit(lambda: f.stream().request("/v1/completions", _body("other connection")))
        assert other.result(timeout=15).immediate is None
        assert not third.done()  # the connection's third stream waits for a free slot
        holders[0].cancel()
        assert third.result(timeout=15).immediate is None  # ... and goes once one is free
        holders[1].cancel()
        channel.close()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        f.router.stop()


def test_response_data_without_a_routed_request_is_refused(keyed: Fleet) -> None:
    s = keyed.stream()
    s.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map({":status": "200"}))))
    answer = s.recv()
    assert (
        answer.immediate_response.status.code == 400 and answer.immediate_response.details == "protocol_error"
    )
    s = keyed.stream()  # request headers (a body still to come), then response data
    s.send(
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=header_map({":path": "/v1/completions", ":method": "POST", **AUTH})
            )
        )
    )
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x" * 65536, end_of_stream=False)))
    assert s.recv().immediate_response.details == "protocol_error"
    assert metric(keyed.http, "kvroute_epp_protocol_errors_total", reason="response_before_request") >= 2
    _released(keyed)


# -- malformed messages -----------------------------------------------------------------------------------------
def test_headers_outside_latin1_or_over_the_limits_get_a_clean_4xx(keyed: Fleet) -> None:
    def send_headers(entries: list[base_pb2.HeaderValue]) -> Picked:
        s = keyed.stream()
        base = [
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key="authorization", raw_value=AUTH["authorization"].encode()),
        ]
        msg = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=base + entries), end_of_stream=True)
        s.send(pb.ProcessingRequest(request_headers=msg))
        return s._read_pick(False)

    name = send_headers([base_pb2.HeaderValue(key="x-\u20ac", raw_value=b"1")])
    assert name.status == 400 and _code(name) == "invalid_header"
    value = send_headers([base_pb2.HeaderValue(key="x-tenant", value="\u20ac")])
    assert value.status == 400 and _code(value) == "invalid_header"
    many = send_headers([base_pb2.HeaderValue(key=f"x-h{i}", raw_value=b"v") for i in range(200)])
    assert many.status == 431 and _code(many) == "too_many_headers"
    big = send_headers([base_pb2.HeaderValue(key="x-big", raw_value=b"v" * 40000)])
    assert big.status == 431 and _code(big) == "header_too_large"
    latin1 = send_headers([base_pb2.HeaderValue(key="x-note", raw_value="caf\u00e9".encode())])
    assert latin1.immediate is None  # any bytes are a value (read as Latin-1, as HTTP/1 headers are)
    _released_all(keyed)
    assert "Traceback" not in keyed.router.output()


def _released_all(f: Fleet) -> None:
    wait_until(lambda: metric(f.http, "kvroute_epp_streams_active") == 0, timeout=5, what="streams closed")


def test_a_non_numeric_status_does_not_end_the_stream(keyed: Fleet) -> None:
    s = keyed.stream()
    picked = s.request("/v1/completions", _body("odd status"), headers=AUTH)
    assert picked.endpoint is not None
    out = s.respond({":status": "abc", "content-type": "application/json"}, [b'{"usage": null}'])
    s.close()
    assert out == b'{"usage": null}'
    assert metric(keyed.http, "kvroute_epp_protocol_errors_total", reason="bad_status") >= 1
    _released(keyed)


def test_an_empty_message_gets_an_answer(keyed: Fleet) -> None:
    s = keyed.stream(timeout=5)  # silence would be a deadline error here
    s.send(pb.ProcessingRequest())
    answer = s.recv()
    assert (
        answer.immediate_response.status.code == 400 and answer.immediate_response.details == "protocol_error"
    )
    assert metric(keyed.http, "kvroute_epp_protocol_errors_total", reason="empty_message") >= 1


def test_the_picker_process_survives_all_of_the_above(keyed: Fleet) -> None:
    assert keyed.router.alive()
    assert isinstance(keyed.router, Proc) and "Traceback" not in keyed.router.output()
