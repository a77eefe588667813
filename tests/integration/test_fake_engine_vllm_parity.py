"""The stand-in engine behaves like real vLLM by default (docs: ../shared/reference/real-vllm-cpu.md), with flags
for the old conveniences: usage on streams only when asked (or ``--enable-force-include-usage``), cached-token
details only with ``--enable-prompt-tokens-details``, silence when idle, vLLM's stream framing (one event per
HTTP chunk; a chat stream's role event), a reset's events published with the next step (or at once with
``--kv-publish-reset-now``), the CPU build's block sizes with ``--device cpu``, and a client that disconnects
aborts its generation (directly and through ``kvroute serve``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from membership.engine_metrics import parse_metrics
from membership.kv_decode import ClearedEvent, DecodedBatch, StoredEvent, decode_live_frames
from tests.helpers import Proc, free_port, http_chunks, start_fake_engine, wait_until

MODEL = "fake-m"


class Engine:
    """A running fake engine (vLLM dialect, events + replay) with ``extra`` flags."""

    def __init__(self, *extra: str, time_scale: str = "0.02") -> None:
        self.proc, self.port, self.ev, self.rp = start_fake_engine(
            "--model", MODEL, "--time-scale", time_scale, "--gpu-blocks", "2048", *extra
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.stop()


@pytest.fixture
def engine_factory() -> Iterator[type[Engine]]:
    started: list[Engine] = []

    class Tracked(Engine):
        def __init__(self, *extra: str, time_scale: str = "0.02") -> None:
            super().__init__(*extra, time_scale=time_scale)
            started.append(self)

    yield Tracked
    for e in started:
        e.stop()


def sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def complete(url: str, **body: object) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=10)
    assert r.status_code == 200, r.text
    return r


def test_usage_and_cached_token_details_like_vllm(engine_factory: type[Engine]) -> None:
    plain = engine_factory()
    prompt = list(range(100, 180))
    assert complete(plain.url, prompt=prompt).json()["usage"]["prompt_tokens_details"] is None
    assert all("usage" not in c for c in sse(complete(plain.url, prompt=prompt, stream=True).text))
    asked = sse(complete(plain.url, prompt=prompt, stream=True, stream_options={"include_usage": True}).text)
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 2
    assert asked[-1]["usage"]["prompt_tokens_details"] is None

    flagged = engine_factory("--enable-force-include-usage", "--enable-prompt-tokens-details")
    complete(flagged.url, prompt=prompt)
    last = sse(complete(flagged.url, prompt=prompt, stream=True).text)[-1]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # (80 - 1) // 16 full blocks


class Tap:
    """A SUB socket on an engine's events (connected before any traffic, so nothing is missed)."""

    def __init__(self, port: int) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def next_batch(self, timeout_s: float) -> DecodedBatch | None:
        """The next decoded batch within ``timeout_s`` seconds, or None when the engine published nothing."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        got = decode_live_frames(self.sock.recv_multipart())
        assert isinstance(got, DecodedBatch)
        return got

    def drain(self, quiet_s: float) -> list[DecodedBatch]:
        """Every batch until the engine stays silent for ``quiet_s`` seconds."""
        out = []
        while (b := self.next_batch(quiet_s)) is not None:
            out.append(b)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def _subscribed(e: Engine, tap: Tap) -> None:
    """Wait until the tap receives batches (ZMQ's slow joiner), sending one-block requests meanwhile."""
    n = [0]

    def probe() -> bool:
        n[0] += 1
        complete(e.url, prompt=list(range(50_000 + 17 * n[0], 50_017 + 17 * n[0])), max_tokens=1)
        return tap.next_batch(0.2) is not None

    wait_until(probe, timeout=15, what="the event subscription live")


def test_idle_engine_is_silent_and_a_reset_is_published_with_the_next_step(
    engine_factory: type[Engine],
) -> None:
    e = engine_factory()
    tap = Tap(e.ev)
    try:
        _subscribed(e, tap)
        complete(e.url, prompt=list(range(200, 264)))
        assert any(isinstance(ev, StoredEvent) for b in tap.drain(1.0) for ev in b.events)
        assert tap.next_batch(1.0) is None  # idle: nothing published, not even a heartbeat
        assert httpx.post(e.url + "/reset_prefix_cache").status_code == 200
        assert tap.next_batch(1.0) is None  # like vLLM: the reset waits for the engine's next step
        complete(e.url, prompt=list(range(300, 340)))
        first = tap.next_batch(5.0)
        assert first is not None and isinstance(first.events[0], ClearedEvent)
    finally:
        tap.close()


def test_reset_published_at_once_with_the_flag(engine_factory: type[Engine]) -> None:
    e = engine_factory("--kv-publish-reset-now")
    tap = Tap(e.ev)
    try:
        _subscribed(e, tap)
        tap.drain(0.5)
        assert httpx.post(e.url + "/reset_prefix_cache").status_code == 200
        got = tap.next_batch(5.0)
        assert got is not None and isinstance(got.events[0], ClearedEvent)
    finally:
        tap.close()


def test_cpu_device_takes_the_cpu_builds_block_sizes(engine_factory: type[Engine]) -> None:
    bad = Proc.kvroute("fake-engine", "--port", str(free_port()), "--device", "cpu", "--block-size", "16")
    try:
        assert bad.popen.wait(timeout=30) == 2
    finally:
        out = bad.stop()
    assert "No common block size for 16" in out
    e = engine_factory("--device", "cpu")
    assert parse_metrics(httpx.get(e.url + "/metrics").text).block_size == 128


def _running(url: str) -> int | None:
    return parse_metrics(httpx.get(url + "/metrics", timeout=5).text).running_requests


def test_client_disconnect_aborts_the_generation(engine_factory: type[Engine]) -> None:
    # realistic timing: 4,000 output tokens take the stand-in well over a minute
    e = engine_factory(time_scale="1")
    body = {"model": MODEL, "prompt": list(range(1, 200)), "max_tokens": 4000, "ignore_eos": True}
    with httpx.stream("POST", e.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert _running(e.url) == 1
                break  # leaving the line iterator closes the connection
    t0 = time.monotonic()
    wait_until(lambda: _running(e.url) == 0, timeout=10, what="the streamed generation aborted")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(e.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    wait_until(lambda: _running(e.url) == 0, timeout=10, what="the non-streamed generation aborted")
    assert time.monotonic() - t0 < 30
    snap = parse_metrics(httpx.get(e.url + "/metrics").text)
    assert snap.kv_usage == 0.0  # the aborted requests' blocks were unpinned


def test_client_disconnect_through_the_router_aborts_the_engines_generation(
    engine_factory: type[Engine],
) -> None:
    e = engine_factory(time_scale="1")
    port = free_port()
    router = Proc.kvroute(
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--replica",
        f"name=e0,url={e.url},model={MODEL},events=tcp://127.0.0.1:{e.ev},replay=tcp://127.0.0.1:{e.rp}",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: httpx.get(url + "/readyz", timeout=2).status_code == 200, timeout=30, what="router"
        )
        body = {
            "model": MODEL,
            "prompt": list(range(1, 200)),
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert _running(e.url) == 1
                    break  # leaving the line iterator closes the connection
        wait_until(
            lambda: _running(e.url) == 0, timeout=10, what="the engine's generation aborted via the router"
        )
    finally:
        router.stop()


def test_stream_framing_like_vllm(engine_factory: type[Engine]) -> None:
    """One SSE event per HTTP chunk; a chat stream opens with a role-only event (empty content), then the tokens'
    events without the role, as vLLM 0.32's does (``tests/real/test_engine_contract.py::test_stream_framing``)."""
    eng = engine_factory(time_scale="1")
    chat = http_chunks(
        eng.url,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi there " * 20}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert all(c.count(b"\n\n") == 1 for c in chat), chat
    events = [sse(c.decode()) for c in chat[:-1]]
    assert events[0][0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        all("role" not in e[0]["choices"][0]["delta"] for e in events[1:7])
        and events[1][0]["choices"][0]["delta"]
    )
    assert len(chat) == 1 + 6 + 1 + 1 and chat[-1] == b"data: [DONE]\n\n"  # role, tokens, usage, [DONE]
    completions = http_chunks(
        eng.url,
        "/v1/completions",
        {"model": MODEL, "prompt": "hello world " * 20, "max_tokens": 6, "stream": True},
    )
    assert len(completions) == 6 + 1 and all(c.count(b"\n\n") == 1 for c in completions), completions
