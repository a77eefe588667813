"""Engines that misbehave, through the real router process (``kvroute serve``) on loopback, bounded loops only.

Each test is one item of issue 24 / issue 18 and fails on the main branch before the fix:
* endless / stalled / oversized engine responses are cut with a clear error, the router's memory stays bounded;
* one engine's absurd metrics neither fail routing for its model nor win every decision;
* ``https://`` engines are proxied with certificate verification (``engine_ca_bundle``);
* garbage event streams end in a clean error and are never stored as a complete idempotent answer;
* an engine block size other than the router's is reported (``/replicas``, metric) and predictions follow it;
* streams ask the engine for usage (and hide it from clients that did not ask); missing cached-token details
  from a default vLLM are counted and logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tests.helpers import Proc, free_port, metric, wait_until
from tests.integration.engine_standins import (
    RawEngine,
    Req,
    head,
    json_response,
    metrics_page,
    self_signed,
    server_context,
    sse,
    vllm_like,
)

BODY = {"model": "m", "prompt": "an abuse test prompt " * 8, "max_tokens": 2}


@contextlib.contextmanager
def serve(
    engines: Sequence[RawEngine], *args: str, ready: int | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[str, Proc]]:
    """``kvroute serve`` in front of ``engines`` (named e0, e1, ...); waits until ``ready`` are routable."""
    port = free_port()
    cmd = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokenizer-mode",
        "bytes",
        "--probe-interval-s",
        "0.3",
        "--scrape-interval-s",
        "0.2",
        "--log-level",
        "warning",
        "--log-format",
        "text",
        "--max-retries",
        "0",
    ]
    for i, e in enumerate(engines):
        cmd += ["--replica", f"name=e{i},url={e.url},model=m"]
    proc = Proc.kvroute(*cmd, *args, env=env)
    url = f"http://127.0.0.1:{port}"
    want = len(engines) if ready is None else ready
    try:
        if want:
            wait_until(
                lambda: httpx.get(url + "/readyz", timeout=1).json().get("routable_replicas") == want,
                timeout=30,
                what=f"{want} routable replicas",
            )
        else:
            wait_until(
                lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, timeout=30, what="up"
            )
        yield url, proc
    finally:
        out = proc.stop()
        assert "Traceback" not in out, out[-3000:]


def rss_mb(proc: Proc) -> float:
    """Resident memory of a process, MB."""
    for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- 24.7: engine responses are bounded ---------------------------------------------------------------------------


async def _endless_body(req: Req, writer: asyncio.StreamWriter) -> None:
    """A non-streamed JSON body that never ends (capped at 256 MiB so the test stays bounded on main too)."""
    writer.write(head(transfer_encoding="chunked") + b"%x\r\n%s\r\n" % (len(b'{"x": "'), b'{"x": "'))
    piece = b"a" * 65536
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    for _ in range(4096):
        writer.write(chunk)
        await writer.drain()


async def _stalled_body(req: Req, writer: asyncio.StreamWriter) -> None:
    """Headers and a few body bytes, then silence (bounded: 60 s)."""
    writer.write(head(content_length="1000") + b'{"choices": [')
    await writer.drain()
    await asyncio.sleep(60)


async def _endless_header(req: Req, writer: asyncio.StreamWriter) -> None:
    """One header line that never ends (capped at 128 MiB)."""
    writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
    piece = b"h" * 65536
    for _ in range(2048):
        writer.write(piece)
        await writer.drain()


async def _many_headers(req: Req, writer: asyncio.StreamWriter) -> None:
    """Ten thousand small headers, then a valid body."""
    writer.write(
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"x-h%d: v\r\n" % i for i in range(10000))
        + b"content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
    )


def test_oversized_endless_and_stalled_engine_responses_are_cut_with_clear_errors() -> None:
    with (
        RawEngine(_endless_body) as endless,
        serve([endless], "--engine-max-body-bytes", str(4 << 20), "--total-timeout-s", "30") as (u, proc),
    ):
        base = rss_mb(proc)
        for _ in range(3):
            r = httpx.post(u + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 502, r.text[:300]
            err = r.json()["error"]
            assert err["code"] == "upstream_body_too_large" and "engine_max_body_bytes" in err["message"]
        assert rss_mb(proc) - base < 100, (base, rss_mb(proc))
        assert metric(u, "kvroute_upstream_errors_total", reason="body_too_large") == 3
    with (
        RawEngine(_stalled_body) as stalled,
        serve([stalled], "--engine-body-idle-timeout-s", "1", "--total-timeout-s", "20") as (u, _),
    ):
        t0 = time.monotonic()
        r = httpx.post(u + "/v1/completions", json=BODY, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_body_stalled", r.text
        assert "engine_body_idle_timeout_s" in r.json()["error"]["message"]
        assert took < 10, took  # cut after ~1 s of silence, not at total_timeout_s
    for answer, what in ((_endless_header, "engine_max_header_bytes"), (_many_headers, "engine_max_headers")):
        with RawEngine(answer) as bad, serve([bad], "--first-byte-timeout-s", "20") as (u, proc):
            base = rss_mb(proc)
            r = httpx.post(u + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 502 and what in r.json()["error"]["message"], r.text[:300]
            assert rss_mb(proc) - base < 100


# -- 24.8: one engine's metrics never break routing for its model ------------------------------------------------


async def _ok(req: Req, writer: asyncio.StreamWriter) -> None:
    writer.write(
        json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    )


def test_absurd_engine_gauges_neither_fail_nor_win_routing() -> None:
    huge = RawEngine(_ok, metrics=lambda: metrics_page(waiting="1e308"))
    negative = RawEngine(_ok, metrics=lambda: metrics_page(waiting="-1000", running="-5"))
    sane = RawEngine(_ok, metrics=lambda: metrics_page(waiting="1"))
    with huge, negative, sane, serve([huge, negative, sane], "--policy", "ttft") as (u, _):
        wait_until(
            lambda: (
                metric(u, "kvroute_engine_gauge_rejected_total", replica="e0", gauge="queued_requests") >= 1
                and metric(u, "kvroute_engine_gauge_rejected_total", replica="e1", gauge="running_requests")
                >= 1
            ),
            timeout=10,
            what="absurd gauges scraped and rejected",
        )
        for i in range(6):
            r = httpx.post(u + "/route", json={"model": "m", "prompt": f"route {i} " * 20}, timeout=10)
            assert r.status_code == 200, r.text
            for c in r.json()["candidates"]:
                assert c["predicted_ttft_s"] is not None and c["predicted_ttft_s"] >= 0, c
                assert c["Q"] is None or c["Q"] >= 0, c
            done = httpx.post(u + "/v1/completions", json={**BODY, "prompt": f"c {i} " * 20}, timeout=10)
            assert done.status_code == 200, done.text
        reps = {x["name"]: x for x in httpx.get(u + "/replicas", timeout=5).json()["replicas"]}
        assert reps["e0"]["load"]["queued_requests"] is None  # unknown, not 1e308
        assert (
            reps["e1"]["load"]["queued_requests"] is None and reps["e1"]["load"]["running_requests"] is None
        )
        assert reps["e2"]["load"]["queued_requests"] == 1


# -- 24.9: https engines ------------------------------------------------------------------------------------------


def test_https_engine_is_proxied_with_the_configured_ca_and_refused_without(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with RawEngine(vllm_like(prompt_tokens_details=True), tls=server_context(cert, key)) as eng:
        with serve([eng], "--engine-ca-bundle", str(cert)) as (u, _):  # probes pass over TLS: ready
            r = httpx.post(u + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
            s = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, timeout=10)
            assert s.status_code == 200 and s.text.endswith("data: [DONE]\n\n"), s.text
            assert metric(u, "kvroute_engine_scrapes_total", replica="e0") >= 1  # scrapes over TLS too
        # without the CA: the probes fail with a clear TLS error and the replica never becomes routable (the
        # proxy's own TLS error for a ready replica: tests/unit/test_router_proxy.py)
        with serve([eng], ready=0) as (u, _):

            def probe_error() -> str:
                rep = httpx.get(u + "/replicas", timeout=5).json()["replicas"][0]
                return str(rep["health"].get("last_error") or "")

            wait_until(
                lambda: "CERTIFICATE_VERIFY_FAILED" in probe_error(), timeout=10, what="TLS probe error"
            )
            r = httpx.post(u + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 503, r.text


# -- 24 (low): garbage event streams ------------------------------------------------------------------------------


def _sse_answer(parts: list[bytes]) -> RawEngine:
    async def answer(req: Req, writer: asyncio.StreamWriter) -> None:
        writer.write(head(ctype="text/event-stream"))
        for p in parts:
            writer.write(p)
            await writer.drain()
            await asyncio.sleep(0.01)

    return RawEngine(answer)


FIRST = sse({"choices": [{"index": 0, "text": "a"}]})


def test_garbage_event_streams_end_in_a_clean_error() -> None:
    cases = [
        ([b"\x00\xff garbage {{{\n\n"], 502),  # garbage from the start: a plain 502
        ([FIRST, b"data: not json at all\n\n"], 200),  # garbage mid-stream: an SSE error event
        ([FIRST, b"\x00\x01\x02 binary junk\n\n"], 200),
        ([FIRST], 200),
    ]  # the stream ends without data: [DONE]
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"  # the caller's: the error names it (``error.trace_id``)
    traced = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    for parts, status in cases:
        with _sse_answer(parts) as eng, serve([eng]) as (u, _):
            r = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, headers=traced, timeout=10)
            assert r.status_code == status, (parts, r.text)
            if status == 502:
                assert r.json()["error"]["code"] == "upstream_bad_stream"
                assert r.json()["error"]["trace_id"] == trace_id, r.text
            else:
                assert r.text.startswith(FIRST.decode()) and "event: error" in r.text, r.text
                assert "bad_stream" in r.text and "data: [DONE]" not in r.text
                event = r.text.split("event: error\ndata: ", 1)[1].split("\n\n", 1)[0]
                assert json.loads(event)["error"]["trace_id"] == trace_id, r.text
            assert metric(u, "kvroute_upstream_errors_total", reason="bad_stream") == 1


def test_garbage_stream_is_never_stored_as_a_complete_idempotent_answer() -> None:
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        with (
            _sse_answer([FIRST, b"data: {{{{ broken\n\n", b"data: [DONE]\n\n"]) as eng,
            serve([eng], "--redis-url", server.url) as (u, _),
        ):
            wait_until(
                lambda: metric(u, "kvroute_redis_available") == 1.0, timeout=10, what="redis connected"
            )
            key = {"idempotency-key": "garbage-1"}
            first = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, headers=key, timeout=10)
            # the first chunk and the garbage may reach the router in one read (a loaded machine): then the garbage
            # comes before the first byte and the answer is a 502; either way it is an error, never a success
            assert (first.status_code == 200 and "event: error" in first.text) or (
                first.status_code == 502 and "upstream_bad_stream" in first.text
            ), (first.status_code, first.text)
            again = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, headers=key, timeout=10)
            # the failed stream released its key: the retry ran again (not a replay of the garbage)
            assert "idempotent-replayed" not in again.headers and len(eng.posts()) == 2, again.headers
    finally:
        server.stop()


# -- 18.3: the engine's block size ---------------------------------------------------------------------------------


def test_engine_block_size_is_compared_reported_and_used_for_predictions() -> None:
    eng = RawEngine(vllm_like(prompt_tokens_details=True), metrics=lambda: metrics_page(block_size=32))
    with eng, serve([eng], "--block-size", "16", "--policy", "ttft") as (u, proc):
        wait_until(
            lambda: metric(u, "kvroute_engine_block_size_mismatch", replica="e0") == 1,
            timeout=10,
            what="block size scraped",
        )
        rep = httpx.get(u + "/replicas", timeout=5).json()["replicas"][0]
        assert rep["engine"]["block_size"] == 32 and rep["engine"]["router_block_size"] == 16
        assert rep["engine"]["block_size_mismatch"] is True and rep["load"]["engine_block_size"] == 32
        # bytes tokenizer: 4 bytes per token; 48 tokens = 3 router blocks, the engine caches only 1 block of 32
        prompt = "abcd" * 48
        assert (
            httpx.post(u + "/v1/completions", json={**BODY, "prompt": prompt}, timeout=10).status_code == 200
        )
        d = httpx.post(u + "/route", json={"model": "m", "prompt": prompt + "efgh" * 40}, timeout=10).json()
        assert d["candidates"][0]["cached_tokens"] == 32, d["candidates"][0]  # not 48: whole engine blocks
    assert proc.output().count("uses KV block size 32, the router 16") == 1


# -- 18.4: cached-token feedback from a default vLLM ---------------------------------------------------------------


def test_streams_ask_for_usage_and_hide_it_from_clients_that_did_not() -> None:
    eng = RawEngine(vllm_like(cached=7))
    with eng, serve([eng]) as (u, _):
        r = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, timeout=10)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert '"usage"' not in r.text and r.text.count("data: {") == 3, r.text
        sent = eng.posts()[-1].json()
        assert sent["stream_options"] == {"include_usage": True}  # the router asked the engine for usage
        wait_until(
            lambda: metric(u, "kvroute_engine_cached_tokens_total") == 7,
            timeout=5,
            what="the engine's cached tokens fed back",
        )
        # a client that asks gets the usage chunk as the engine sent it
        r = httpx.post(
            u + "/v1/completions",
            json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
            timeout=10,
        )
        chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
        # a client that explicitly says no is treated like one that did not ask
        r = httpx.post(
            u + "/v1/completions",
            json={**BODY, "stream": True, "stream_options": {"include_usage": False}},
            timeout=10,
        )
        assert '"usage"' not in r.text and eng.posts()[-1].json()["stream_options"]["include_usage"] is True


def test_missing_prompt_tokens_details_is_counted_and_logged_once() -> None:
    eng = RawEngine(vllm_like(prompt_tokens_details=False))
    with eng, serve([eng], "--log-level", "warning") as (u, proc):
        for i in range(3):
            r = httpx.post(u + "/v1/completions", json={**BODY, "prompt": f"p{i} " * 30}, timeout=10)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"] is None
        assert (
            metric(u, "kvroute_engine_usage_missing_total", replica="e0", what="prompt_tokens_details") == 3
        )
        assert metric(u, "kvroute_cached_tokens_match_total") == 0  # nothing to compare: no report
    assert proc.output().count("--enable-prompt-tokens-details") == 1


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loopback only: never through a proxy from the environment."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
