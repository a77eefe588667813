"""Proxy behaviour against real tiny HTTP servers on loopback: retries before the first byte, 4xx passthrough,
timeouts, SSE passthrough and mid-stream failure, cancellation, request ids, in-flight accounting.

The router runs in-process (uvicorn in a thread); the engines are tiny Starlette apps (uvicorn threads) or a
raw asyncio server that drops connections. No module of ours is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.config import load_settings
from router.http.app import create_app
from tests.helpers import LoopServer, free_port, wait_until


class ServerThread:
    """Run an ASGI app with uvicorn on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app: Any) -> None:
        # bind now (port 0) and hand the socket to uvicorn: no window for another process to take the port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def app(self) -> Any:
        """The ASGI app being served, as given."""
        return self.server.config.app

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=10, what="server start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@dataclass
class EngineState:
    mode: str = "ok"  # ok | 500 | 400 | hang | midstream_fail
    posts: int = 0
    request_ids: list[str] = field(default_factory=list)
    cancelled: int = 0
    cached_tokens: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    #: answers POST /tokenize with these ids when set (else 404, as an engine without that endpoint)
    tokenize: Callable[[str], list[int]] | None = None


def tiny_engine(state: EngineState) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        state.posts += 1
        state.request_ids.append(request.headers.get("x-request-id", ""))
        usage = {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": state.cached_tokens},
        }
        if state.mode == "500":
            return JSONResponse({"error": "engine exploded"}, status_code=500)
        if state.mode == "garbage":
            return Response(b"\x00\x01 definitely not json", media_type="application/json")
        if state.mode == "bad_sse" and body.get("stream"):
            return Response(b"this is not an event stream\n\n", media_type="text/event-stream")
        if state.mode == "400":
            return JSONResponse({"error": {"message": "max_tokens too large"}}, status_code=400)
        if state.mode == "hang":  # like vLLM's @with_cancellation: abort when the client goes away
            sleeper = asyncio.ensure_future(asyncio.sleep(30))
            watcher = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({sleeper, watcher}, return_when=asyncio.FIRST_COMPLETED)
            sleeper.cancel()
            watcher.cancel()
            if watcher.done() and not watcher.cancelled():
                state.cancelled += 1
                return Response(status_code=499)
        if body.get("stream"):

            async def gen() -> Any:
                try:
                    for i in range(3):
                        yield f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode()
                        await asyncio.sleep(0.01)
                    if state.mode == "midstream_fail":
                        raise RuntimeError("engine died mid-stream")
                    if state.mode == "slow_stream":
                        await asyncio.sleep(30)
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                except asyncio.CancelledError:
                    state.cancelled += 1
                    raise

            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "ok"}], "usage": usage})

    async def tokenize(request: Request) -> Response:
        if state.tokenize is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        ids = state.tokenize((await request.json())["prompt"])
        return JSONResponse({"tokens": ids, "count": len(ids)})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
        ]
    )


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class DroppingEngine:
    """Raw asyncio HTTP server: answers GET /health and /v1/models, drops every POST without answering.

    It serves on its own event loop thread (``tests.helpers.LoopServer``: closing an ``asyncio.Server`` from the
    test thread while the loop thread finishes a connection raced into ``TypeError: 'NoneType' object is not
    iterable`` on a busy machine).
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.posts = 0
        self.net = LoopServer(self._handle, self.port)
        self._hold: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # peer gone
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0]
                length = 0
                for h in head.split(b"\r\n")[1:]:
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if line.startswith(b"POST"):
                    self.posts += 1
                    return
                body = b'{"object":"list","data":[{"id":"m"}]}' if b"/v1/models" in line else b"{}"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                await writer.drain()

    def refuse(self) -> None:
        """From now on refuse every connection: stop listening, end the open ones, keep the port bound.

        The port stays bound without ``listen`` until ``__exit__``, so every connect gets a reset and no other
        process on the shared machine can take the port meanwhile.
        """
        self.net.shutdown()
        hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # our closed connections sit in TIME_WAIT
        hold.bind(("127.0.0.1", self.port))
        self._hold = hold

    def __enter__(self) -> DroppingEngine:
        self.net.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.net.__exit__(*exc)
        finally:
            if self._hold is not None:
                self._hold.close()


def router_for(urls: list[str], *extra: str) -> ServerThread:
    args = [
        "--host",
        "127.0.0.1",
        "--policy",
        "round_robin",
        "--probe-interval-s",
        "0.2",
        "--tokenizer-mode",
        "bytes",
        "--max-retries",
        "2",
        "--log-level",
        "warning",
        "--log-format",
        "text",
        # tolerate a CPU-starved shared machine (slow accepts / probes are not what these tests check)
        "--connect-timeout-s",
        "10",
        "--probe-timeout-s",
        "5",
        "--unhealthy-after",
        "10",
    ]
    for i, url in enumerate(urls):
        args += ["--replica", f"name=e{i},url={url},model=m"]
    settings = load_settings([*args, *extra])
    return ServerThread(create_app(settings))


def metric(router: ServerThread, name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(router.url + "/metrics").text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


def ready(router: ServerThread, n: int) -> None:
    wait_until(
        lambda: httpx.get(router.url + "/readyz").json().get("routable_replicas") == n,
        timeout=30,
        what=f"{n} routable replicas",
    )


def inflight(router: ServerThread) -> list[int]:
    return [r["load"]["inflight_requests"] for r in httpx.get(router.url + "/replicas").json()["replicas"]]


@pytest.fixture
def good() -> Iterator[tuple[EngineState, ServerThread]]:
    st = EngineState()
    with ServerThread(tiny_engine(st)) as srv:
        yield st, srv


BODY = {"model": "m", "prompt": "hello there, a prompt long enough to have a few blocks" * 3, "max_tokens": 3}


def test_5xx_before_first_byte_is_retried_on_another_replica(good: tuple[EngineState, ServerThread]) -> None:
    gst, gsrv = good
    bst = EngineState(mode="500")
    with ServerThread(tiny_engine(bst)) as bsrv, router_for([bsrv.url, gsrv.url]) as router:
        ready(router, 2)
        for _ in range(4):
            r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-replica"] == "e1"
        assert bst.posts >= 1 and gst.posts == 4
        assert metric(router, "kvroute_retries_total", {"reason": "engine_500"}) == bst.posts
        assert inflight(router) == [0, 0]


def test_dropped_and_refused_connections_are_retried(good: tuple[EngineState, ServerThread]) -> None:
    """A dropped connection (e0) and a refused connect (e2, ready until the requests start) are both retried on
    the next replica of the ranking (e1); retries are counted by reason and nothing stays in flight.

    Nothing here depends on timing: round-robin over the 3 ready replicas puts each one first at least once in
    6 requests, 3 attempts (``--max-retries 2``) always reach e1, and e0 / e2 cannot turn unhealthy during the
    test (``--unhealthy-after 100000``), so the ranking stays the same however slow the machine is.
    """
    gst, gsrv = good
    with (
        DroppingEngine() as drop,
        DroppingEngine() as gone,
        router_for([drop.url, gsrv.url, gone.url], "--unhealthy-after", "100000") as router,
    ):
        ready(router, 3)
        gone.refuse()
        for stream in (False, True, False, True, False, True):
            r = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-replica"] == "e1"
        assert gst.posts == 6 and drop.posts >= 1 and gone.posts == 0
        assert metric(router, "kvroute_retries_total", {"reason": "connection_lost"}) == drop.posts
        assert metric(router, "kvroute_retries_total", {"reason": "connect_error"}) >= 1
        assert metric(router, "kvroute_retries_total") == drop.posts + metric(
            router, "kvroute_retries_total", {"reason": "connect_error"}
        )
        assert inflight(router) == [0, 0, 0]


def test_all_attempts_fail_is_a_clear_502_with_bounded_attempts() -> None:
    states = [EngineState(mode="500") for _ in range(4)]
    servers = [ServerThread(tiny_engine(s)) for s in states]
    for s in servers:
        s.__enter__()
    try:
        with router_for([s.url for s in servers], "--max-retries", "2") as router:
            ready(router, 4)
            r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 502
            err = r.json()["error"]
            assert "after 3 attempt(s)" in err["message"] and "engine answered 500" in err["message"]
            assert sum(s.posts for s in states) == 3
            assert metric(router, "kvroute_upstream_errors_total", {"reason": "engine_500"}) == 1
            assert inflight(router) == [0, 0, 0, 0]
    finally:
        for s in servers:
            s.__exit__()


def test_engine_4xx_is_passed_through_without_retry(good: tuple[EngineState, ServerThread]) -> None:
    gst, gsrv = good
    bst = EngineState(mode="400")
    with ServerThread(tiny_engine(bst)) as bsrv, router_for([bsrv.url, gsrv.url]) as router:
        ready(router, 2)
        codes: Counter[int] = Counter()
        for _ in range(2):
            r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
            codes[r.status_code] += 1
            if r.status_code == 400:
                assert r.json() == {"error": {"message": "max_tokens too large"}}
        assert codes == {400: 1, 200: 1}
        assert bst.posts == 1 and gst.posts == 1


def test_first_byte_timeout_is_a_clear_504_and_cancels_upstream() -> None:
    st = EngineState(mode="hang")
    with (
        ServerThread(tiny_engine(st)) as srv,
        router_for([srv.url], "--first-byte-timeout-s", "0.5") as router,
    ):
        ready(router, 1)
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 504
        assert "first_byte_timeout_s" in r.json()["error"]["message"]
        assert st.posts == 1  # a timeout is not retried (the engine may still be working on it)
        wait_until(lambda: st.cancelled == 1, timeout=5, what="engine saw the cancellation")
        assert inflight(router) == [0]


def test_streaming_passthrough_usage_and_request_id(good: tuple[EngineState, ServerThread]) -> None:
    gst, gsrv = good
    gst.cached_tokens = 0
    with router_for([gsrv.url]) as router:
        ready(router, 1)
        with httpx.stream(
            "POST",
            router.url + "/v1/completions",
            json={**BODY, "stream": True},
            headers={"x-request-id": "req-123"},
            timeout=10,
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-request-id"] == "req-123"
            text = "".join(r.iter_text())
        events = [e for e in text.split("\n\n") if e]
        assert events[0] == 'data: {"choices": [{"text": "0"}]}' and events[-1] == "data: [DONE]"
        assert gst.request_ids[-1] == "req-123"
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        generated = r.headers["x-request-id"]
        assert len(generated) == 32 and gst.request_ids[-1] == generated
        # engine-reported cached tokens were compared with the prediction: the first request was cold (0 = 0);
        # the second was predicted to hit (no KV events -> predicted entries) but this engine reports 0
        assert metric(router, "kvroute_cached_tokens_match_total", {"result": "exact"}) == 1
        assert metric(router, "kvroute_cached_tokens_match_total", {"result": "over"}) == 1
        assert metric(router, "kvroute_predicted_cached_tokens_total") > 0
        assert metric(router, "kvroute_engine_cached_tokens_total") == 0
        assert metric(router, "kvroute_ttft_seconds_count", {"replica": "e0"}) == 2


def test_mid_stream_failure_ends_with_an_sse_error_event() -> None:
    st = EngineState(mode="midstream_fail")
    with ServerThread(tiny_engine(st)) as srv, router_for([srv.url]) as router:
        ready(router, 1)
        with httpx.stream(
            "POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10
        ) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        assert text.startswith('data: {"choices": [{"text": "0"}]}')
        assert "event: error\ndata: " in text
        err = json.loads(text.split("event: error\ndata: ", 1)[1].split("\n", 1)[0])
        assert err["error"]["code"] == "stream_broken" and "mid-stream" in err["error"]["message"]
        assert inflight(router) == [0]


def test_client_disconnect_cancels_the_upstream_stream() -> None:
    st = EngineState(mode="slow_stream")
    with ServerThread(tiny_engine(st)) as srv, router_for([srv.url]) as router:
        ready(router, 1)
        with httpx.stream(
            "POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10
        ) as r:
            it = r.iter_raw()
            assert next(it).startswith(b"data: ")
        wait_until(lambda: st.cancelled == 1, timeout=5, what="engine saw the stream cancelled")
        wait_until(lambda: inflight(router) == [0], timeout=5, what="in-flight released")


def test_client_disconnect_cancels_a_queued_request() -> None:
    st = EngineState(mode="hang")
    with ServerThread(tiny_engine(st)) as srv, router_for([srv.url]) as router:
        ready(router, 1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=BODY, timeout=0.5)
        wait_until(lambda: st.cancelled == 1, timeout=5, what="engine saw the request cancelled")
        wait_until(lambda: inflight(router) == [0], timeout=5, what="in-flight released")


def test_engine_garbage_is_a_clear_502() -> None:
    st = EngineState(mode="garbage")
    with ServerThread(tiny_engine(st)) as srv, router_for([srv.url]) as router:
        ready(router, 1)
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "upstream_bad_body" and "not JSON" in err["message"]
        assert metric(router, "kvroute_upstream_errors_total", {"reason": "bad_body"}) == 1
        assert inflight(router) == [0]


def test_panic_routing_serves_when_every_replica_looks_unhealthy(
    good: tuple[EngineState, ServerThread],
) -> None:
    from membership.replicas import ReplicaState

    gst, gsrv = good
    refused = f"http://127.0.0.1:{free_port()}"
    # probes every 60 s: the states set below stay as set during the test
    with router_for([refused, gsrv.url], "--probe-interval-s", "60") as router:
        wait_until(lambda: httpx.get(router.url + "/healthz").status_code == 200, timeout=10, what="up")
        svc = router.app.state.services
        svc.table.set_state("e0", ReplicaState.UNHEALTHY)  # really down
        svc.table.set_state("e1", ReplicaState.UNHEALTHY)  # a false positive
        for _ in range(3):
            r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-replica"] == "e1"
        assert metric(router, "kvroute_panic_decisions") >= 1


# -- the engine edge: usage on streams, SSE validation, TLS errors (issues 18 and 24) ----------------------------


def test_ask_for_usage_adds_the_option_only_when_the_client_did_not_ask() -> None:
    from router.engine.sse import ask_for_usage

    body, added = ask_for_usage(b'{"model": "m", "stream": true}  ')
    assert added and json.loads(body) == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body, added = ask_for_usage(b"{}")
    assert added and json.loads(body) == {"stream_options": {"include_usage": True}}
    asked = b'{"stream": true, "stream_options": {"include_usage": true}}'
    assert ask_for_usage(asked) == (asked, False)
    body, added = ask_for_usage(
        b'{"stream_options": {"include_usage": false, "continuous_usage_stats": true}}'
    )
    assert added and json.loads(body)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    # the words in a prompt are not the option
    body, added = ask_for_usage(b'{"prompt": "say \\"stream_options\\"", "stream": true}')
    assert added and json.loads(body)["stream_options"] == {"include_usage": True}
    assert ask_for_usage(b"not json") == (b"not json", False)


def _usage_reference(body: bytes) -> tuple[bytes, bool]:
    """``ask_for_usage``'s common case as it was written first (strip, slice, concatenate: four copies)."""
    head = body.rstrip()
    if not head.endswith(b"}"):
        return body, False
    inner = head[:-1].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    return inner + sep + b'"stream_options":{"include_usage":true}' + b"}", True


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [b"{", b"}", b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c", b",", b'"a"', b":", b"1", b"\xa0"]
        ),
        max_size=12,
    )
)
def test_ask_for_usage_builds_the_same_body_in_one_copy(parts: list[bytes]) -> None:
    from router.engine.sse import ask_for_usage

    body = b"".join(parts)
    got = ask_for_usage(body)
    assert got == _usage_reference(body)
    assert type(got[0]) is bytes


def test_sse_validator_passes_vllm_streams_and_strips_usage() -> None:
    from router.engine.sse import SSEValidator

    chunk = b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n'
    v = SSEValidator(strip_usage=True, max_event_bytes=1 << 20)
    out = (
        v.feed(chunk[:10])
        + v.feed(chunk[10:] + b": keep-alive comment\n\n")
        + v.feed(usage + b"data: [DONE]\n\n")
    )
    assert out == b'data: {"choices":[{"text":"a"}]}\n\n: keep-alive comment\n\ndata: [DONE]\n\n'
    v.end()
    keep = SSEValidator(strip_usage=False, max_event_bytes=1 << 20)
    assert keep.feed(chunk + usage + b"data: [DONE]\r\n\r\n") == chunk + usage + b"data: [DONE]\n\n"
    keep.end()


def test_sse_validator_cuts_sglangs_null_usage_keeping_the_engines_bytes() -> None:
    """SGLang's ``/v1/completions`` token chunks end with ``"usage":null`` (pydantic, compact): with usage stripped,
    the member is cut from the engine's bytes (its escapes and number formats kept), on the per-token fast path
    and on the general path (split pieces, the first event), and nothing else is touched."""
    from router.engine.sse import SSEValidator

    def chunk(text: bytes) -> bytes:
        return (
            b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"'
            + text
            + b'","logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}\n\n'
        )

    tokens = [chunk(b"caf\\u00e9"), chunk(b" 1.0e-05"), chunk(b' \\"quoted\\"')]
    want = [c.replace(b',"usage":null}', b"}") for c in tokens]
    v = SSEValidator(strip_usage=True, max_event_bytes=1 << 20)
    assert v.feed(tokens[0][:20]) == b""
    assert v.feed(tokens[0][20:]) == want[0]  # the first event (parsed as JSON), whole once joined
    assert [v.feed(c) for c in tokens[1:]] == want[1:]  # the per-token fast path
    assert v.feed(tokens[1] + tokens[2]) == want[1] + want[2]  # two events in one piece: the general path
    usage = b'data: {"id":"c1","object":"text_completion","choices":[],"usage":{"prompt_tokens":3}}\n\n'
    assert v.feed(usage + b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    v.end()
    other = SSEValidator(strip_usage=True, max_event_bytes=1 << 20)
    assert other.feed(chunk(b"x")) == want[0].replace(b"caf\\u00e9", b"x")
    # escaped quotes in a token's text are not a member: still cut from the bytes
    escaped = chunk(b'say \\"usage\\"')
    assert other.feed(escaped) == escaped.replace(b',"usage":null}', b"}")
    # "usage" named elsewhere (a token whose text is the word), or a null usage that is not the last member:
    # the JSON round trip, as before
    word = chunk(b"usage")
    assert json.loads(other.feed(word)[6:]) == {k: v for k, v in json.loads(word[6:]).items() if k != "usage"}
    inner = b'data: {"choices":[{"text":"a","usage":null}],"usage":null}\n\n'
    assert other.feed(inner) == b'data: {"choices":[{"text":"a","usage":null}]}\n\n'
    middle = b'data: {"usage":null,"choices":[{"text":"\\u00e9"}]}\n\n'
    assert json.loads(other.feed(middle)[6:]) == {"choices": [{"text": "\u00e9"}]}
    # a client that asked for usage gets every chunk as the engine sent it
    keep = SSEValidator(strip_usage=False, max_event_bytes=1 << 20)
    assert [keep.feed(c) for c in tokens] == tokens


@pytest.mark.parametrize(
    "stream",
    [
        b"\x00\xff binary\n\n",
        b"data: not json\n\n",
        b'data: ["a list"]\n\n',
        b"hello: world\n\n",
        b'data: {"a": 1}\n\n',  # ends without [DONE]
        b'data: {"a": 1}\n\ndata: {"unfinished',
        b"data: {" + b"x" * 5000,  # one event over the size limit
    ],
)
def test_sse_validator_rejects_garbage(stream: bytes) -> None:
    from router.engine.sse import BadStream, SSEValidator

    v = SSEValidator(strip_usage=False, max_event_bytes=4096)
    with pytest.raises(BadStream):
        v.feed(stream)
        v.end()


def test_tls_failure_to_a_ready_replica_is_a_clear_502(tmp_path: Any) -> None:
    """A replica that is routable (as after a certificate rotation) but whose certificate the router cannot
    verify: the attempt fails with a TLS error naming engine_ca_bundle, counted as a retry reason."""
    from membership.replicas import ReplicaState
    from tests.integration.engine_standins import RawEngine, self_signed, server_context, vllm_like

    cert, key = self_signed(tmp_path)
    with (
        RawEngine(vllm_like(), tls=server_context(cert, key)) as eng,
        router_for([eng.url], "--probe-interval-s", "60") as router,
    ):
        wait_until(lambda: httpx.get(router.url + "/healthz").status_code == 200, timeout=10, what="up")
        svc = router.app.state.services
        svc.table.set_state("e0", ReplicaState.READY)
        r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "tls_error" and "certificate verify failed" in err["message"]
        assert "engine_ca_bundle" in err["message"] and eng.posts() == []
        assert metric(router, "kvroute_upstream_errors_total", {"reason": "tls_error"}) == 1


def test_invalid_first_stream_chunk_releases_every_copy_in_flight() -> None:
    """A stream whose first chunk is already invalid is a clean 502; the in-flight count of a request with
    ``n`` sequences goes back to zero (it was released as one request before the attempt owned its hold)."""
    st = EngineState(mode="bad_sse")
    with ServerThread(tiny_engine(st)) as srv, router_for([srv.url]) as router:
        ready(router, 1)
        r = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": True, "n": 2}, timeout=10)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "upstream_bad_stream"
        assert st.posts == 1
        assert inflight(router) == [0]


def test_attempt_hold_releases_once_whatever_the_path() -> None:
    """``Hold`` counts the request in flight on entry and gives the slot, the prefill tokens and the gate's
    permit back exactly once: on leaving the block, after an explicit release, or (handed over) only when the
    new owner releases."""
    from index.prefix_index import PrefixIndex
    from membership.replicas import ReplicaState, ReplicaTable
    from policies.base import make_policy
    from router.core.routing import Router
    from router.engine.hold import AttemptFailed, Hold

    table = ReplicaTable()
    rep = table.upsert("r0", "http://127.0.0.1:1", models=["m"])
    table.set_state("r0", ReplicaState.READY)
    router = Router(table, PrefixIndex(block_size=16), make_policy("round_robin"), block_size=16)

    def counts() -> tuple[int, int, int]:
        return rep.load.inflight_requests, rep.load.inflight_prefill_tokens, router.pending_prefill_tokens(0)

    with Hold(router, None, rep, 100, 3):
        assert counts() == (3, 100, 100)
    assert counts() == (0, 0, 0)

    with pytest.raises(AttemptFailed):  # a failure before the first byte
        with Hold(router, None, rep, 100, 2) as hold:
            hold.first_byte()
            assert counts() == (2, 0, 0)
            raise AttemptFailed("x", "boom", retry=True)
    assert counts() == (0, 0, 0)

    with Hold(router, None, rep, 50, 1) as hold:
        hold.release()
        hold.release()
    rep.load.inflight_requests = 5  # other requests: a second release would eat one of theirs
    with Hold(router, None, rep, 50, 1) as hold:
        hold.hand_over()
    assert rep.load.inflight_requests == 6  # the new owner holds it
    hold.release()
    hold.release()
    assert rep.load.inflight_requests == 5

    async def cancelled() -> None:
        with Hold(router, None, rep, 10, 1):
            await asyncio.sleep(30)

    async def cancel_it() -> None:
        task = asyncio.ensure_future(cancelled())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    assert rep.load.inflight_requests == 5


def test_sse_validator_joins_events_split_anywhere_without_quadratic_copies() -> None:
    from router.engine.sse import SSEValidator

    stream = (
        b'data: {"choices":[{"text":"'
        + b"x" * 200_000
        + b'"}]}\r\n\r\n'
        + b'data: {"choices":[{"text":"b"}]}\r\n\r\ndata: [DONE]\r\n\r\n'
    )
    for size in (1, 7, 1000, 65536):
        v = SSEValidator(strip_usage=False, max_event_bytes=1 << 20)
        pieces = (
            [stream[i : i + size] for i in range(0, len(stream), size)]
            if size > 1
            else [stream[:50], stream[50:200_050], *[stream[i : i + 1] for i in range(200_050, len(stream))]]
        )
        out = b"".join(v.feed(p) for p in pieces)
        v.end()
        assert out == stream.replace(b"\r\n", b"\n"), size
        assert len(v.pending) == 0


_PIECES = [
    b'data: {"choices":[{"text":"a"}]}\n\n',
    b'data: {"choices":[{"text":"b"}],"usage":null}\n\n',
    b'data: {"choices":[{"text":"\\u00e9"}],"usage":null}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n',
    b'data: {"a":1}\r\n\r\n',
    b"data: [DONE]\n\n",
    b": comment\n\n",
    b'data: {"x":1}\n\ndata: {"y":2}\n\n',
    b'data: {"half',
    b'"}\n\n',
    b"data: {}\n\n",
    b'data: {"e":1}\ndata: {"f":2}\n\n',
    b"data: {not json}\n\n",
    b'data: {"long":"' + b"z" * 90 + b'"}\n\n',
    b"\r",
    b"\n",
    b'data: {"c":3}\n\n\n\n',
]


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("strip", [False, True])
def test_sse_validator_one_event_fast_path_equals_the_general_path(seed: int, strip: bool) -> None:
    """Issue 23's per-token fast path (one whole ``data: {...}`` event) returns what the general path returns,
    raises where it raises, on random piece sequences (pending halves, CR line ends, [DONE], usage, garbage)."""
    import random

    from router.engine.sse import BadStream, SSEValidator

    rng = random.Random(seed)
    pieces = [_PIECES[0]] + [rng.choice(_PIECES) for _ in range(12)]
    fast = SSEValidator(strip_usage=strip, max_event_bytes=64)
    general = SSEValidator(strip_usage=strip, max_event_bytes=64)
    for piece in pieces:
        try:
            want: bytes | str = general._feed(piece)
        except BadStream as exc:
            want = f"bad: {exc}"
        try:
            got: bytes | str = fast.feed(piece)
        except BadStream as exc:
            got = f"bad: {exc}"
        assert got == want, (pieces, piece)
        if isinstance(want, str):
            break
        assert (fast.pending, fast.done, fast.checked, fast.carry_cr) == (
            general.pending,
            general.done,
            general.checked,
            general.carry_cr,
        )
