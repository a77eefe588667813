"""Abuse of the router's newer surfaces next to a load (the soak's ``--abuse``): the endpoint picker, tenants and
priorities, and the prefill/decode (PD) legs. Bounded clients in threads, like ``loadtest.abuse.AbuseClients``
(which this extends: the same tallies, /healthz poller and result), each kind answered as designed or counted as
``unexpected``:

* **picker** (``kvroute epp``'s gRPC ext_proc, through the real gateway client ``loadtest.epp_gateway``):
  ``picker_keyless`` (a stream without an API key, plain and with an encoded path ``/v1%2Fcompletions``: refused
  with an ImmediateResponse 401/403/404, never picked), ``picker_double_pick`` (a second request phase on a
  picked stream: refused, never a second pick; the soak checks no in-flight count leaks), ``picker_trickle`` (a
  body sent in 2-byte messages every 0.2 s: cut within ``cut_within_s``), ``picker_split_usage`` (an engine's
  streamed answer, its usage event included, passed through the picker in 5-byte messages: a complete stream);
* **tenants**: ``tenant_flood_critical`` (one tenant floods with ``x-kvroute-priority: critical``; queueing,
  quota or priority refusals are answers by design) next to ``tenant_standard`` (another tenant's steady
  standard requests: their successes are reported), and ``tenant_many_names`` (each request a new tenant name);
* **PD** (a model served by a prefill and a decode engine): ``pd_client_transfer`` (client-supplied
  ``kv_transfer_params``, SGLang ``bootstrap_*`` fields, ``routed_dp_rank`` and ``X-data-parallel-rank``: served
  with them stripped, or refused 400), ``pd_deep_json`` (a field nested 300 levels deep: served or refused 400,
  never a 500), ``pd_huge_prefill`` (a model whose prefill engine, ``HostilePrefill``, answers 14 MB with 1M
  ``kv_transfer_params`` keys: a 502 or a served answer, never a 500 or a stalled router).

Every target address is the router's own on 127.0.0.1; engine-facing fields name 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from loadtest.abuse import ABUSE_OK_STATUSES, AbuseClients, AbuseOptions

#: the answers each new kind may get by design ("refused": an ImmediateResponse or the stream aborted; "cut":
#: the stream ended before the body did; "engine_gone": the picked engine refused the connection, i.e. the soak's
#: fault killed it between the pick and the gateway's connect, a race no picker can close (health probes notice a
#: dead engine within their interval; a gateway retries such a connect failure on another pick))
DESIGNED: dict[str, frozenset[str]] = {
    "picker_keyless": frozenset({"401", "403", "404"}),
    "picker_double_pick": frozenset({"refused"}),
    "picker_trickle": frozenset({"cut", "400", "408", "413"}),
    "picker_split_usage": frozenset({"200", "engine_gone"}),
    "tenant_flood_critical": frozenset({"200", "400", "403", "429", "503"}),
    "tenant_standard": frozenset({"200", "429", "503"}),
    "tenant_many_names": frozenset({"200", "400", "401", "403", "429", "503"}),
    "pd_client_transfer": frozenset({"200", "400"}),
    "pd_deep_json": frozenset({"200", "400", "413"}),
    "pd_huge_prefill": frozenset({"200", "502", "503"}),
}


@dataclass
class SurfaceOptions:
    """Where the newer surfaces are and how much of each abuse to send (counts per kind; times in seconds).

    ``epp_port``: the picker's gRPC port (None: no picker abuse); ``pd_model``: a model served by a prefill and a
    decode engine; ``pd_huge_model``: a model whose prefill engine is a ``HostilePrefill`` (None: skipped).
    """

    epp_port: int | None = None
    pd_model: str | None = None
    pd_huge_model: str | None = None
    picker_count: int = 4
    trickle_bytes: int = 200
    tenant_flood: int = 60
    tenant_flood_threads: int = 6
    tenant_standard: int = 20
    tenant_names: int = 400
    pd_count: int = 6


class SurfaceAbuse(AbuseClients):
    """``AbuseClients`` plus the picker, tenant and PD abuse of the module docstring."""

    def __init__(self, opts: AbuseOptions, surfaces: SurfaceOptions) -> None:
        super().__init__(opts)
        self.s = surfaces
        self._auth_header = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}

    def kinds(self) -> list[tuple[str, Callable[[], None]]]:
        """The base kinds plus those whose surface is configured."""
        kinds = super().kinds()
        if self.s.epp_port is not None:
            kinds += [
                ("picker_keyless", self._picker_keyless),
                ("picker_double_pick", self._picker_double_pick),
                ("picker_trickle", self._picker_trickle),
                ("picker_split_usage", self._picker_split_usage),
            ]
        kinds += [
            (f"tenant_flood_critical-{i}", self._tenant_flood) for i in range(self.s.tenant_flood_threads)
        ]
        kinds += [("tenant_standard", self._tenant_standard), ("tenant_many_names", self._tenant_names)]
        if self.s.pd_model is not None:
            kinds += [("pd_client_transfer", self._pd_transfer), ("pd_deep_json", self._pd_deep)]
        if self.s.pd_huge_model is not None:
            kinds.append(("pd_huge_prefill", self._pd_huge))
        return kinds

    def designed(self, kind: str) -> frozenset[str]:
        """``DESIGNED`` for the new kinds, the base set for the others."""
        return DESIGNED.get(kind, ABUSE_OK_STATUSES)

    # -- the picker ------------------------------------------------------------------------------------------
    def _completion(self, stream: bool = False, **extra: Any) -> bytes:
        body: dict[str, Any] = {"model": self.o.model, "prompt": "abuse " * 8, "max_tokens": 4, **extra}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return orjson.dumps(body)

    def _picker_stream(self, timeout_s: float = 20.0) -> tuple[Any, Any]:
        from loadtest.epp_gateway import GatewayStream, stub_for

        assert self.s.epp_port is not None
        channel, stub = stub_for(self.s.epp_port)
        return channel, GatewayStream(stub, timeout=timeout_s)

    def _picker_once(self, kind: str, fn: Callable[[Any], str]) -> None:
        """One picker stream: ``fn(stream)`` returns the outcome; a gRPC error (the picker aborted the stream)
        counts as ``refused`` / ``cut`` where the kind allows it, else as ``grpc_error``."""
        import grpc

        channel, stream = self._picker_stream(self.o.cut_within_s + 5)
        try:
            self._record(kind, fn(stream))
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._record(kind, "no_answer", f"no answer within {self.o.cut_within_s + 5:g}s")
            else:
                aborted = {"picker_trickle": "cut", "picker_double_pick": "refused"}.get(kind, "grpc_error")
                self._record(kind, aborted, f"{code}: {exc}"[:200])
        finally:
            stream.cancel()
            channel.close()

    def _picker_keyless(self) -> None:
        """No API key, on the plain path and an encoded one: refused, never routed."""
        for i in range(self.s.picker_count):
            if self._stop.is_set():
                return
            path = "/v1/completions" if i % 2 == 0 else "/v1%2Fcompletions"

            def keyless(st: Any, path: str = path) -> str:
                return _picked_status(st.request(path, self._completion()))

            self._picker_once("picker_keyless", keyless)
            self._stop.wait(self.o.pause_s)

    def _picker_double_pick(self) -> None:
        """A second request phase on a stream already picked: refused."""

        def twice(st: Any) -> str:
            first = st.request("/v1/completions", self._completion(), headers=self._auth_header)
            if first.immediate is not None:
                return f"first_{first.status}"
            second = st.request("/v1/completions", self._completion(), headers=self._auth_header)
            return "refused" if second.immediate is not None else "picked_twice"

        for _ in range(self.s.picker_count):
            if self._stop.is_set():
                return
            self._picker_once("picker_double_pick", twice)
            self._stop.wait(self.o.pause_s)

    def _picker_trickle(self) -> None:
        """A body in 2-byte messages every 0.2 s: the picker must cut it within ``cut_within_s``."""
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        from loadtest.epp_gateway import header_map

        def trickle(st: Any) -> str:
            body = self._completion()[: self.s.trickle_bytes]
            heads = {":method": "POST", ":path": "/v1/completions", ":authority": "gateway"}
            heads |= {"content-type": "application/json", "content-length": str(10 * len(body))}
            st.send(
                pb.ProcessingRequest(
                    request_headers=pb.HttpHeaders(headers=header_map({**heads, **self._auth_header}))
                )
            )
            done = threading.Event()

            def drip() -> None:
                for i in range(0, len(body), 2):
                    if done.is_set() or self._stop.is_set():
                        return
                    st.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body[i : i + 2])))
                    done.wait(0.2)  # the client's pace

            th = threading.Thread(target=drip, daemon=True)
            th.start()
            try:
                answer = st.recv()
            finally:
                done.set()
                th.join(timeout=5)
            if answer.WhichOneof("response") == "immediate_response":
                return str(int(answer.immediate_response.status.code))
            return "not_cut"

        for _ in range(max(1, self.s.picker_count // 2)):
            if self._stop.is_set():
                return
            self._picker_once("picker_trickle", trickle)

    def _picker_split_usage(self) -> None:
        """A streamed answer (usage event included) passed through the picker in 5-byte messages."""
        for _ in range(self.s.picker_count):
            if self._stop.is_set():
                return
            self._picker_once("picker_split_usage", self._split_usage_once)
            self._stop.wait(self.o.pause_s)

    def _split_usage_once(self, st: Any) -> str:
        picked = st.request("/v1/completions", self._completion(stream=True), headers=self._auth_header)
        if picked.immediate is not None or not picked.endpoint:
            return f"not_picked_{picked.status}"
        seen: list[bytes] = []
        try:
            return self._relay_split(st, picked, seen)
        except httpx.ConnectError:
            return "engine_gone"

    def _relay_split(self, st: Any, picked: Any, seen: list[bytes]) -> str:
        """Stream the picked engine's answer through the picker in 5-byte messages (``seen``: what it passed on);
        the outcome."""
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        from loadtest.epp_gateway import header_map

        with httpx.stream(
            "POST",
            f"http://{picked.endpoint}/v1/completions",
            content=picked.body,
            timeout=30,
            headers={"content-type": "application/json"},
        ) as resp:
            rh = {":status": str(resp.status_code), **dict(resp.headers.items())}
            st.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(rh))))
            st.recv()
            for raw in resp.iter_raw():
                for i in range(0, len(raw), 5):
                    st.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=raw[i : i + 5])))
                    msg = st.recv()
                    seen.append(msg.response_body.response.body_mutation.streamed_response.body)
        st.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
        while True:
            streamed = st.recv().response_body.response.body_mutation.streamed_response
            seen.append(streamed.body)
            if streamed.end_of_stream:
                break
        text = b"".join(seen)
        return "200" if b"[DONE]" in text and b'"usage"' in text else "incomplete"

    # -- tenants ---------------------------------------------------------------------------------------------
    def _post_kind(self, c: httpx.Client, kind: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        """A request naming a tenant, sent as an edge gateway would (its key may name tenants: tenant_header_keys;
        a plain client key naming a tenant is refused 403 by design)."""
        auth = {"authorization": f"Bearer {self.o.edge_key}"} if self.o.edge_key else self._auth_header
        self._post(c, kind, path, body, {**auth, **headers})

    def _tenant_flood(self) -> None:
        """One tenant floods with the top priority class."""
        per_thread = max(1, self.s.tenant_flood // max(1, self.s.tenant_flood_threads))
        heads = {"x-kvroute-tenant": "flooder", "x-kvroute-priority": "critical"}
        with httpx.Client(timeout=60) as c:
            for _ in range(per_thread):
                if self._stop.is_set():
                    return
                self._post_kind(c, "tenant_flood_critical", "/v1/completions", self._completion(), heads)

    def _tenant_standard(self) -> None:
        """Another tenant's steady standard requests while the flood runs."""
        heads = {"x-kvroute-tenant": "victim", "x-kvroute-priority": "standard"}
        with httpx.Client(timeout=60) as c:
            for _ in range(self.s.tenant_standard):
                if self._stop.is_set():
                    return
                self._post_kind(c, "tenant_standard", "/v1/completions", self._completion(), heads)
                self._stop.wait(self.o.pause_s)

    def _tenant_names(self) -> None:
        """Every request names a new tenant (metric labels, quota state)."""
        with httpx.Client(timeout=60) as c:
            for i in range(self.s.tenant_names):
                if self._stop.is_set():
                    return
                heads = {"x-kvroute-tenant": f"t{i}-{time.monotonic_ns() % 1_000_003}"}
                body = orjson.dumps({"model": self.o.model, "prompt": "x", "max_tokens": 1})
                self._post_kind(c, "tenant_many_names", "/v1/completions", body, heads)

    # -- PD --------------------------------------------------------------------------------------------------
    def _pd_transfer(self) -> None:
        """Client-supplied KV-transfer and bootstrap fields (all naming 127.0.0.1 and a closed port)."""
        assert self.s.pd_model is not None
        evil = {
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_host": "127.0.0.1",
                "remote_port": 9,
                "remote_engine_id": "client-chosen",
                "remote_block_ids": [1, 2, 3],
            },
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 9,
            "bootstrap_room": 12345,
            "routed_dp_rank": 3,
            "disagg_prefill_dp_rank": 2,
        }
        body = orjson.dumps({"model": self.s.pd_model, "prompt": "pd " * 20, "max_tokens": 4, **evil})
        with httpx.Client(timeout=60) as c:
            for _ in range(self.s.pd_count):
                if self._stop.is_set():
                    return
                self._post_kind(
                    c, "pd_client_transfer", "/v1/completions", body, {"x-data-parallel-rank": "5"}
                )
                self._stop.wait(self.o.pause_s)

    def _pd_deep(self) -> None:
        """A field nested 300 levels deep (written by hand: orjson refuses to encode it)."""
        assert self.s.pd_model is not None
        deep = b'{"a":' * 300 + b"1" + b"}" * 300
        body = b'{"model": "%s", "prompt": "deep json", "max_tokens": 4, "extra_deep": %s}' % (
            self.s.pd_model.encode(),
            deep,
        )
        with httpx.Client(timeout=60) as c:
            for _ in range(self.s.pd_count):
                if self._stop.is_set():
                    return
                self._post_kind(c, "pd_deep_json", "/v1/completions", body, {})
                self._stop.wait(self.o.pause_s)

    def _pd_huge(self) -> None:
        """Requests to the model whose prefill engine answers 14 MB with 1M parameter keys."""
        assert self.s.pd_huge_model is not None
        body = orjson.dumps({"model": self.s.pd_huge_model, "prompt": "huge " * 10, "max_tokens": 4})
        with httpx.Client(timeout=60) as c:
            for _ in range(self.s.pd_count):
                if self._stop.is_set():
                    return
                self._post_kind(c, "pd_huge_prefill", "/v1/completions", body, {})
                self._stop.wait(self.o.pause_s)


def _picked_status(picked: Any) -> str:
    """The ImmediateResponse's status, or ``picked_without_key`` when the picker routed the request."""
    return str(picked.status) if picked.immediate is not None else "picked_without_key"


# -- a hostile prefill engine ----------------------------------------------------------------------------------


def huge_prefill_answer(keys: int = 1_000_000) -> bytes:
    """A vLLM prefill answer whose ``kv_transfer_params`` has ``keys`` keys (~14 MB for 1M)."""
    params = b",".join(b'"k%d":0' % i for i in range(keys))
    return (
        b'{"id":"cmpl-hostile","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
        b'"text":"x","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":1,'
        b'"completion_tokens":1,"total_tokens":2},"kv_transfer_params":{' + params + b"}}"
    )


class HostilePrefill:
    """A loopback engine (vLLM dialect) for one model whose every completion answer is ``huge_prefill_answer``;
    ``/health``, ``/v1/models`` and an empty ``/metrics`` answer normally. An asyncio server in a thread;
    ``close`` stops it."""

    def __init__(self, model: str, port: int, keys: int = 1_000_000) -> None:
        self.model = model
        self.port = port
        self.answer = huge_prefill_answer(keys)
        self.completions = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="hostile-prefill")

    def start(self) -> HostilePrefill:
        """Start serving on 127.0.0.1:``port``."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("hostile prefill engine did not start")
        return self

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *fields = head.decode("latin-1").split("\r\n")
            method, path = line.split(" ")[:2]
            length = 0
            for f in fields:
                name, _, value = f.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if length:
                await reader.readexactly(length)
            status, ctype, body = self._answer(method, path)
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n".encode("latin-1")
                + body
            )
            await writer.drain()
        except (OSError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def _answer(self, method: str, path: str) -> tuple[str, str, bytes]:
        if path.startswith("/health"):
            return "200 OK", "application/json", b"{}"
        if path.startswith("/v1/models"):
            data = {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": 4096}]}
            return "200 OK", "application/json", orjson.dumps(data)
        if path.startswith("/metrics"):
            return "200 OK", "text/plain", b""
        if method == "POST" and path.startswith("/v1/"):
            self.completions += 1
            return "200 OK", "application/json", self.answer
        return "404 Not Found", "application/json", b'{"error": "not found"}'
