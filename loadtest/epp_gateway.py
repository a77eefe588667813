"""A gateway stand-in for ``kvroute epp`` (tests and ``loadtest.bench_epp``): a gRPC client built from Envoy's
ext_proc protos (the ``xds-protos`` package) that plays Envoy's part of the endpoint-picker protocol, plus the HTTP
hop to the picked engine (real sockets), so the picker's response path sees a real engine's answer.

It dials the picker as gateways do: over TLS, accepting the certificate the picker presents (fetched at connect
time and trusted as is, which is what a gateway with ``insecureSkipVerify`` / no validation context accepts), or in
plaintext (``tls=False``, for ``kvroute epp --grpc-insecure``).

One ``GatewayStream`` is one HTTP request. Like Envoy it says its processing modes in ``protocol_config`` on the
first message. ``request`` sends the request and returns what the picker answered (``Picked``: destination header
and ``envoy.lb`` metadata, headers set, the body sent back, or the ImmediateResponse):

* ``FULL_DUPLEX_STREAMED`` (default): the headers, then the body in messages of ``chunk`` bytes without waiting
  (the last one with ``end_of_stream``, or followed by ``trailers``); the picker answers the headers with the pick
  and re-streams the body;
* ``BUFFERED``: the headers, then it waits for their answer (``CONTINUE``) before it sends the whole body in one
  message (``end_of_stream`` unless trailers follow); the pick comes on the body's answer, as Envoy allows;
* ``NONE``: the headers only.

``relay_response`` forwards the body to the picked engine and passes the engine's answer through the picker's
response path in the stream's response mode; ``respond`` passes a given answer (status, headers, body pieces)
through it; ``cancel`` resets the stream as Envoy does when the client goes away. Units: bytes, seconds.
"""

from __future__ import annotations

import queue
import socket
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

DEST = "x-gateway-destination-endpoint"
#: Envoy's default buffer for one ext_proc body message in the tests, bytes
CHUNK = 65536
#: body send modes (Envoy's ProcessingMode.BodySendMode)
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
NONE = processing_mode_pb2.ProcessingMode.NONE
#: no limit on the size of one gRPC message in either direction (a BUFFERED body is one message)
_UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def header_map(headers: dict[str, str]) -> Any:
    """An Envoy ``HeaderMap`` (values as ``raw_value`` bytes, as Envoy sends them)."""
    return base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8", "surrogateescape"))
            for k, v in headers.items()
        ]
    )


def subset_metadata(subset: list[str] | None) -> Any:
    """The ``metadata_context`` carrying the gateway's subset hint (None: no hint)."""
    meta = base_pb2.Metadata()
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        meta.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return meta


class ProtocolError(AssertionError):
    """The picker answered out of the protocol's order."""


def _expect(msg: Any, kind: str) -> None:
    got = msg.WhichOneof("response")
    if got != kind:
        raise ProtocolError(f"expected a {kind} answer, got {got}: {msg}")


def _set_headers(common: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


@dataclass
class Picked:
    """What the picker answered to a request: the destination (header and metadata), the headers it set and
    removed, the body it sent back (re-assembled) and the sizes of its body messages; or the ImmediateResponse."""

    endpoint: str | None = None
    metadata_endpoint: str | None = None
    set_headers: dict[str, str] = field(default_factory=dict)
    removed_headers: list[str] = field(default_factory=list)
    clear_route_cache: bool = False
    body: bytes = b""
    chunk_sizes: list[int] = field(default_factory=list)
    eos_flags: list[bool] = field(default_factory=list)
    immediate: Any = None
    #: BUFFERED: the answer to the headers came before the body was sent (CONTINUE, no mutation)
    headers_continued: bool = False
    #: the answer to the request trailers (None: none sent, or the picker refused first)
    trailers_answer: Any = None

    @property
    def status(self) -> int | None:
        """The ImmediateResponse's HTTP status, or None when a replica was picked."""
        return int(self.immediate.status.code) if self.immediate is not None else None

    def immediate_headers(self) -> dict[str, str]:
        """The headers of the ImmediateResponse."""
        return {h.header.key: h.header.raw_value.decode() for h in self.immediate.headers.set_headers}

    def _take_pick(self, common: Any, dynamic_metadata: Any) -> None:
        self.clear_route_cache = common.clear_route_cache
        self.set_headers = _set_headers(common)
        self.removed_headers = list(common.header_mutation.remove_headers)
        self.endpoint = self.set_headers.get(DEST)
        lb = dynamic_metadata.fields["envoy.lb"].struct_value.fields
        self.metadata_endpoint = lb[DEST].string_value if DEST in lb else None


def fetch_certificate(host: str, port: int, timeout: float = 5.0) -> bytes:
    """The PEM certificate a TLS server presents (a handshake offering h2, as a gRPC client does), unverified."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    if der is None:
        raise ssl.SSLError(f"{host}:{port} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()


def certificate_name(pem: bytes) -> str:
    """A name the certificate is valid for (its first DNS subject alternative name, else its common name)."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = san.get_values_for_type(x509.DNSName)
        if dns:
            return str(dns[0])
    except x509.ExtensionNotFound:
        pass
    cn = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    return str(cn[0].value) if cn else "localhost"


def channel_for(port: int, host: str = "127.0.0.1", *, tls: bool = True) -> grpc.Channel:
    """A channel to the picker at ``host:port``: TLS trusting the certificate it presents now (``tls``), else
    plaintext h2c."""
    target = f"{host}:{port}"
    if not tls:
        return grpc.insecure_channel(target, options=_UNLIMITED)
    pem = fetch_certificate(host, port)
    creds = grpc.ssl_channel_credentials(root_certificates=pem)
    return grpc.secure_channel(
        target, creds, options=[*_UNLIMITED, ("grpc.ssl_target_name_override", certificate_name(pem))]
    )


def stub_for(port: int, host: str = "127.0.0.1", *, tls: bool = True) -> tuple[grpc.Channel, Any]:
    """A channel and an ``ExternalProcessor`` stub for the picker at ``host:port`` (see ``channel_for``)."""
    channel = channel_for(port, host, tls=tls)
    return channel, pb_grpc.ExternalProcessorStub(channel)


class GatewayStream:
    """One ext_proc stream (one HTTP request) to the picker, in the given request / response body modes."""

    def __init__(
        self, stub: Any, timeout: float = 20.0, *, mode: int = FULL_DUPLEX, response_mode: int | None = None
    ) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self.call = stub.Process(iter(self._q.get, None), timeout=timeout)
        self._answers: Iterator[Any] = iter(self.call)
        self.mode = mode
        self.response_mode = mode if response_mode is None else response_mode
        self._configured = False
        #: the headers the picker added to the client's response (its answer to the response headers)
        self.response_set_headers: dict[str, str] = {}

    def send(self, msg: Any) -> None:
        """Send one ``ProcessingRequest`` (the first one carries ``protocol_config``, as Envoy sends it)."""
        if not self._configured:
            self._configured = True
            if not msg.HasField("protocol_config"):
                msg.protocol_config.CopyFrom(
                    pb.ProtocolConfiguration(
                        request_body_mode=self.mode, response_body_mode=self.response_mode
                    )
                )
        self._q.put(msg)

    def recv(self) -> Any:
        """The next ``ProcessingResponse`` (blocks)."""
        return next(self._answers)

    def close(self) -> None:
        """Half-close: the HTTP request is over."""
        self._q.put(None)

    def cancel(self) -> None:
        """Reset the stream (the client went away)."""
        self.call.cancel()
        self._q.put(None)

    def request(
        self,
        path: str | None,
        body: bytes | None,
        *,
        headers: dict[str, str] | None = None,
        subset: list[str] | None = None,
        body_subset: list[str] | None = None,
        chunk: int = CHUNK,
        method: str = "POST",
        trailers: dict[str, str] | None = None,
    ) -> Picked:
        """Send the request headers (+ the body, + ``trailers``) as Envoy does in this stream's mode and read the
        picker's answers. ``path`` None sends no ``:path``; ``body_subset`` is a subset hint on the final body
        message."""
        h = {
            ":method": method,
            ":authority": "gateway",
            "content-type": "application/json",
            **(headers or {}),
        }
        if path is not None:
            h = {":path": path, **h}
        if body is not None:
            h["content-length"] = str(len(body))
        self.send(
            pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(
                    headers=header_map(h), end_of_stream=body is None and trailers is None
                ),
                metadata_context=subset_metadata(subset),
            )
        )
        if self.mode == BUFFERED:
            return self._buffered(body, body_subset, trailers)
        if self.mode == NONE:  # Envoy sends the processor no body in this mode
            return self._read_pick(False)
        if body is not None:
            pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                self.send(
                    pb.ProcessingRequest(
                        request_body=pb.HttpBody(body=piece, end_of_stream=last and trailers is None),
                        metadata_context=subset_metadata(body_subset if last else None),
                    )
                )
        if trailers is not None:
            self.send_trailers(trailers)
        return self._read_pick(body is not None, trailers is not None)

    def send_trailers(self, trailers: dict[str, str]) -> None:
        """Send the request trailers."""
        self.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=header_map(trailers))))

    def _buffered(
        self, body: bytes | None, body_subset: list[str] | None, trailers: dict[str, str] | None
    ) -> Picked:
        """BUFFERED: wait for the headers' answer, then send the whole body in one message; the pick comes on
        the body's answer (header mutation, ``envoy.lb`` metadata, the body replaced when changed)."""
        out = Picked()
        first = self.recv()
        if first.WhichOneof("response") == "immediate_response":
            out.immediate = first.immediate_response
            return out
        _expect(first, "request_headers")
        common = first.request_headers.response
        if body is None:  # no body: the headers' answer is the pick
            out._take_pick(common, first.dynamic_metadata)
            return out
        if common.HasField("header_mutation") or common.HasField("body_mutation"):
            raise ProtocolError(f"BUFFERED: the headers' answer must be a plain CONTINUE, got {first}")
        out.headers_continued = True
        self.send(
            pb.ProcessingRequest(
                request_body=pb.HttpBody(body=body, end_of_stream=trailers is None),
                metadata_context=subset_metadata(body_subset),
            )
        )
        answer = self.recv()
        if answer.WhichOneof("response") == "immediate_response":
            out.immediate = answer.immediate_response
            return out
        _expect(answer, "request_body")
        common = answer.request_body.response
        out._take_pick(common, answer.dynamic_metadata)
        mutation = common.body_mutation
        out.body = mutation.body if mutation.WhichOneof("mutation") == "body" else body
        if trailers is not None:
            self.send_trailers(trailers)
            out.trailers_answer = self._next_trailers_answer()
        return out

    def _next_trailers_answer(self) -> Any:
        msg = self.recv()
        _expect(msg, "request_trailers")
        return msg.request_trailers

    def _read_pick(self, bodied: bool, trailers: bool = False) -> Picked:
        """The picker's answers to a request: the routed headers (+ the body chunks, + the trailers' answer),
        or an ImmediateResponse."""
        out = Picked()
        first = self.recv()
        if first.WhichOneof("response") == "immediate_response":
            out.immediate = first.immediate_response
            return out
        _expect(first, "request_headers")
        out._take_pick(first.request_headers.response, first.dynamic_metadata)
        if not bodied and not trailers:
            return out
        parts = []
        while True:
            msg = self.recv()
            if trailers and msg.WhichOneof("response") == "request_trailers":
                out.trailers_answer = msg.request_trailers  # after the body, which trailers end
                break
            _expect(msg, "request_body")
            streamed = msg.request_body.response.body_mutation.streamed_response
            parts.append(streamed.body)
            out.chunk_sizes.append(len(streamed.body))
            out.eos_flags.append(streamed.end_of_stream)
            if streamed.end_of_stream and not trailers:
                break
        out.body = b"".join(parts)
        return out

    def relay_response(
        self, endpoint: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> bytes:
        """Forward the (possibly rewritten) body to the picked engine, pass the engine's answer through the
        picker's response path as Envoy does, and return what the client receives."""
        with httpx.stream(
            "POST",
            f"http://{endpoint}{path}",
            content=body,
            timeout=30,
            headers={"content-type": "application/json", **(headers or {})},
        ) as resp:
            rh = {":status": str(resp.status_code), **{k: v for k, v in resp.headers.items()}}
            if self.response_mode == BUFFERED:
                return self.respond(rh, [resp.read()])
            client_sees = [self._response_headers(rh)]
            for raw in resp.iter_raw():
                client_sees.append(self._response_chunk(raw, end=False))
        client_sees.append(self._response_chunk(b"", end=True))
        return b"".join(client_sees)

    def respond(self, headers: dict[str, str], pieces: Sequence[bytes]) -> bytes:
        """Pass an answer (response headers with ``:status``, body ``pieces``) through the picker's response path
        in this stream's response mode (BUFFERED: the pieces as one message) and return what the client
        receives."""
        client_sees = [self._response_headers(headers)]
        if self.response_mode == BUFFERED:
            client_sees.append(self._response_chunk(b"".join(pieces), end=True))
        else:
            for piece in pieces:
                client_sees.append(self._response_chunk(piece, end=False))
            client_sees.append(self._response_chunk(b"", end=True))
        return b"".join(client_sees)

    def _response_headers(self, headers: dict[str, str]) -> bytes:
        self.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(headers))))
        answer = self.recv()
        _expect(answer, "response_headers")
        self.response_set_headers = _set_headers(answer.response_headers.response)
        return b""

    def _response_chunk(self, piece: bytes, *, end: bool) -> bytes:
        """Send one response body message and return what the picker lets through for it (full duplex: its
        streamed answers; BUFFERED / STREAMED: the message, or its replacement)."""
        self.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece, end_of_stream=end)))
        msg = self.recv()
        _expect(msg, "response_body")
        mutation = msg.response_body.response.body_mutation
        kind = mutation.WhichOneof("mutation")
        if self.response_mode != FULL_DUPLEX:
            if kind == "streamed_response":
                raise ProtocolError("a streamed_response outside FULL_DUPLEX_STREAMED (Envoy rejects it)")
            return bytes(mutation.body) if kind == "body" else b"" if kind == "clear_body" else piece
        if kind != "streamed_response":
            raise ProtocolError(f"FULL_DUPLEX_STREAMED needs streamed_response answers, got {msg}")
        out = [mutation.streamed_response.body]
        while end and not mutation.streamed_response.end_of_stream:
            msg = self.recv()
            _expect(msg, "response_body")
            mutation = msg.response_body.response.body_mutation
            out.append(mutation.streamed_response.body)
        return b"".join(out)
