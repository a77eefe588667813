"""The endpoint-picker protocol's wire vocabulary: Envoy ``ext_proc`` messages in, ``ProcessingResponse`` out.

Names and limits follow the Gateway API Inference Extension's endpoint-picker protocol (see
``docs/deploy.md``, "kvroute as an endpoint picker behind a Gateway"):

* the picked endpoint goes back as the request header ``x-gateway-destination-endpoint`` AND as the dynamic
  metadata ``envoy.lb`` / ``x-gateway-destination-endpoint`` (identical ``ip:port`` values), with the route cache
  cleared so the gateway re-evaluates the route with the new header;
* the optional subset hint comes in ``metadata_context.filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`` (a list of ``ip:port``): only those endpoints may be picked;
* bodies go back as ``streamed_response`` chunks of at most ``BODY_CHUNK_BYTES`` (Envoy's ~64 KiB message limit),
  the last one with ``end_of_stream``; a mutated body comes with its new ``Content-Length``;
* errors are ``ImmediateResponse`` s with an HTTP status, an OpenAI-style JSON body and the reason header;
* the gateway says its body send modes in ``protocol_config`` on a stream's first message (``body_modes``): in
  ``FULL_DUPLEX_STREAMED`` bodies go back as ``streamed_response`` chunks; in ``BUFFERED`` (and ``STREAMED``) a
  body message is answered with a plain ``CommonResponse`` that continues it or replaces it whole
  (``body_answer``), and in ``BUFFERED`` the pick comes on the request body's answer (``routed_body``), the
  request headers having been answered with a plain ``CONTINUE`` (``continue_headers``).

Pure translation: no I/O, no routing. Units: bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.errors import KvrouteError
from router.serve.client_fields import ROUTER_HEADERS

#: request header (and ``envoy.lb`` metadata key) naming the picked endpoint, ``ip:port``
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: dynamic-metadata namespace the gateway's load balancer reads the pick from
DESTINATION_NAMESPACE = "envoy.lb"
#: metadata namespace and key of the gateway's subset hint (the endpoints the request may go to)
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: largest body chunk sent back in one message (Envoy's per-message limit is ~64 KiB), bytes
BODY_CHUNK_BYTES = 62_000
#: response header of an ImmediateResponse saying why the request was not routed: ``REASON_HEADER`` (router.errors)
#: response header naming the replica that served the request (as the proxy sets it)
REPLICA_HEADER = "x-kvroute-replica"

#: the ProcessingRequest oneof ``request`` field names
REQUEST_HEADERS = "request_headers"
REQUEST_BODY = "request_body"
REQUEST_TRAILERS = "request_trailers"
RESPONSE_HEADERS = "response_headers"
RESPONSE_BODY = "response_body"
RESPONSE_TRAILERS = "response_trailers"

#: body send modes (Envoy's ``ProcessingMode.BodySendMode``)
_MODE = processing_mode_pb2.ProcessingMode
NONE, STREAMED, BUFFERED = _MODE.NONE, _MODE.STREAMED, _MODE.BUFFERED
BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED = _MODE.BUFFERED_PARTIAL, _MODE.FULL_DUPLEX_STREAMED
#: a header name: an RFC 9110 token, or a pseudo-header (``:path``)
_HEADER_NAME = re.compile(r":?[!#$%&'*+\-.^_`|~0-9a-zA-Z]+")


def mode_name(mode: int) -> str:
    """A body send mode's name (``BUFFERED``)."""
    try:
        return str(_MODE.BodySendMode.Name(mode))
    except ValueError:
        return f"mode {mode}"


def body_modes(msg: Any) -> tuple[int, int] | None:
    """(request, response) body send modes from a ``ProcessingRequest``'s ``protocol_config`` (Envoy sends it on
    a stream's first message), or None when the message carries none."""
    if not msg.HasField("protocol_config"):
        return None
    cfg = msg.protocol_config
    return int(cfg.request_body_mode), int(cfg.response_body_mode)


class HeaderError(KvrouteError, ValueError):
    """Request headers the picker refuses: HTTP status, stable code, message (counted under the code)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message, status=status, code=code, counted_as=code)


def headers_of(
    http_headers: Any, *, strict: bool = False, max_bytes: int | None = None, max_count: int | None = None
) -> dict[str, str]:
    """The headers of an ext_proc ``HttpHeaders`` as a dict (lower-case names; pseudo-headers such as ``:path``
    and ``:method`` included). Values are Envoy's ``raw_value`` bytes (older versions: ``value``) decoded as
    Latin-1, byte for byte, as Starlette decodes HTTP/1 headers, so both front doors see the same strings.

    ``strict`` (request headers): a name that is not an HTTP token or a ``value`` outside Latin-1 is refused,
    and so are more than ``max_count`` headers or more than ``max_bytes`` of names and values; otherwise such
    headers are skipped.

    Raises:
        HeaderError: (``strict`` only) 400 ``invalid_header``, 431 ``too_many_headers`` / ``header_too_large``.
    """
    out: dict[str, str] = {}
    entries = http_headers.headers.headers
    if strict and max_count is not None and len(entries) > max_count:
        raise HeaderError(
            431, "too_many_headers", f"more than {max_count} request headers (max_header_count)"
        )
    size = 0
    for h in entries:
        key = h.key
        raw = h.raw_value
        if raw:
            value = raw.decode("latin-1")
        else:
            value = h.value
            if not value.isascii():
                try:
                    value.encode("latin-1")
                except UnicodeEncodeError:
                    if strict:
                        raise HeaderError(
                            400, "invalid_header", f"header {key[:64]!r}: a value outside Latin-1"
                        ) from None
                    continue
        if not _HEADER_NAME.fullmatch(key):
            if strict:
                raise HeaderError(400, "invalid_header", f"invalid header name {key[:64]!r}")
            continue
        size += len(key) + len(value)
        out[key.lower()] = value
    if strict and max_bytes is not None and size > max_bytes:
        raise HeaderError(
            431, "header_too_large", f"request headers over {max_bytes} bytes (max_header_bytes)"
        )
    return out


def subset_hint(metadata_context: Any) -> list[str] | None:
    """The gateway's subset hint (``ip:port`` endpoints the request may go to), or None when it sent none.

    An empty list means "a hint that allows nothing" (answered 503 by the picker). A hint given as one
    comma-separated string is split.
    """
    fm = metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in fm:
        return None
    fields = fm[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return [i.strip() for i in items if i.strip()]


def endpoint_of(url: str) -> str:
    """The ``host:port`` the gateway must send to for a replica URL (default ports 80 / 443; IPv6 bracketed)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


def _header(key: str, value: str, *, overwrite: bool = False) -> Any:
    header = base_pb2.HeaderValue(key=key, raw_value=value.encode())
    if overwrite:  # replaces what the client sent (the default appends)
        return base_pb2.HeaderValueOption(
            header=header, append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        )
    return base_pb2.HeaderValueOption(header=header)


def _routed_common(endpoint: str, extra: Mapping[str, str], body_length: int | None) -> Any:
    sets = [_header(DESTINATION_HEADER, endpoint)]
    sets.extend(_header(k, v, overwrite=k in ROUTER_HEADERS) for k, v in extra.items())
    if body_length is not None:
        sets.append(_header("content-length", str(body_length)))
    # only the router sets those: a client's are removed, or replaced when the router sets one (a pinned DP rank)
    removes = [h for h in ROUTER_HEADERS if h not in extra]
    mutation = pb.HeaderMutation(set_headers=sets, remove_headers=removes)
    return pb.CommonResponse(clear_route_cache=True, header_mutation=mutation)


def _destination_metadata(endpoint: str) -> Any:
    meta = struct_pb2.Struct()
    meta.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return meta


def routed_headers(endpoint: str, extra: Mapping[str, str], body_length: int | None) -> Any:
    """The answer to the request headers once a replica is picked: the destination header (+ ``extra`` headers,
    + ``Content-Length`` when the body was changed), ``envoy.lb`` metadata with the same value, and the route
    cache cleared."""
    common = _routed_common(endpoint, extra, body_length)
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=_destination_metadata(endpoint)
    )


def routed_body(endpoint: str, extra: Mapping[str, str], new_body: bytes | None) -> Any:
    """BUFFERED: the answer to the (whole) request body once a replica is picked: the header mutations of
    ``routed_headers`` (Envoy still holds the headers), the body replaced by ``new_body`` (None: unchanged; then no
    ``Content-Length`` either), the same ``envoy.lb`` metadata, the route cache cleared."""
    common = _routed_common(endpoint, extra, None if new_body is None else len(new_body))
    if new_body is not None:
        common.body_mutation.CopyFrom(pb.BodyMutation(body=new_body))
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=_destination_metadata(endpoint)
    )


def continue_headers() -> Any:
    """The answer to the request headers that lets them go on unchanged (BUFFERED: Envoy then sends the body)."""
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse()))


def body_answer(new_body: bytes | None, *, request: bool, headers: Mapping[str, str] | None = None) -> Any:
    """BUFFERED / STREAMED: the answer to one body message: continue it unchanged (``new_body`` None) or replace
    it with ``new_body`` (empty: cleared), setting ``headers`` (e.g. a new ``Content-Length``) when Envoy still
    holds them."""
    common = pb.CommonResponse()
    if new_body is not None:
        mutation = pb.BodyMutation(body=new_body) if new_body else pb.BodyMutation(clear_body=True)
        common.body_mutation.CopyFrom(mutation)
    if headers:
        common.header_mutation.CopyFrom(
            pb.HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()])
        )
    answer = pb.BodyResponse(response=common)
    return (
        pb.ProcessingResponse(request_body=answer) if request else pb.ProcessingResponse(response_body=answer)
    )


def body_chunks(
    body: bytes, *, request: bool, end_of_stream: bool = True, chunk_bytes: int = BODY_CHUNK_BYTES
) -> Iterator[Any]:
    """``body`` as ``streamed_response`` body messages of at most ``chunk_bytes`` each (request or response
    path); the last one carries ``end_of_stream`` when asked. An empty body is one empty message."""
    n = len(body)
    starts = range(0, n, chunk_bytes) if n else range(1)
    last = starts[-1]
    for start in starts:
        piece = body[start : start + chunk_bytes]
        streamed = pb.StreamedBodyResponse(body=piece, end_of_stream=end_of_stream and start == last)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        answer = pb.BodyResponse(response=common)
        yield (
            pb.ProcessingResponse(request_body=answer)
            if request
            else pb.ProcessingResponse(response_body=answer)
        )


def response_headers(extra: Mapping[str, str]) -> Any:
    """The answer to the response headers: continue, adding ``extra`` headers."""
    sets = [_header(k, v) for k, v in extra.items()]
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def trailers(request: bool) -> Any:
    """The answer to request or response trailers: continue unchanged."""
    if request:
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(status: int, body: bytes, headers: Iterable[tuple[str, str]], details: str) -> Any:
    """An ``ImmediateResponse``: the gateway answers the client with ``status`` / ``headers`` / ``body`` and does
    not forward the request. ``details`` is the reason code (in Envoy's access log too)."""
    sets = [_header(k, v) for k, v in headers]
    answer = pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=sets),
        body=body,
        details=details,
    )
    return pb.ProcessingResponse(immediate_response=answer)
