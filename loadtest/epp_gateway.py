"""A gateway stand-in for ``kvroute epp`` (tests and ``loadtest.bench_epp``): a gRPC client built from Envoy's
ext_proc protos (the ``xds-protos`` package) that plays Envoy's part of the endpoint-picker protocol in
FULL_DUPLEX_STREAMED mode, plus the HTTP hop to the picked engine (real sockets), so the picker's response path
sees a real engine's answer.

One ``GatewayStream`` is one HTTP request: ``request`` sends the request headers (+ the body in messages of
``chunk`` bytes, as Envoy buffers it) and returns what the picker answered (``Picked``: destination header and
``envoy.lb`` metadata, headers set, the body re-streamed, or the ImmediateResponse); ``relay_response`` forwards
the body to the picked engine and passes the engine's answer through the picker's response path; ``cancel``
resets the stream as Envoy does when the client goes away. Units: bytes, seconds.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

DEST = "x-gateway-destination-endpoint"
#: Envoy's default buffer for one ext_proc body message in the tests, bytes
CHUNK = 65536


def header_map(headers: dict[str, str]) -> Any:
    """An Envoy ``HeaderMap`` (values as ``raw_value`` bytes, as Envoy sends them)."""
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
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

    @property
    def status(self) -> int | None:
        """The ImmediateResponse's HTTP status, or None when a replica was picked."""
        return int(self.immediate.status.code) if self.immediate is not None else None

    def immediate_headers(self) -> dict[str, str]:
        """The headers of the ImmediateResponse."""
        return {h.header.key: h.header.raw_value.decode() for h in self.immediate.headers.set_headers}


class GatewayStream:
    """One ext_proc stream (one HTTP request) to the picker."""

    def __init__(self, stub: Any, timeout: float = 20.0) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self.call = stub.Process(iter(self._q.get, None), timeout=timeout)
        self._answers: Iterator[Any] = iter(self.call)

    def send(self, msg: Any) -> None:
        """Send one ``ProcessingRequest``."""
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
        path: str,
        body: bytes | None,
        *,
        headers: dict[str, str] | None = None,
        subset: list[str] | None = None,
        chunk: int = CHUNK,
        method: str = "POST",
    ) -> Picked:
        """Send the request headers (+ the body in ``chunk``-byte messages) and read the picker's answers."""
        h = {
            ":method": method,
            ":path": path,
            ":authority": "gateway",
            "content-type": "application/json",
            **(headers or {}),
        }
        if body is not None:
            h["content-length"] = str(len(body))
        self.send(
            pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(headers=header_map(h), end_of_stream=body is None),
                metadata_context=subset_metadata(subset),
            )
        )
        if body is not None:
            pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
            for i, piece in enumerate(pieces):
                self.send(
                    pb.ProcessingRequest(
                        request_body=pb.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1)
                    )
                )
        return self._read_pick(body is not None)

    def _read_pick(self, bodied: bool) -> Picked:
        """The picker's answers to a request: the routed headers (+ the body chunks), or an ImmediateResponse."""
        out = Picked()
        first = self.recv()
        if first.WhichOneof("response") == "immediate_response":
            out.immediate = first.immediate_response
            return out
        _expect(first, "request_headers")
        common = first.request_headers.response
        out.clear_route_cache = common.clear_route_cache
        out.set_headers = {
            h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
        }
        out.removed_headers = list(common.header_mutation.remove_headers)
        out.endpoint = out.set_headers.get(DEST)
        lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        out.metadata_endpoint = lb[DEST].string_value if DEST in lb else None
        if not bodied:
            return out
        parts = []
        while True:
            msg = self.recv()
            _expect(msg, "request_body")
            streamed = msg.request_body.response.body_mutation.streamed_response
            parts.append(streamed.body)
            out.chunk_sizes.append(len(streamed.body))
            out.eos_flags.append(streamed.end_of_stream)
            if streamed.end_of_stream:
                break
        out.body = b"".join(parts)
        return out

    def relay_response(
        self, endpoint: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> bytes:
        """Forward the (possibly rewritten) body to the picked engine, pass the engine's answer through the
        picker's response path as Envoy does, and return what the client receives."""
        client_sees: list[bytes] = []
        with httpx.stream(
            "POST",
            f"http://{endpoint}{path}",
            content=body,
            timeout=30,
            headers={"content-type": "application/json", **(headers or {})},
        ) as resp:
            rh = {":status": str(resp.status_code), **{k: v for k, v in resp.headers.items()}}
            self.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(rh))))
            answer = self.recv()
            _expect(answer, "response_headers")
            for raw in resp.iter_raw():
                self.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=raw, end_of_stream=False)))
                client_sees.extend(self._drain_body(until_eos=False))
        self.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
        client_sees.extend(self._drain_body(until_eos=True))
        return b"".join(client_sees)

    def _drain_body(self, until_eos: bool) -> list[bytes]:
        """The response-body answers to one message (the picker answers every chunk, empty ones excepted)."""
        out = []
        while True:
            msg = self.recv()
            _expect(msg, "response_body")
            streamed = msg.response_body.response.body_mutation.streamed_response
            out.append(streamed.body)
            if streamed.end_of_stream or not until_eos:
                return out


def stub_for(port: int, host: str = "127.0.0.1") -> tuple[grpc.Channel, Any]:
    """A channel and an ``ExternalProcessor`` stub for the picker at ``host:port``."""
    channel = grpc.insecure_channel(f"{host}:{port}")
    return channel, pb_grpc.ExternalProcessorStub(channel)
