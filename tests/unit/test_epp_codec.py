"""router/epp/codec.py: the endpoint-picker protocol's wire vocabulary (built from Envoy's own protos)."""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from router.epp import codec


def _meta(value: str | int | list[str]) -> base_pb2.Metadata:
    meta = base_pb2.Metadata()
    s = struct_pb2.Struct()
    s.update({codec.SUBSET_KEY: value})
    meta.filter_metadata[codec.SUBSET_NAMESPACE].CopyFrom(s)
    return meta


def test_subset_hint_forms() -> None:
    assert codec.subset_hint(base_pb2.Metadata()) is None  # no hint at all
    assert codec.subset_hint(_meta(["10.0.0.1:8000", " 10.0.0.2:8000 "])) == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    ]
    assert codec.subset_hint(_meta("10.0.0.1:8000,10.0.0.2:8000")) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert codec.subset_hint(_meta([])) == []  # a hint that allows nothing (answered 503)
    assert codec.subset_hint(_meta(7)) == []  # not a list of endpoints: nothing eligible


def test_endpoint_of_replica_urls() -> None:
    assert codec.endpoint_of("http://10.0.0.1:8000") == "10.0.0.1:8000"
    assert codec.endpoint_of("http://10.0.0.1") == "10.0.0.1:80"
    assert codec.endpoint_of("https://engine.ns.svc") == "engine.ns.svc:443"
    assert codec.endpoint_of("http://[fd00::1]:8000") == "[fd00::1]:8000"


def test_headers_read_raw_value_and_value() -> None:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":Path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key="x-old", value="v"),
        ]
    )
    assert codec.headers_of(pb.HttpHeaders(headers=hm)) == {":path": "/v1/completions", "x-old": "v"}


def test_routed_headers_carry_the_same_endpoint_twice_and_clear_the_route_cache() -> None:
    msg = codec.routed_headers("10.0.0.1:8000", {"x-request-id": "r1"}, 123)
    common = msg.request_headers.response
    assert common.clear_route_cache
    sets = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert sets == {codec.DESTINATION_HEADER: "10.0.0.1:8000", "x-request-id": "r1", "content-length": "123"}
    lb = msg.dynamic_metadata.fields[codec.DESTINATION_NAMESPACE].struct_value.fields
    assert lb[codec.DESTINATION_HEADER].string_value == "10.0.0.1:8000"
    unchanged = codec.routed_headers("10.0.0.1:8000", {}, None)
    assert [h.header.key for h in unchanged.request_headers.response.header_mutation.set_headers] == [
        codec.DESTINATION_HEADER
    ]


def test_body_chunks_stay_within_envoys_limit() -> None:
    body = bytes(range(256)) * 1000  # 256,000 bytes
    msgs = list(codec.body_chunks(body, request=True))
    parts = [m.request_body.response.body_mutation.streamed_response for m in msgs]
    assert b"".join(p.body for p in parts) == body
    assert all(len(p.body) <= codec.BODY_CHUNK_BYTES for p in parts) and len(parts) == 5
    assert [p.end_of_stream for p in parts] == [False] * 4 + [True]
    exact = list(codec.body_chunks(b"x" * codec.BODY_CHUNK_BYTES * 2, request=False, end_of_stream=False))
    assert len(exact) == 2 and not any(
        m.response_body.response.body_mutation.streamed_response.end_of_stream for m in exact
    )
    (empty,) = codec.body_chunks(b"", request=False)
    assert empty.response_body.response.body_mutation.streamed_response.end_of_stream


def test_immediate_response() -> None:
    msg = codec.immediate(429, b'{"error": {}}', [("retry-after", "1")], "overloaded")
    imm = msg.immediate_response
    assert imm.status.code == 429 and imm.body == b'{"error": {}}' and imm.details == "overloaded"
    assert imm.headers.set_headers[0].header.key == "retry-after"


def test_headers_are_latin1_and_strict_request_headers_are_checked() -> None:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-v", raw_value="caf\u00e9".encode())])
    assert codec.headers_of(pb.HttpHeaders(headers=hm)) == {
        "x-v": "caf\u00c3\u00a9"
    }  # bytes 1:1, as Starlette
    bad_name = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-\u20ac", raw_value=b"1")])
    assert codec.headers_of(pb.HttpHeaders(headers=bad_name)) == {}  # response headers: skipped
    with pytest.raises(codec.HeaderError) as exc:
        codec.headers_of(pb.HttpHeaders(headers=bad_name), strict=True)
    assert (exc.value.status, exc.value.code) == (400, "invalid_header")
    bad_value = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-v", value="\u20ac")])
    with pytest.raises(codec.HeaderError):
        codec.headers_of(pb.HttpHeaders(headers=bad_value), strict=True)
    many = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=f"h{i}", raw_value=b"v") for i in range(5)])
    with pytest.raises(codec.HeaderError) as exc:
        codec.headers_of(pb.HttpHeaders(headers=many), strict=True, max_count=4)
    assert exc.value.status == 431 and exc.value.code == "too_many_headers"
    with pytest.raises(codec.HeaderError) as exc:
        codec.headers_of(pb.HttpHeaders(headers=many), strict=True, max_bytes=14)
    assert exc.value.code == "header_too_large"
    assert len(codec.headers_of(pb.HttpHeaders(headers=many), strict=True, max_bytes=15, max_count=5)) == 5


def test_buffered_answers_and_body_modes() -> None:
    routed = codec.routed_body("10.0.0.1:8000", {"x-request-id": "r"}, b"new body")
    common = routed.request_body.response
    sets = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert sets == {codec.DESTINATION_HEADER: "10.0.0.1:8000", "x-request-id": "r", "content-length": "8"}
    assert common.clear_route_cache and common.body_mutation.body == b"new body"
    lb = routed.dynamic_metadata.fields[codec.DESTINATION_NAMESPACE].struct_value.fields
    assert lb[codec.DESTINATION_HEADER].string_value == "10.0.0.1:8000"
    unchanged = codec.routed_body("10.0.0.1:8000", {}, None).request_body.response
    assert not unchanged.HasField("body_mutation")
    assert "content-length" not in {h.header.key for h in unchanged.header_mutation.set_headers}
    cont = codec.continue_headers().request_headers.response
    assert not cont.HasField("header_mutation") and not cont.HasField("body_mutation")
    keep = codec.body_answer(None, request=False).response_body.response
    assert not keep.HasField("body_mutation")
    cleared = codec.body_answer(b"", request=False).response_body.response.body_mutation
    assert cleared.WhichOneof("mutation") == "clear_body"
    replaced = codec.body_answer(b"ab", request=True, headers={"content-length": "2"}).request_body.response
    assert replaced.body_mutation.body == b"ab" and replaced.header_mutation.set_headers[0].header.key == (
        "content-length"
    )
    assert codec.body_modes(pb.ProcessingRequest()) is None
    cfg = pb.ProtocolConfiguration(request_body_mode=codec.BUFFERED, response_body_mode=codec.STREAMED)
    assert codec.body_modes(pb.ProcessingRequest(protocol_config=cfg)) == (codec.BUFFERED, codec.STREAMED)
    assert codec.mode_name(codec.FULL_DUPLEX_STREAMED) == "FULL_DUPLEX_STREAMED"


def test_a_router_header_the_picker_sets_replaces_the_clients() -> None:
    """``X-data-parallel-rank`` and llm-d's ``x-prefiller-host-port`` are the router's: removed from what a
    client sent, or (a PD plan's pinned rank) set over it, never appended to it."""
    plain = codec.routed_headers("10.0.0.1:8000", {"x-request-id": "r"}, None).request_headers.response
    assert list(plain.header_mutation.remove_headers) == [
        "x-data-parallel-rank",
        "x-prefiller-host-port",
        "x-prefiller-url",
    ]
    pinned = codec.routed_headers(
        "10.0.0.1:8000", {"x-data-parallel-rank": "1", "x-prefiller-host-port": "10.0.0.2:8000"}, None
    ).request_headers.response
    mutation = pinned.header_mutation
    assert list(mutation.remove_headers) == ["x-prefiller-url"]  # the ones it does not set
    prefiller = next(h for h in mutation.set_headers if h.header.key == "x-prefiller-host-port")
    assert prefiller.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    rank = next(h for h in mutation.set_headers if h.header.key == "x-data-parallel-rank")
    assert rank.header.raw_value == b"1"
    assert rank.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
