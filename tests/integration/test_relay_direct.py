"""The direct stream relay (issue 23): engine pieces are written to the client from the engine connection's read
callback (``router.engine.relay.Relay._sink``), through the real router process (``kvroute serve``) and raw loopback
engines. What must hold on that path, each checked here:

* every byte arrives, in order, and the pieces are counted by path (``kvroute_relayed_pieces_total``);
* a stream that keeps flowing longer than ``idle_timeout_s`` is not cut (the loop's wait times out while the
  sink takes pieces), and a stream that stalls is cut one ``idle_timeout_s`` after its last piece, not two;
* a client that does not read (flow control pauses the router's writes) still gets every byte: the pieces that
  arrive meanwhile wait for the request's task, and the order holds.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx

from tests.helpers import metric, wait_until
from tests.integration.engine_standins import RawEngine, Req, head, sse
from tests.integration.test_abuse_engine import BODY, serve


def _event(i: int, text: str) -> bytes:
    return sse(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
            "n": i,
        }
    )


def _paced(
    events: list[bytes], gap_s: float, stall_after: int | None = None, progress: list[int] | None = None
) -> RawEngine:
    """An engine streaming ``events`` one write each, ``gap_s`` apart (then ``[DONE]``), or stalling for 60 s
    after ``stall_after`` of them; ``progress`` gets the number of events written after each one."""

    async def answer(req: Req, writer: asyncio.StreamWriter) -> None:
        writer.write(head(ctype="text/event-stream"))
        for i, ev in enumerate(events):
            if stall_after is not None and i == stall_after:
                await asyncio.sleep(60)
            writer.write(ev)
            await writer.drain()
            if progress is not None:
                progress.append(i + 1)
            if gap_s:
                await asyncio.sleep(gap_s)
        writer.write(b"data: [DONE]\n\n")

    return RawEngine(answer)


def test_pieces_are_relayed_directly_in_order_and_counted() -> None:
    events = [_event(i, f"t{i} ") for i in range(120)]
    with _paced(events, 0.005) as eng, serve([eng]) as (u, _):
        r = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
        assert r.status_code == 200
        assert r.content == b"".join(events) + b"data: [DONE]\n\n"
        direct = metric(u, "kvroute_relayed_pieces_total", path="direct")
        task = metric(u, "kvroute_relayed_pieces_total", path="task")
        # pieces arrive 5 ms apart: nearly all of them go the direct way (the first goes with the headers)
        assert direct >= 100 and task >= 1, (direct, task)
        assert metric(u, "kvroute_upstream_errors_total") == 0


def test_sglangs_null_usage_is_cut_from_the_engines_bytes_on_the_direct_path() -> None:
    """SGLang's completions chunks end every token's event with ``"usage":null`` (json.dumps escapes the
    non-ASCII text here, as an engine may): a client that did not ask for usage gets the engine's bytes without
    that member, escapes and all, each piece written directly; one that asked gets them untouched."""
    events = [
        sse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "text": f"caf\u00e9 {i}", "logprobs": None, "matched_stop": None}],
                "usage": None,
            }
        )
        for i in range(120)
    ]
    assert b"\\u00e9" in events[0] and events[0].endswith(b',"usage":null}\n\n')
    with _paced(events, 0.005) as eng, serve([eng]) as (u, _):
        r = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
        assert r.status_code == 200
        want = b"".join(e.replace(b',"usage":null}', b"}") for e in events) + b"data: [DONE]\n\n"
        assert r.content == want
        assert metric(u, "kvroute_relayed_pieces_total", path="direct") >= 100
        asked = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        r = httpx.post(u + "/v1/completions", json=asked, timeout=30)
        assert r.content == b"".join(events) + b"data: [DONE]\n\n"


def test_a_stream_flowing_longer_than_the_idle_timeout_is_not_cut() -> None:
    events = [_event(i, "x") for i in range(16)]  # one piece every 0.25 s: 4 s of stream, idle timeout 1 s
    with _paced(events, 0.25) as eng, serve([eng], "--idle-timeout-s", "1") as (u, _):
        r = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
        assert r.status_code == 200
        assert r.content == b"".join(events) + b"data: [DONE]\n\n", r.text[-300:]
        assert metric(u, "kvroute_upstream_errors_total", reason="idle_timeout") == 0


def test_a_stalled_stream_is_cut_one_idle_timeout_after_its_last_piece() -> None:
    events = [_event(i, "x") for i in range(30)]
    idle = 2.0
    with _paced(events, 0.05, stall_after=10) as eng, serve([eng], "--idle-timeout-s", str(idle)) as (u, _):
        last = 0.0
        body = b""
        with httpx.stream("POST", u + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():
                if b"event: error" not in chunk:
                    last = time.monotonic()
                body += chunk
        cut_after = time.monotonic() - last
        assert body.startswith(b"".join(events[:10])) and b"idle_timeout" in body, body[-300:]
        # one idle timeout after the last piece (a relay that only noticed its own silence would take two)
        assert idle * 0.9 <= cut_after < idle * 1.6, cut_after
        assert metric(u, "kvroute_upstream_errors_total", reason="idle_timeout") == 1


def test_a_client_that_does_not_read_still_gets_every_byte_in_order() -> None:
    # ~24 MB of events written as fast as the engine can: more than every buffer between it and the client holds
    events = [_event(i, f"{i:06d}" + "y" * 4000) for i in range(6000)]
    progress: list[int] = []
    with _paced(events, 0.0, progress=progress) as eng, serve([eng]) as (u, _):
        host, port = u.removeprefix("http://").split(":")
        payload = httpx.Request("POST", u + "/v1/completions", json={**BODY, "stream": True})
        raw = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload.content)}\r\nconnection: close\r\n\r\n"
        ).encode() + payload.content
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            s.sendall(raw)
            # the client reads nothing until the engine is blocked: every buffer on the way is full, so the
            # router's writes to the client were paused (flow control) and it stopped reading from the engine
            seen: list[int] = []

            def engine_blocked() -> bool:
                seen.append(len(progress))
                return len(seen) > 5 and seen[-1] == seen[-6] > 0

            wait_until(
                engine_blocked, timeout=30, interval=0.1, what="the engine blocked by the full pipeline"
            )
            assert len(progress) < len(events)
            got = bytearray()
            while True:
                data = s.recv(1 << 20)
                if not data:
                    break
                got += data
        head_end = got.index(b"\r\n\r\n")
        body = _dechunk(bytes(got[head_end + 4 :]))
        assert body == b"".join(events) + b"data: [DONE]\n\n"
        task = metric(u, "kvroute_relayed_pieces_total", path="task")
        direct = metric(u, "kvroute_relayed_pieces_total", path="direct")
        assert direct >= 1 and task >= 2, (direct, task)  # some pieces waited for the slow client


def _dechunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked transfer encoding."""
    out = bytearray()
    pos = 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        pos = eol + 2
        if size == 0:
            return bytes(out)
        out += data[pos : pos + size]
        assert data[pos + size : pos + size + 2] == b"\r\n"
        pos += size + 2


def test_a_stream_under_an_idempotency_key_is_stored_whole_and_replayed_whole() -> None:
    """The idempotency guard keeps a copy of the stream it sees: such a stream does not take the direct path
    (pieces written from the read callback would be missing from the stored copy and from its replay)."""
    from tests.redis_server import RedisServer

    events = [_event(i, f"t{i} ") for i in range(60)]
    server = RedisServer().start()
    try:
        with _paced(events, 0.005) as eng, serve([eng], "--redis-url", server.url) as (u, _):
            wait_until(
                lambda: metric(u, "kvroute_redis_available") == 1.0, timeout=10, what="redis connected"
            )
            key = {"idempotency-key": "stream-1"}
            first = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, headers=key, timeout=30)
            assert first.status_code == 200 and first.content == b"".join(events) + b"data: [DONE]\n\n"
            assert metric(u, "kvroute_relayed_pieces_total", path="direct") == 0
            again = wait_until(
                lambda: (
                    (
                        r := httpx.post(
                            u + "/v1/completions", json={**BODY, "stream": True}, headers=key, timeout=30
                        )
                    ).status_code
                    == 200
                    and r.headers.get("idempotent-replayed") == "true"
                    and r
                ),
                timeout=10,
                what="the stored stream replayed",
            )
            assert isinstance(again, httpx.Response) and again.content == first.content
            assert len(eng.posts()) == 1
            # without the key the same stream goes the direct way
            plain = httpx.post(u + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
            assert plain.content == first.content
            assert metric(u, "kvroute_relayed_pieces_total", path="direct") > 0
    finally:
        server.stop()
